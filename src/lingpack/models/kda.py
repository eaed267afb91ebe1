"""The Kimi Delta Attention layer (docs/design.md#kda-layer), exact under packing through `segment_ids`.

    q, k, v = silu(conv_q(q_proj x)), silu(conv_k(k_proj x)), silu(conv_v(v_proj x))   (segment-masked convs)
    g       = gate(f_b_proj(f_a_proj x); A_log, dt_bias)     softplus form, or the safe form with lower_bound
    beta    = sigmoid(b_proj x)                              (fp32, or float64)
    o       = chunk_kda(l2norm(q), l2norm(k), v, g, beta; segment_ids)
    y       = o_proj(gated_rmsnorm_per_head(o, g_b_proj(g_a_proj x)))

Parameter names follow FLA/transformers (`q_proj`, `f_a_proj`, `A_log`, `dt_bias`, ...), which keeps
weight conversion a table. `A_log` and `dt_bias` are fp32 (float64 with float64 parameters) and get no weight decay.
The kernel is reached only through `lingpack.kernels.kda.api.chunk_kda`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from lingpack.kernels.kda import gate as kda_gate
from lingpack.kernels.kda.api import chunk_kda
from lingpack.models.layers import GatedRMSNorm, ShortConvolution, dense, partitioned
from lingpack.parallel.context import current
from lingpack.parallel.kda_cp import chunk_kda_context_parallel
from lingpack.precision import at_least_fp32
from lingpack.models.remat import tag


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    num_heads: int = 4
    head_dim: int = 32
    conv_size: int = 4
    lower_bound: float | None = kda_gate.SAFE_GATE_MIN   # Ling3's safe gate; None = Kimi Linear's softplus gate
    gate_activation: str = "sigmoid"   # output gated norm: sigmoid (FLA, Moonshot), silu (old transformers port)

    def __post_init__(self):
        if self.num_heads < 1 or self.head_dim < 1 or self.conv_size < 1:
            raise ValueError(f"KDAConfig needs positive num_heads/head_dim/conv_size; got {self}")
        if self.lower_bound is not None:
            kda_gate.check_lower_bound(self.lower_bound, "kda.lower_bound (or null: the softplus gate)")
        if self.gate_activation not in ("sigmoid", "silu"):
            raise ValueError(f"kda.gate_activation must be 'sigmoid' or 'silu'; got {self.gate_activation!r}")


@dataclasses.dataclass(frozen=True)
class KDAKernel:
    """Which `chunk_kda` implementation runs, and its static options."""
    impl: str = "chunked"
    chunk_size: int = 64
    max_segs: int | None = None
    interpret: bool | None = None   # Pallas only: None = interpret mode off TPU; False forces Mosaic (TPU export)
    short_conv: str = "xla"         # the short convs' backward: xla, or pallas (kernels/short_conv.py; `interpret` too)


class KDA(nnx.Module):
    def __init__(self, cfg: KDAConfig, emb_dim: int, *, kernel: KDAKernel = KDAKernel(), norm_eps: float = 1e-6,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.kernel = cfg, kernel
        H, K = cfg.num_heads, cfg.head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = dense(emb_dim, H * K, ("embed", "heads"), **kw)
        self.k_proj = dense(emb_dim, H * K, ("embed", "heads"), **kw)
        self.v_proj = dense(emb_dim, H * K, ("embed", "heads"), **kw)
        conv = dict(pallas_backward=kernel.short_conv == "pallas", interpret=kernel.interpret, **kw)
        self.q_conv = ShortConvolution(H * K, cfg.conv_size, **conv)
        self.k_conv = ShortConvolution(H * K, cfg.conv_size, **conv)
        self.v_conv = ShortConvolution(H * K, cfg.conv_size, **conv)
        self.f_a_proj = dense(emb_dim, K, ("embed", "kv"), **kw)
        self.f_b_proj = dense(K, H * K, ("kv", "heads"), **kw)
        # Gate parameters are fp32 (float64 with float64 params) whatever param_dtype: the decay exp(g) compounds
        # over thousands of steps.
        gate_dtype = at_least_fp32(param_dtype)
        self.A_log = nnx.Param(partitioned(lambda key, shape, dtype: kda_gate.init_a_log(key, H, dtype), ("heads",))(
            rngs.params(), (H,), gate_dtype))
        self.dt_bias = nnx.Param(partitioned(lambda key, shape, dtype: kda_gate.init_dt_bias(key, H * K, dtype=dtype),
                                             ("heads",))(rngs.params(), (H * K,), gate_dtype))
        self.b_proj = dense(emb_dim, H, ("embed", "heads"), **kw)
        self.g_a_proj = dense(emb_dim, K, ("embed", "kv"), **kw)
        self.g_b_proj = dense(K, H * K, ("kv", "heads"), **kw)
        self.o_norm = GatedRMSNorm(K, eps=norm_eps, activation=cfg.gate_activation, dtype=dtype,
                                   param_dtype=at_least_fp32(param_dtype))  # fp32 norm weight (float64 with float64)
        self.o_proj = dense(H * K, emb_dim, ("heads", "embed"), **kw)

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None) -> jax.Array:
        B, T, _ = x_BTD.shape
        H, K = self.cfg.num_heads, self.cfg.head_dim
        heads = lambda a: a.reshape(B, T, H, -1)
        q_BTHK = heads(self.q_conv(tag(self.q_proj(x_BTD), "query_proj"), segment_ids_BT))
        k_BTHK = heads(self.k_conv(tag(self.k_proj(x_BTD), "key_proj"), segment_ids_BT))
        v_BTHV = heads(self.v_conv(tag(self.v_proj(x_BTD), "value_proj"), segment_ids_BT))
        g_raw_BTHK = heads(tag(self.f_b_proj(tag(self.f_a_proj(x_BTD), "gate_proj")), "gate_proj"))
        b_BTH = tag(self.b_proj(x_BTD), "gate_proj")
        # fp32 or wider: beta near 0/1 matters in the erase
        beta_BTH = jax.nn.sigmoid(b_BTH.astype(at_least_fp32(b_BTH.dtype)))
        kernel = dict(impl=self.kernel.impl, chunk_size=self.kernel.chunk_size, max_segs=self.kernel.max_segs,
                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log[...],
                      dt_bias=self.dt_bias[...], lower_bound=self.cfg.lower_bound,
                      interpret=self.kernel.interpret)
        cp = current()
        if cp is None:
            o_BTHV, _ = chunk_kda(q_BTHK, k_BTHK, v_BTHV, g_raw_BTHK, beta_BTH, segment_ids=segment_ids_BT, **kernel)
        else:  # sequence split over `context`: blocks pass the KDA state on (parallel/kda_cp.py)
            if segment_ids_BT is None:
                segment_ids_BT = jnp.ones((B, T), jnp.int32)
            o_BTHV, _ = chunk_kda_context_parallel(
                q_BTHK, k_BTHK, v_BTHV, g_raw_BTHK, beta_BTH, segment_ids=segment_ids_BT, mesh=cp.mesh,
                axis_name=cp.axis, load_balance=cp.load_balance, batch_axes=cp.batch_axes, head_axes=cp.head_axes,
                **kernel)
        o_BTHV = tag(o_BTHV, "context")
        gate_BTHV = heads(tag(self.g_b_proj(tag(self.g_a_proj(x_BTD), "gate_proj")), "gate_proj"))
        y_BTHV = self.o_norm(o_BTHV, gate_BTHV)
        return tag(self.o_proj(y_BTHV.reshape(B, T, H * K)), "out_proj")
