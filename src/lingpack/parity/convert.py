"""Weights and configs between lingpack's `Ling3` and transformers' `KimiLinearForCausalLM`, both directions.

Port differences handled here (transformers `models/kimi_linear/modeling_kimi_linear.py` vs lingpack):
* conv: one fused depthwise `conv1d.weight [3*H*K, 1, k]` over concatenated (q, k, v) channels vs three
  `ShortConvolution.kernel [k, H*K]`; both put the current-token tap last, so it is a split + transpose.
* KDA gate: Kimi's softplus gate only (`lower_bound=None`); Ling3's safe gate has no transformers
  counterpart and refuses to convert. `A_log` is `[1, 1, H, 1]` there, `[H]` here.
* output gated norm activation: FLA/Moonshot use sigmoid; older transformers ports used silu.
  `hf_gated_norm_activation()` reads what the INSTALLED port does, and the config conversion copies it.
* MLA: transformers' Kimi MLA is NoPE (the rope slice is never rotated): `rope_type="none"` only; its
  q/kv latent norms hard-code eps 1e-6 (`latent_norm_eps` must be 1e-6).
* layer pattern: transformers' default puts MLA at i % 4 == 0 (i > 0); lingpack's rule is
  (i + 1) % interval == 0, so `layer_types` is always written explicitly.
* experts: fused `gate_up_proj [E, 2I, D]` (gate rows first) and `down_proj [E, D, I]` vs
  `wi_gate, wi_up [E, D, I]`, `wo [E, I, D]`; router `gate.weight [E, D]` vs `router [D, E]`;
  `e_score_correction_bias` <-> `expert_bias`.
* linear weights are `[out, in]` there, kernels `[in, out]` here. MTP layers have no counterpart in
  KimiLinear: `to_hf_state_dict(mtp=True)` names them for the parity reference (`parity/reference_model.py`),
  `load_hf_state_dict` leaves them untouched.
* scanned layers (`Ling3Config.scan_layers`) hold layer i's submodules as slices of stacked weights:
  `Ling3.layer_parts(i)` gives each submodule's module and slice, so the table is the same.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from lingpack.models.block import parts as block_parts
from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3, Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from lingpack.models.mtp import MTPConfig


def hf_gated_norm_activation() -> str:
    """The activation of the installed transformers' KimiLinearRMSNormGated ('sigmoid' or 'silu')."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf
    return getattr(hf.KimiLinearRMSNormGated(4), "activation", "silu")


def kimi_config_from_ling3(cfg: Ling3Config, **extra):
    """A KimiLinearConfig describing the same network (main layers only; raises on what it cannot express)."""
    from transformers import KimiLinearConfig
    if cfg.kda.lower_bound is not None:
        raise ValueError(f"transformers' KimiLinear only has the softplus gate; set kda.lower_bound=None (got {cfg.kda.lower_bound})")
    if cfg.mla.rope_type != "none":
        raise ValueError("transformers' KimiLinear MLA is NoPE; set mla.rope_type='none'")
    if cfg.mla.latent_norm_eps != 1e-6:
        raise ValueError(f"transformers hard-codes the MLA latent norm eps to 1e-6; got mla.latent_norm_eps={cfg.mla.latent_norm_eps}")
    if cfg.kda.gate_activation != hf_gated_norm_activation():
        raise ValueError(f"the installed transformers gates the KDA output norm with {hf_gated_norm_activation()!r};"
                         f" set kda.gate_activation to match (got {cfg.kda.gate_activation!r})")
    kinds = cfg.layer_kinds()
    return KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.emb_dim, intermediate_size=cfg.mlp_dim,
        moe_intermediate_size=cfg.moe.expert_dim, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.mla.num_heads, num_key_value_heads=cfg.mla.num_heads,
        kv_lora_rank=cfg.mla.kv_lora_rank, q_lora_rank=cfg.mla.q_lora_rank or None,
        qk_rope_head_dim=cfg.mla.qk_rope_head_dim, qk_nope_head_dim=cfg.mla.qk_nope_head_dim,
        v_head_dim=cfg.mla.v_head_dim, num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
        n_group=cfg.moe.n_groups, topk_group=cfg.moe.topk_groups, n_shared_experts=cfg.moe.num_shared_experts,
        routed_scaling_factor=cfg.moe.routed_scaling_factor, norm_topk_prob=cfg.moe.norm_topk_prob,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        layer_types=["full_attention" if m == "mla" else "linear_attention" for m, _ in kinds],
        mlp_layer_types=["sparse" if f == "moe" else "dense" for _, f in kinds],
        linear_attn_config={"head_dim": cfg.kda.head_dim, "num_heads": cfg.kda.num_heads,
                            "short_conv_kernel_size": cfg.kda.conv_size},
        pad_token_id=0, bos_token_id=min(1, cfg.vocab_size - 1), eos_token_id=min(2, cfg.vocab_size - 1), **extra)


