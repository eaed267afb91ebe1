"""The Ling3 hybrid LM: embeddings -> [KDA | MLA] x (dense | MoE) layers -> final norm -> fp32 logits (+ MTP).

Logits, routing and every statistic are fp32 whatever the compute dtype, float64 when it is float64 (dtypes
`lingpack.precision.DTYPES`; float64 runs in JAX's x64 mode).

Layer pattern (docs/design.md#ling3-layer-pattern): layer i (0-indexed) is MLA iff
(i + 1) % inhomogeneous_layer_cycle_interval == 0, else KDA; layers i < first_dense_layers use a dense
SwiGLU (mlp_dim), the rest MoE. MTP layers are MLA. Every input is packed: `segment_ids` (1, 2, 3... per
row, 0 = padding) keep documents apart in every mixer (KDA state, short conv, attention mask, MTP rolls);
`positions` (restarting per document) drive RoPE.

Logical axis names on parameters (mapped to mesh axes by `train/sharding.py`):
  vocab    vocabulary (embedding rows, output head columns)
  embed    model width D
  mlp      SwiGLU / expert hidden width
  heads    flattened head features (H * head_dim) of q/k/v/o projections, KDA gate and conv channels
  kv       a per-head feature axis of width head_dim (KDA low-rank gate/output-gate bottleneck)
  q_lora   MLA query latent;   kv_lora  MLA key/value latent (+ shared rope key)
  exp      experts (router columns, expert weights, expert bias)
  norm     norm weights
  conv     short-convolution taps
`None` marks a replicated axis (MTP's eh_proj input, the layer-stack axis of scanned layers). Parameters
without weight decay: norm weights, `A_log`, `dt_bias`; `ExpertBias` variables are not parameters at all.

Depth: with `scan_layers`, the MoE layers (all layers after the dense ones) live stacked in `stack`
(models/stack.py: mixer halves per mixer, FFN halves in layer order) and run under one `lax.scan`; the dense
layers stay unrolled in `layers`. `layer_parts(i)` finds layer i's submodules. The weights are built unrolled
first, so a scanned and an unrolled model of one seed are the same model.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
from flax import nnx, struct

from lingpack.kernels.attention.api import CHOICES as ATTENTION_CHOICES
from lingpack.kernels.attention.api import FP32_KERNELS as ATTENTION_FP32_KERNELS
from lingpack.kernels.kda import api as kda_api
from lingpack.kernels.short_conv import BACKWARDS as SHORT_CONV_BACKWARDS
from lingpack.models.block import DecoderLayer, LayerSpec, parts
from lingpack.models.head import LMHead, head_matmul  # noqa: F401  (head_matmul re-exported)
from lingpack.models.kda import KDAConfig, KDAKernel
from lingpack.models.layers import DEFAULT_INIT, RMSNorm, partitioned
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoE, MoEConfig
from lingpack.models import remat as remat_lib
from lingpack.models.mtp import MTPConfig, MTPLayer, roll_and_mask_by_segment
from lingpack.models.stack import LayerStack
from lingpack.parallel.layout import BTD, constrain
from lingpack.precision import as_dtype, at_least_fp32

# What a remat'ed layer keeps for the backward pass, by name (models/remat.py); the rest is recomputed.
REMAT_POLICIES = remat_lib.POLICIES


def checkpoint_in_order(fn, policy):
    """`jax.checkpoint(fn, policy=policy)` whose backward recomputes only once its output's cotangent exists.

    A plain checkpoint's recomputation depends on the saved inputs alone, so XLA may schedule every unrolled
    layer's recomputed forward at the start of the backward pass, all live at once (remat in name only;
    the layer scan is immune: its loop runs one layer at a time). Tying the residuals to the cotangent with
    an optimization barrier orders each layer's recomputation after the layers above it. A second barrier
    hands on the layer's input cotangent only with its parameters' gradients: XLA:TPU otherwise reduced the
    unrolled layers' weight gradients over the FSDP axis (a full-size all-reduce, then a slice) just before
    the update, every layer's full-size fp32 gradient live through the whole backward.
    """
    checkpointed = jax.checkpoint(fn, policy=policy)

    @jax.custom_vjp
    def call(*args):
        return checkpointed(*args)

    def fwd(*args):
        return jax.vjp(checkpointed, *args)    # residuals: the vjp closure (inputs + what the policy saves)

    def bwd(vjp_fn, g):
        anchor = 0.0 * jnp.ravel(jax.tree.leaves(g)[0])[0].astype(jnp.float32)  # 0, but only once g exists
        tie = lambda r: r + anchor.astype(r.dtype) if jnp.issubdtype(r.dtype, jnp.floating) else r
        return jax.lax.optimization_barrier(jax.tree.map(tie, vjp_fn)(g))

    call.defvjp(fwd, bwd)
    return call


@dataclasses.dataclass(frozen=True)
class Ling3Config:
    vocab_size: int = 512
    emb_dim: int = 64
    num_layers: int = 4
    inhomogeneous_layer_cycle_interval: int = 4
    first_dense_layers: int = 1
    mlp_dim: int = 128
    norm_eps: float = 1e-6
    dtype: str = "float32"            # compute dtype
    param_dtype: str = "float32"
    mtp_num_layers: int = 1
    kda_impl: str = "chunked"
    kda_chunk_size: int = 64
    kda_max_segs: int | None = None
    kda_interpret: bool | None = None  # Pallas KDA kernels: None = interpret mode off TPU
    kda_short_conv: str = "xla"        # the short convs' backward: xla, or pallas (kernels/short_conv.py)
    attention_impl: str = "dot_product"
    attention_block_size: int = 128
    remat: bool = False
    remat_policy: str = "nothing_saveable"   # with remat: see REMAT_POLICIES (models/remat.py)
    remat_policy_kda: str | None = None      # per-part overrides of remat_policy (None: follow it)
    remat_policy_mla: str | None = None
    remat_policy_moe: str | None = None
    scan_layers: bool = True                 # one scan over the MoE layers (compile time flat in depth)
    tie_embeddings: bool = False
    vocab_chunk_size: int = 0               # head + cross-entropy in equal chunks of at most this many columns; 0 = whole
    fused_head_rows: int = 0                # training: the heads' gradients formed in the loss's forward, R rows at a time; 0 = off
    init_from: str | None = None            # a transformers directory the run's weights start from (export/)
    kda: KDAConfig = KDAConfig()
    mla: MLAConfig = MLAConfig()
    moe: MoEConfig = MoEConfig()
    mtp: MTPConfig = MTPConfig()

    def __post_init__(self):
        for name in ("vocab_size", "emb_dim", "num_layers", "mlp_dim", "inhomogeneous_layer_cycle_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ValueError(f"first_dense_layers must lie in [0, num_layers={self.num_layers}]; got {self.first_dense_layers}")
        if self.vocab_chunk_size < 0:
            raise ValueError(f"vocab_chunk_size must be >= 0 (0 = the whole vocabulary at once); got {self.vocab_chunk_size}")
        if self.fused_head_rows < 0:
            raise ValueError(f"fused_head_rows must be >= 0 (0 = off: autodiff through the head); got {self.fused_head_rows}")
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers must be >= 0; got {self.mtp_num_layers}")
        if self.attention_impl not in ATTENTION_CHOICES:
            raise ValueError(f"unknown attention_impl {self.attention_impl!r}; valid choices: {list(ATTENTION_CHOICES)}")
        if self.kda_impl not in kda_api.names():
            raise ValueError(f"unknown kda_impl {self.kda_impl!r}; valid choices: {list(kda_api.names())}")
        if self.kda_short_conv not in SHORT_CONV_BACKWARDS:
            raise ValueError(f"kda_short_conv must be one of {SHORT_CONV_BACKWARDS}; got {self.kda_short_conv!r}")
        if kda_api.needs_max_segs(self.kda_impl) and not self.kda_max_segs:
            raise ValueError(f"kda_impl={self.kda_impl!r} needs kda_max_segs (the most documents per batch); set it")
        remat_lib.check(self.remat_policy, self.remat_overrides())
        as_dtype(self.dtype), as_dtype(self.param_dtype)
        if "float64" in (self.dtype, self.param_dtype):
            if self.kda_impl.startswith("pallas"):
                raise ValueError(f"kda_impl={self.kda_impl!r} is a TPU kernel computing in fp32 (TPUs have no "
                                 "float64); a float64 model needs kernel=chunked or kernel=reference")
            if self.kda_short_conv == "pallas":
                raise ValueError("kda_short_conv='pallas' is a TPU kernel computing in fp32; a float64 model needs "
                                 "kernel.short_conv=xla")
            if self.attention_impl in ATTENTION_FP32_KERNELS:
                raise ValueError(f"attention_impl={self.attention_impl!r} is a Pallas kernel computing in fp32; a "
                                 "float64 model needs model.attention_impl=dot_product, flash or auto")

    def remat_overrides(self) -> dict:
        """{part: policy name or None} of the per-part `remat_policy_<part>` keys."""
        return {"kda": self.remat_policy_kda, "mla": self.remat_policy_mla, "moe": self.remat_policy_moe}   # OVERRIDABLE

    def jax_remat_policy(self):
        """The `jax.checkpoint` policy of every remat'ed layer (everything saveable without `remat`)."""
        if not self.remat:
            return jax.checkpoint_policies.everything_saveable
        return remat_lib.jax_policy(self.remat_policy, self.remat_overrides())

    def layer_kinds(self) -> list[tuple[str, str]]:
        """(mixer, ffn) per main layer, e.g. [('kda', 'dense'), ('kda', 'moe'), ('kda', 'moe'), ('mla', 'moe')]."""
        interval = self.inhomogeneous_layer_cycle_interval
        return [("mla" if (i + 1) % interval == 0 else "kda", "dense" if i < self.first_dense_layers else "moe")
                for i in range(self.num_layers)]

    def scanned_layers(self) -> range:
        """Main layers run by the layer scan: the MoE ones (after the dense layers), if `scan_layers` and they are at
        least two cycles long; fewer compile faster unrolled (XLA:CPU codegen runs in parallel outside loops)."""
        start, interval = self.first_dense_layers, self.inhomogeneous_layer_cycle_interval
        scan = self.scan_layers and self.num_layers - start >= 2 * interval
        return range(start, self.num_layers) if scan else range(0)

    def layer_spec(self, mixer: str, ffn: str) -> LayerSpec:
        kernel = KDAKernel(self.kda_impl, self.kda_chunk_size, self.kda_max_segs, self.kda_interpret,
                           self.kda_short_conv)
        return LayerSpec(mixer, ffn, self.emb_dim, self.mlp_dim, self.norm_eps, self.kda, kernel, self.mla,
                         self.attention_impl, self.attention_block_size, self.moe)


