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
* linear weights are `[out, in]` there, kernels `[in, out]` here. MTP layers have no counterpart:
  `to_hf_state_dict` skips them, `load_hf_state_dict` leaves them untouched.
* scanned layers (`Ling3Config.scan_layers`) hold layer i as one slice of stacked weights:
  `Ling3.layer_location(i)` gives the module and the slice, so the table is the same.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

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


def _pairs(model: Ling3):
    """(lingpack (path, stack index) list, hf name, to_hf(list of arrays) -> array) for every tensor;
    fused tensors list several paths. A path starts at the model or, for a layer, at its module."""
    cfg = model.cfg
    top = lambda *path: (model, path, ())
    yield [top("embed_tokens", "embedding")], "model.embed_tokens.weight", lambda a: a
    yield [top("norm", "weight")], "model.norm.weight", lambda a: a
    if not cfg.tie_embeddings:
        yield [top("lm_head")], "lm_head.weight", T
    for i, (mixer, ffn) in enumerate(cfg.layer_kinds()):
        layer, index = model.layer_location(i)
        hf = f"model.layers.{i}."
        ours = lambda *path: (layer, path, index)
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
            continue
        yield [mlp("router")], hf_mlp + "gate.weight", T
        yield [mlp("expert_bias")], hf_mlp + "gate.e_score_correction_bias", lambda a: a
        yield [mlp("wi_gate"), mlp("wi_up")], hf_mlp + "experts.gate_up_proj", \
            lambda g, u: np.concatenate([T(g), T(u)], axis=1)
        yield [mlp("wo")], hf_mlp + "experts.down_proj", T
        if cfg.moe.num_shared_experts:
            for name in dense_names:
                yield [mlp("shared_experts", name, "kernel")], hf_mlp + "shared_experts." + name + ".weight", T


def _variable(where):
    """(variable, stack index) for a (module, attribute path, stack index) triple."""
    node, path, index = where
    for part in path:
        node = getattr(node, part)
    return node, index


def to_hf_state_dict(model: Ling3) -> dict[str, np.ndarray]:
    """fp32 numpy tensors keyed by transformers' parameter names (MTP layers are skipped)."""
    out = {}
    for paths, name, fn in _pairs(model):
        arrays = [np.asarray(var[...][index], np.float32) for var, index in map(_variable, paths)]
        out[name] = np.ascontiguousarray(fn(*arrays))
    return out


def load_hf_state_dict(model: Ling3, state_dict) -> None:
    """Write transformers tensors (torch or numpy) into `model` in place; every expected key must be present."""
    sd = {k: np.asarray(v.detach().cpu().float().numpy() if hasattr(v, "detach") else v, np.float32)
          for k, v in state_dict.items()}
    for paths, name, fn in _pairs(model):
        if name not in sd:
            raise KeyError(f"transformers state dict lacks {name!r}; is it a KimiLinearForCausalLM matching this config?")
        located = [_variable(p) for p in paths]
        shapes = [var[...][index].shape for var, index in located]
        expected = fn(*[np.zeros(shape, np.float32) for shape in shapes]).shape
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