def ling3_config_from_kimi(hf_cfg, **overrides) -> Ling3Config:
    """A Ling3Config for a KimiLinearConfig whose layers follow lingpack's periodic pattern (else raises)."""
    n = hf_cfg.num_hidden_layers
    mla_layers = [i for i, t in enumerate(hf_cfg.layer_types) if t == "full_attention"]
    interval = mla_layers[0] + 1 if mla_layers else n + 1
    dense = [t == "dense" for t in hf_cfg.mlp_layer_types]
    first_dense = dense.index(False) if False in dense else n
    cfg = Ling3Config(
        vocab_size=hf_cfg.vocab_size, emb_dim=hf_cfg.hidden_size, num_layers=n,
        inhomogeneous_layer_cycle_interval=interval, first_dense_layers=first_dense, mlp_dim=hf_cfg.intermediate_size,
        norm_eps=hf_cfg.rms_norm_eps, mtp_num_layers=0, tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        kda=KDAConfig(num_heads=hf_cfg.linear_num_heads, head_dim=hf_cfg.linear_head_dim,
                      conv_size=hf_cfg.linear_conv_kernel_dim, lower_bound=None,
                      gate_activation=hf_gated_norm_activation()),
        mla=MLAConfig(num_heads=hf_cfg.num_attention_heads, q_lora_rank=hf_cfg.q_lora_rank,
                      kv_lora_rank=hf_cfg.kv_lora_rank, qk_nope_head_dim=hf_cfg.qk_nope_head_dim,
                      qk_rope_head_dim=hf_cfg.qk_rope_head_dim, v_head_dim=hf_cfg.v_head_dim, rope_type="none"),
        moe=MoEConfig(num_experts=hf_cfg.num_local_experts, top_k=hf_cfg.num_experts_per_tok,
                      expert_dim=hf_cfg.moe_intermediate_size, num_shared_experts=hf_cfg.n_shared_experts,
                      n_groups=hf_cfg.n_group, topk_groups=hf_cfg.topk_group,
                      routed_scaling_factor=hf_cfg.routed_scaling_factor, norm_topk_prob=hf_cfg.norm_topk_prob),
        mtp=MTPConfig())
    cfg = dataclasses.replace(cfg, **overrides)
    if cfg.layer_kinds() != [("mla" if t == "full_attention" else "kda", "dense" if d else "moe")
                             for t, d in zip(hf_cfg.layer_types, dense)]:
        raise ValueError(f"layer_types {hf_cfg.layer_types} / mlp_layer_types {hf_cfg.mlp_layer_types} do not follow"
                         " lingpack's pattern (MLA iff (i+1) % interval == 0, dense layers first)")
    return cfg


T = lambda a: np.swapaxes(a, -1, -2)  # [in, out] <-> [out, in]