@struct.dataclass
class Ling3Output:
    head: LMHead                   # main head, unevaluated (models/head.py): position t predicts targets[t]
    mtp_heads: list                # per MTP depth d, an LMHead: position t predicts targets[t + 1 + d]
    moe_aux: dict                  # router_z_loss [L_moe], load_counts [L_moe, E], num_tokens [L_moe]
    hidden_BTD: jax.Array          # final hidden state before the final norm

    @property
    def logits_BTV(self) -> jax.Array:
        """fp32 [B, T, V] logits of the main head (materialised; the loss reads `head` instead)."""
        return self.head.logits()

    @property
    def mtp_logits(self) -> list:
        return [h.logits() for h in self.mtp_heads]


class Ling3(nnx.Module):
    def __init__(self, cfg: Ling3Config, rngs: nnx.Rngs = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.cfg = cfg
        dtype, param_dtype = as_dtype(cfg.dtype), as_dtype(cfg.param_dtype)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.emb_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                      embedding_init=partitioned(DEFAULT_INIT, ("vocab", "embed")))
        layers = [DecoderLayer(cfg.layer_spec(m, f), **kw) for m, f in cfg.layer_kinds()]
        scanned = cfg.scanned_layers()
        self.layers = nnx.List(layers[:scanned.start] if scanned else layers)  # the unrolled ones
        self.stack = LayerStack(layers[scanned.start:]) if scanned else None
        self.norm = RMSNorm(cfg.emb_dim, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(partitioned(DEFAULT_INIT, ("embed", "vocab"))(
                rngs.params(), (cfg.emb_dim, cfg.vocab_size), param_dtype))
        mtp_ffn = "moe" if cfg.mtp.use_moe else "dense"
        self.mtp_layers = nnx.List([MTPLayer(cfg.layer_spec("mla", mtp_ffn), **kw) for _ in range(cfg.mtp_num_layers)])

    def layer_parts(self, i: int) -> dict:
        """{submodule name (input_layernorm, self_attn, post_attention_layernorm, mlp): (module holding it for
        main layer i, index into its stack axis: () for an unrolled layer)}."""
        if not 0 <= i < self.cfg.num_layers:
            raise IndexError(f"layer {i} out of range for num_layers={self.cfg.num_layers}")
        scanned = self.cfg.scanned_layers()
        return self.stack.parts(i - scanned.start) if i in scanned else parts(self.layers[i])

    def moe_layers(self) -> list[tuple[MoE, tuple[int, ...]]]:
        """(MoE module, stack index) in `moe_aux` stacking order: main layers, then MTP layers."""
        located = [self.layer_parts(i)["mlp"] for i, (_, ffn) in enumerate(self.cfg.layer_kinds()) if ffn == "moe"]
        return located + [(m.block.mlp, ()) for m in self.mtp_layers if m.block.ffn == "moe"]

    def embed(self, inputs_BT: jax.Array) -> jax.Array:
        """Token embeddings [B, T, D] in the compute dtype. Under a layout the table is first gathered over its
        model width (an FSDP gather), so each device looks up its own rows' tokens."""
        table_VD = self.embed_tokens.embedding[...].astype(self.embed_tokens.dtype)
        return jnp.take(constrain(table_VD, ("vocab", None)), inputs_BT, axis=0)

    def head(self, h_BTD: jax.Array) -> LMHead:
        """Final norm, then the unevaluated fp32 head (fp32 weights and product: softmax over a large vocab needs
        it; float64 for a float64 model); its cross-entropy runs per `vocab_chunk_size` columns when that is set, and
        the training loss forms its gradient in the forward with `fused_head_rows` (models/head.py)."""
        h = self.norm(h_BTD)
        h = h.astype(at_least_fp32(h.dtype))
        if self.cfg.tie_embeddings:   # the [V, D] table itself: chunks slice its rows, nothing is transposed
            return LMHead(h, self.embed_tokens.embedding[...].astype(h.dtype), 0, self.cfg.vocab_chunk_size,
                          self.cfg.fused_head_rows)
        return LMHead(h, self.lm_head[...].astype(h.dtype), 1, self.cfg.vocab_chunk_size, self.cfg.fused_head_rows)

    def logits(self, h_BTD: jax.Array) -> jax.Array:
        """fp32 [B, T, V] logits of a final hidden state (the head, materialised)."""
        return self.head(h_BTD).logits()

    def __call__(self, inputs_BT: jax.Array, segment_ids_BT: jax.Array | None = None,
                 positions_BT: jax.Array | None = None, *, input_embeddings_BTD: jax.Array | None = None) -> Ling3Output:
        """Token ids int32 [B, T] (or `input_embeddings_BTD` replacing their lookup) -> Ling3Output."""
        B, T = inputs_BT.shape
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        segment_ids_BT = segment_ids_BT.astype(jnp.int32)

        policy = self.cfg.jax_remat_policy()

        def run(layer, *args):
            if not self.cfg.remat:
                return layer(*args)
            # jax.checkpoint over the split (pure) layer: a layer call mutates nothing, and nnx.remat's
            # write-back fails on variables made at an outer trace level (a model merged under jit, then grad)
            graphdef, state = nnx.split(layer)
            call = lambda state, *args: nnx.merge(graphdef, state)(*args)
            return checkpoint_in_order(call, policy)(state, *args)

        # named scopes (embed, layer<i>, stack, head, mtp<d>) label the compiled program's ops (lingpack.plan.hlo)
        with jax.named_scope("embed"):
            emb_BTD = self.embed(inputs_BT) if input_embeddings_BTD is None else input_embeddings_BTD
            emb_BTD = constrain(emb_BTD, BTD)  # rows stay split from here to the loss (parallel/layout.py)
        x = emb_BTD
        aux = []  # per-layer MoE statistics, each with a leading layer axis
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer{i}"):
                x, layer_aux = run(layer, x, segment_ids_BT, positions_BT)
            aux.append(None if layer_aux is None else jax.tree.map(lambda a: a[None], layer_aux))
        if self.stack is not None:
            with jax.named_scope("stack"):
                x, stacked_aux = self.stack(x, segment_ids_BT, positions_BT, policy)
            aux.append(stacked_aux)
        with jax.named_scope("head"):
            head = self.head(x)

        mtp_heads, h, rolled_BTD = [], x, emb_BTD
        for d, mtp_layer in enumerate(self.mtp_layers):
            with jax.named_scope(f"mtp{d}"):
                rolled_BTD = roll_and_mask_by_segment(rolled_BTD, segment_ids_BT)  # embedding of token t + 1 + d
                h, layer_aux = run(mtp_layer, h, rolled_BTD, segment_ids_BT, positions_BT)
                mtp_heads.append(self.head(h))
            aux.append(None if layer_aux is None else jax.tree.map(lambda a: a[None], layer_aux))
        return Ling3Output(head, mtp_heads, _stack_aux(aux, self.cfg.moe.num_experts), x)


def _stack_aux(aux: list, num_experts: int) -> dict:
    """Concatenate the per-stage statistics (each [layers, ...], None for dense layers) in layer order."""
    aux = [a for a in aux if a is not None]
    if not aux:
        return {"router_z_loss": jnp.zeros((0,)), "load_counts": jnp.zeros((0, num_experts)), "num_tokens": jnp.zeros((0,))}
    return {k: jnp.concatenate([a[k] for a in aux]) for k in aux[0]}


def stacked_axes(path) -> int:
    """Leading layer-stack axes of the parameter at `path` (keys of the params tree): 1 under `stack`, else 0."""
    return int(len(path) > 1 and str(getattr(path[0], "key", getattr(path[0], "name", path[0]))) == "stack")


@functools.lru_cache(maxsize=8)
def count_params(cfg: Ling3Config) -> int:
    """Total trainable parameters (nnx.Param; expert biases excluded), from shapes only (no allocation; cached:
    tracing the construction of a 24-layer model takes seconds)."""
    abstract = nnx.eval_shape(lambda: Ling3(cfg, rngs=nnx.Rngs(0)))
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def count_active_params(cfg: Ling3Config) -> int:
    """Parameters touched per token: the total minus the unrouted (num_experts - top_k) experts of each MoE layer."""
    n_moe = sum(f == "moe" for _, f in cfg.layer_kinds()) + (cfg.mtp_num_layers if cfg.mtp.use_moe else 0)
    per_expert = 3 * cfg.emb_dim * cfg.moe.expert_dim
    return count_params(cfg) - n_moe * (cfg.moe.num_experts - cfg.moe.top_k) * per_expert


_NESTED = {"kda": KDAConfig, "mla": MLAConfig, "moe": MoEConfig, "mtp": MTPConfig}


def _build(cls, d: typing.Mapping, where: str):
    if not isinstance(d, typing.Mapping):
        raise TypeError(f"{where} must be a mapping of config keys; got {type(d).__name__}")
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; valid keys: {valid}")
    d = dict(d)
    for f in dataclasses.fields(cls):  # YAML may give 1e-6 as a string or 5 as an int for a float field
        value = d.get(f.name)
        if str(f.type).startswith("float") and isinstance(value, (int, str)) and not isinstance(value, bool):
            try:
                d[f.name] = float(value)
            except ValueError:
                raise ValueError(f"{where}.{f.name} must be a number; got {value!r}") from None
    return cls(**d)


def config_from_dict(d: typing.Mapping) -> Ling3Config:
    """Ling3Config from a plain dict (the conf/model/*.yaml keys); nested dicts for kda, mla, moe, mtp."""
    if not isinstance(d, typing.Mapping):
        raise TypeError(f"model config must be a mapping; got {type(d).__name__}")
    d = dict(d)
    for key, cls in _NESTED.items():
        if key in d and not isinstance(d[key], cls):
            d[key] = _build(cls, d[key] or {}, f"model.{key}")
    return _build(Ling3Config, d, "model")