def _pairs(model: Ling3, mtp: bool = False):
    """(lingpack (path, stack index) list, hf name, to_hf(list of arrays) -> array) for every tensor;
    fused tensors list several paths. A path starts at the model or, for a layer, at its module.
    `mtp`: also the MTP layers, as `mtp.{d}.enorm / hnorm / eh_proj / block.*` (parity/reference_model.py)."""
    cfg = model.cfg
    top = lambda *path: (model, path, ())
    yield [top("embed_tokens", "embedding")], "model.embed_tokens.weight", lambda a: a
    yield [top("norm", "weight")], "model.norm.weight", lambda a: a
    if not cfg.tie_embeddings:
        yield [top("lm_head")], "lm_head.weight", T
    for i, (mixer, ffn) in enumerate(cfg.layer_kinds()):
        yield from _layer_pairs(cfg, model.layer_parts(i), mixer, ffn, f"model.layers.{i}.")
    for d, mtp_layer in enumerate(model.mtp_layers if mtp else []):
        for norm in ("enorm", "hnorm"):
            yield [(mtp_layer, (norm, "weight"), ())], f"mtp.{d}.{norm}.weight", lambda a: a
        yield [(mtp_layer, ("eh_proj", "kernel"), ())], f"mtp.{d}.eh_proj.weight", T
        yield from _layer_pairs(cfg, block_parts(mtp_layer.block), "mla", mtp_layer.block.ffn, f"mtp.{d}.block.")


def _layer_pairs(cfg: Ling3Config, parts: dict, mixer: str, ffn: str, hf: str):
    """`_pairs` for one decoder layer (`parts`: `Ling3.layer_parts`) under the transformers prefix `hf`."""
    ours = lambda part, *path: (parts[part][0], path, parts[part][1])
    for norm in ("input_layernorm", "post_attention_layernorm"):
        yield [ours(norm, "weight")], hf + norm + ".weight", lambda a: a
    attn = lambda *path: ours("self_attn", *path)
    hf_attn = hf + "self_attn."
    if mixer == "kda":
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
            yield [attn(name, "kernel")], hf_attn + name + ".weight", T
        for name in ("f_a_proj", "f_b_proj"):
            yield [attn(name, "kernel")], hf_attn + "forget_gate." + name + ".weight", T
        yield [attn("o_norm", "weight")], hf_attn + "o_norm.weight", lambda a: a
        yield [attn("A_log")], hf_attn + "forget_gate.A_log", lambda a: a.reshape(1, 1, -1, 1)
        yield [attn("dt_bias")], hf_attn + "forget_gate.dt_bias", lambda a: a
        convs = [attn(c, "kernel") for c in ("q_conv", "k_conv", "v_conv")]
        yield convs, hf_attn + "conv1d.weight", lambda q, k, v: np.concatenate([q, k, v], axis=1).T[:, None, :]
    else:
        names = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + (
            ["q_a_proj", "q_b_proj"] if cfg.mla.q_lora_rank else ["q_proj"])
        for name in names:
            yield [attn(name, "kernel")], hf_attn + name + ".weight", T
        norms = ["kv_a_layernorm"] + (["q_a_layernorm"] if cfg.mla.q_lora_rank else [])
        for name in norms:
            yield [attn(name, "weight")], hf_attn + name + ".weight", lambda a: a
    mlp = lambda *path: ours("mlp", *path)
    hf_mlp = hf + "mlp."
    dense_names = ("gate_proj", "up_proj", "down_proj")
    if ffn == "dense":
        for name in dense_names:
            yield [mlp(name, "kernel")], hf_mlp + name + ".weight", T
        return
    yield [mlp("router")], hf_mlp + "gate.weight", T
    yield [mlp("expert_bias")], hf_mlp + "gate.e_score_correction_bias", lambda a: a
    yield [mlp("wi_gate"), mlp("wi_up")], hf_mlp + "experts.gate_up_proj", \
        lambda g, u: np.concatenate([T(g), T(u)], axis=1)
    yield [mlp("wo")], hf_mlp + "experts.down_proj", T
    if cfg.moe.num_shared_experts:
        for name in dense_names:
            yield [mlp("shared_experts", name, "kernel")], hf_mlp + "shared_experts." + name + ".weight", T


def tensor_sources(model: Ling3, mtp: bool = False):
    """(transformers name, [(variable, stack index)], to_hf(*arrays), from_hf(array, shapes) -> arrays) for every
    tensor of `model` (an abstract one from `nnx.eval_shape` will do: nothing is read)."""
    for paths, name, fn in _pairs(model, mtp):
        yield name, [_variable(p) for p in paths], fn, lambda array, shapes, name=name: _split(array, name, shapes)


def _variable(where):
    """(variable, stack index) for a (module, attribute path, stack index) triple."""
    node, path, index = where
    for part in path:
        node = getattr(node, part)
    return node, index


def _as_numpy(x) -> np.ndarray:
    """An array or torch tensor as numpy fp32, or float64 if it is float64 (bf16 has no numpy twin for torch)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        x = (x.double() if str(x.dtype) == "torch.float64" else x.float()).numpy()
    x = np.asarray(x)
    return x.astype(np.float64 if x.dtype == np.float64 else np.float32)


def to_hf_state_dict(model: Ling3, mtp: bool = False) -> dict[str, np.ndarray]:
    """numpy tensors (fp32; float64 for float64 weights) keyed by transformers' parameter names (MTP layers only
    with `mtp`, under `mtp.{d}.`)."""
    out = {}
    for paths, name, fn in _pairs(model, mtp):
        arrays = [_as_numpy(var[...][index]) for var, index in map(_variable, paths)]
        out[name] = np.ascontiguousarray(fn(*arrays))
    return out


def load_hf_state_dict(model: Ling3, state_dict) -> None:
    """Write transformers tensors (torch or numpy; float64 kept) into `model` in place; every expected key must be
    present."""
    sd = {k: _as_numpy(v) for k, v in state_dict.items()}
    for paths, name, fn in _pairs(model):
        if name not in sd:
            raise KeyError(f"transformers state dict lacks {name!r}; is it a KimiLinearForCausalLM matching this config?")
        located = [_variable(p) for p in paths]
        shapes = [var[...][index].shape for var, index in located]
        expected = fn(*[np.zeros(shape, np.float32) for shape in shapes]).shape  # shapes only
        if sd[name].shape != expected:
            raise ValueError(f"{name}: transformers shape {sd[name].shape} != {expected} expected from the lingpack config")
        parts = _split(sd[name], name, shapes)
        for (var, index), part in zip(located, parts):
            var[...] = var[...].at[index].set(jnp.asarray(part, var[...].dtype))


def _split(array, name: str, shapes):
    """Inverse of the `_pairs` transforms (each is a transpose/reshape, or a concatenation of them)."""
    if name.endswith("conv1d.weight"):
        return list(np.split(array[:, 0, :].T, 3, axis=1))
    if name.endswith("experts.gate_up_proj"):
        return [T(a) for a in np.split(array, 2, axis=1)]
    if name.endswith("forget_gate.A_log"):
        return [array.reshape(shapes[0])]
    if array.ndim >= 2 and not name.endswith("embed_tokens.weight"):
        return [T(array)]
    return [array]


# --- one MLA layer <-> transformers' DeepseekV3Attention (MLA with RoPE) -----------------------------------
def deepseek_v3_config_from_mla(cfg: MLAConfig, emb_dim: int, **extra):
    """A DeepseekV3Config whose attention layer computes lingpack's `MLA(cfg, emb_dim)` (with the glue below).

    DeepSeek-V3 rotates its whole rope slice; lingpack's partial rotary (rotary_dim < qk_rope_head_dim) is
    expressed by `deepseek_v3_rope_inv_freq` (frequency 0, the identity, for the pass-through pairs) and, in
    the half-split layout, by the feature order of `mla_to_deepseek_v3`."""
    from transformers import DeepseekV3Config
    if cfg.rope_type != "rope":
        raise ValueError(f"DeepseekV3Attention always applies RoPE; mla.rope_type must be 'rope' (got {cfg.rope_type!r})")
    if cfg.latent_norm_eps != 1e-6:
        raise ValueError(f"DeepseekV3's latent norms use eps 1e-6; got mla.latent_norm_eps={cfg.latent_norm_eps}")
    return DeepseekV3Config(
        hidden_size=emb_dim, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        rope_interleave=cfg.rope_interleaved, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False, **extra)


def deepseek_v3_rope_inv_freq(cfg: MLAConfig, dtype=np.float32) -> np.ndarray:
    """`inv_freq` [qk_rope_head_dim / 2] (`dtype`) for DeepseekV3RotaryEmbedding: lingpack's rotary frequencies
    theta^(-2i / rotary_dim) for the rotated pairs, then 0 (angle 0: cos 1, sin 0) for the pass-through ones."""
    half_rot, half = cfg.rotary_dim // 2, cfg.qk_rope_head_dim // 2
    freqs = cfg.rope_theta ** (-np.arange(half_rot, dtype=np.float64) * 2.0 / cfg.rotary_dim)
    return np.concatenate([freqs, np.zeros(half - half_rot)]).astype(dtype)


def _rope_order(cfg: MLAConfig) -> np.ndarray:
    """DeepSeek-V3 rope feature j <- lingpack rope feature order[j].

    Interleaved pairs are (2i, 2i+1) in both, the rotated ones first: no reordering. Half-split pairs are
    (j, j + R/2) in DeepSeek-V3 but (i, i + r/2) inside lingpack's first r = rotary_dim features: the
    rotated halves go to the first r/2 slots of each DeepSeek half, the pass-through features fill the rest."""
    R, r = cfg.qk_rope_head_dim, cfg.rotary_dim
    if cfg.rope_interleaved or r == R:
        return np.arange(R)
    passing = np.arange(r, R)
    first = np.concatenate([np.arange(r // 2), passing[:(R - r) // 2]])
    second = np.concatenate([np.arange(r // 2, r), passing[(R - r) // 2:]])
    return np.concatenate([first, second])


def deepseek_v3_rows(cfg: MLAConfig) -> tuple[np.ndarray, np.ndarray]:
    """(q rows, kv_a rows): DeepSeek-V3's output row j of the q projection / kv_a_proj_with_mqa is lingpack's
    row rows[j] (the rope features of each head and of the shared key in `_rope_order`)."""
    H, nope, order = cfg.num_heads, cfg.qk_nope_head_dim, _rope_order(cfg)
    q_rows = np.concatenate([h * cfg.qk_head_dim + np.concatenate([np.arange(nope), nope + order]) for h in range(H)])
    return q_rows, np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + order])


def mla_to_deepseek_v3(mla, index: tuple = ()) -> dict[str, np.ndarray]:
    """fp32 (float64 for float64 weights) numpy state dict of a DeepseekV3Attention (its own parameter names)
    computing lingpack's `mla` (`index`: the layer's slice of a scanned stack, `Ling3.layer_parts`).

    Linear kernels `[in, out]` become weights `[out, in]`; the rope rows of q (per head) and of the shared
    key are put in DeepSeek-V3's order (`_rope_order`), which permutes q and k alike: scores are unchanged."""
    cfg = mla.cfg
    value = lambda module: _as_numpy(module.kernel[...][index])
    norm = lambda module: _as_numpy(module.weight[...][index])
    q_rows, kv_a_rows = deepseek_v3_rows(cfg)
    sd = {"kv_a_proj_with_mqa.weight": T(value(mla.kv_a_proj_with_mqa))[kv_a_rows],
          "kv_a_layernorm.weight": norm(mla.kv_a_layernorm),
          "kv_b_proj.weight": T(value(mla.kv_b_proj)), "o_proj.weight": T(value(mla.o_proj))}
    if cfg.q_lora_rank:
        sd.update({"q_a_proj.weight": T(value(mla.q_a_proj)), "q_b_proj.weight": T(value(mla.q_b_proj))[q_rows],
                   "q_a_layernorm.weight": norm(mla.q_a_layernorm)})
    else:
        sd["q_proj.weight"] = T(value(mla.q_proj))[q_rows]
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}
