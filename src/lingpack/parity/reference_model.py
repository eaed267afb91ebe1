"""The whole Ling3 as a PyTorch model assembled from outside parts: the loss-parity reference's network.

Parts (none written here):
* transformers' KimiLinear: embeddings, decoder layers (pre-norm residuals), KDA layers (fused short conv,
  beta, gated output norm, its torch chunked KDA kernel), MoE (grouped sigmoid routing with the
  correction bias, shared expert), dense SwiGLU, RMS norms, the LM head;
* FLA's torch gate `naive_kda_lowerbound_gate` (fla/ops/kda/gate.py) as the KDA forget gate when
  `kda.lower_bound` is set (Ling3's safe gate; KimiLinear's own gate is the softplus one);
* transformers' `DeepseekV3Attention` for MLA with RoPE (`mla.rope_type="rope"`): weights from
  `convert.mla_to_deepseek_v3`, partial rotary through `convert.deepseek_v3_rope_inv_freq`;
* the MTP inputs (rolled ids, labels, loss mask per depth) come from megatron-core's `roll_tensor` on the
  packed batch, in `megatron_reference.py`.

Glue (this file): swapping those modules into KimiLinear, and the MTP layer, which is what megatron-core's
`MultiTokenPredictionLayer` computes for Ling3, `block(eh_proj([enorm(embedding of token t+1+d),
hnorm(h_{d-1})]))` followed by the model's shared final norm and head (lingpack's models/mtp.py). Where a
roll leaves the document Megatron embeds id 0 and lingpack a zero vector; the reference takes lingpack's
(`keep` below), so that the router statistics of those positions agree too (their loss is masked on both
sides; tests/models/test_mtp_megatron.py pins the difference).

`forward` runs each document alone in its own row (right-padded: every mixer is causal), which is what
Megatron's packed `cu_seqlens` means: per-document KDA state and conv resets, attention only inside a
document, positions as given (Megatron's `position_ids`, restarting per document).

dtype: float32 (the installed modules as they are), or float64: the same modules' source with every float32
upcast made float64 (`parity/widen.py`), the weights, buffers and every activation in float64.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy as np
import torch
from torch import nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.kimi_linear import modeling_kimi_linear

from lingpack.parity import convert, widen
from lingpack.parity.fla import fla_gate_functions

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def outside_modules(dtype: torch.dtype) -> tuple:
    """(KimiLinear module, DeepseekV3 module, FLA's gate functions) computing in `dtype`'s precision."""
    if dtype == torch.float32:
        return modeling_kimi_linear, modeling_deepseek_v3, fla_gate_functions()
    if dtype == torch.float64:
        return (widen.module(modeling_kimi_linear.__name__), widen.module(modeling_deepseek_v3.__name__),
                fla_gate_functions(float64=True))
    raise ValueError(f"the reference runs in float32 or float64; got {dtype}")


class LowerBoundForgetGate(nn.Module):
    """KimiLinearForgetGate's parameters (same names) with FLA's lower-bound gate formula."""

    def __init__(self, gate, lower_bound: float, fla_gate):
        super().__init__()
        self.f_a_proj, self.f_b_proj, self.A_log, self.dt_bias = gate.f_a_proj, gate.f_b_proj, gate.A_log, gate.dt_bias
        self.head_dim, self.lower_bound, self.fla_gate = gate.head_dim, lower_bound, fla_gate

    def forward(self, x):
        g_raw = self.f_b_proj(self.f_a_proj(x)).view(*x.shape[:2], -1, self.head_dim)
        return self.fla_gate(g_raw, self.A_log, self.dt_bias, self.lower_bound, output_dtype=x.dtype)


@functools.lru_cache(maxsize=None)
def rope_mla_class(deepseek_v3):
    """`RopeMLA` on the DeepseekV3Attention of `deepseek_v3` (the installed module or its float64 copy)."""

    class RopeMLA(deepseek_v3.DeepseekV3Attention):
        """DeepseekV3Attention called the way KimiLinear's decoder layer calls its attention."""

        def __init__(self, mla_cfg, emb_dim: int, layer_idx: int):
            config = convert.deepseek_v3_config_from_mla(mla_cfg, emb_dim)
            config._attn_implementation = "eager"
            super().__init__(config, layer_idx)
            self.rotary = deepseek_v3.DeepseekV3RotaryEmbedding(config)   # inv_freq: a non-persistent buffer
            self.rotary.inv_freq = torch.tensor(convert.deepseek_v3_rope_inv_freq(mla_cfg, np.float64))

        def forward(self, hidden_states, attention_mask=None, position_ids=None, **_):
            out, _ = super().forward(hidden_states, position_embeddings=self.rotary(hidden_states, position_ids),
                                     attention_mask=attention_mask)
            return out, None

    return RopeMLA


class MTPLayer(nn.Module):
    def __init__(self, kimi_config, ffn: str, kimi=modeling_kimi_linear):
        super().__init__()
        D, eps = kimi_config.hidden_size, kimi_config.rms_norm_eps
        self.enorm, self.hnorm = kimi.KimiLinearRMSNorm(D, eps), kimi.KimiLinearRMSNorm(D, eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        one = copy.deepcopy(kimi_config)
        one.num_hidden_layers, one.layer_types = 1, ["full_attention"]
        one.mlp_layer_types = ["sparse" if ffn == "moe" else "dense"]
        self.block = kimi.KimiLinearDecoderLayer(one, 0)

    def forward(self, h_prev, embedded, attention_mask, position_ids):
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h_prev)], dim=-1))
        return self.block(x, attention_mask=attention_mask, position_ids=position_ids)


class Ling3Reference(nn.Module):
    """`model` (KimiLinearModel, modules swapped per the config), `lm_head`, `mtp` layers; float32 or float64, CPU."""

    def __init__(self, cfg, dtype: torch.dtype = torch.float32):
        super().__init__()
        kimi, deepseek_v3, fla_gates = outside_modules(dtype)
        self.dtype = dtype
        # KimiLinear as configured without the parts it cannot express; those modules are swapped in below
        kimi_cfg = convert.kimi_config_from_ling3(dataclasses.replace(
            cfg, kda=dataclasses.replace(cfg.kda, lower_bound=None), mla=dataclasses.replace(cfg.mla, rope_type="none")))
        kimi_cfg._attn_implementation = "eager"
        kimi_cfg._experts_implementation = "eager"   # KimiLinearExperts' own per-expert loop
        causal_lm = kimi.KimiLinearForCausalLM(kimi_cfg).to(dtype)
        self.model, self.lm_head = causal_lm.model, causal_lm.lm_head
        self.model.embed_tokens.padding_idx = None   # torch zeroes padding_idx's gradient; Megatron trains every row
        self.mtp = nn.ModuleList([MTPLayer(kimi_cfg, "moe" if cfg.mtp.use_moe else "dense", kimi)
                                  for _ in range(cfg.mtp_num_layers)])
        for i, block in list(enumerate(self.model.layers)) + [(0, m.block) for m in self.mtp]:
            if isinstance(block.self_attn, kimi.KimiLinearDeltaAttention) and cfg.kda.lower_bound is not None:
                block.self_attn.forget_gate = LowerBoundForgetGate(block.self_attn.forget_gate, cfg.kda.lower_bound,
                                                                   fla_gates["naive_kda_lowerbound_gate"])
            elif isinstance(block.self_attn, kimi.KimiLinearAttention) and cfg.mla.rope_type == "rope":
                block.self_attn = rope_mla_class(deepseek_v3)(cfg.mla, cfg.emb_dim, i)
        self.to(dtype)   # every parameter and buffer (router weights, correction biases, rope inv_freq)

    def forward(self, input_ids, position_ids, mtp_inputs=()):
        """Token ids [R, L] (one document per row from its start, right-padded), positions [R, L], and per MTP
        depth (rolled ids [R, L], keep [R, L]: 0 where the roll left the document) -> (logits, MTP logits)."""
        n = input_ids.shape[1]
        causal = torch.full((n, n), float("-inf"), dtype=self.dtype).triu(1)[None, None]  # additive; padding follows
        masks = {"full_attention": causal, "linear_attention": None}
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, attention_mask=masks[layer.block_type], position_ids=position_ids)
        logits = self.lm_head(self.model.norm(h))
        mtp_logits = []
        for layer, (ids, keep) in zip(self.mtp, mtp_inputs, strict=True):
            h = layer(h, self.model.embed_tokens(ids) * keep[..., None], causal, position_ids)
            mtp_logits.append(self.lm_head(self.model.norm(h)))
        return logits, mtp_logits


def reference_state_dict(jax_model) -> dict[str, np.ndarray]:
    """numpy tensors keyed by `Ling3Reference`'s names holding `jax_model`'s weights (or gradients): fp32, float64
    for float64 weights."""
    sd = convert.to_hf_state_dict(jax_model, mtp=True)
    if jax_model.cfg.mla.rope_type == "rope":   # DeepseekV3Attention's rope feature order (convert._rope_order)
        located = [(f"model.layers.{i}.", *jax_model.layer_parts(i)["self_attn"]) for i, (mixer, _) in
                   enumerate(jax_model.cfg.layer_kinds()) if mixer == "mla"]
        located += [(f"mtp.{d}.block.", m.block.self_attn, ()) for d, m in enumerate(jax_model.mtp_layers)]
        for prefix, attn, index in located:
            sd.update({prefix + "self_attn." + k: v for k, v in convert.mla_to_deepseek_v3(attn, index).items()})
    return sd


def build(model_cfg, jax_model, dtype: torch.dtype = torch.float32) -> Ling3Reference:
    """The reference network in `dtype` holding exactly `jax_model`'s weights (every tensor, strictly)."""
    reference = Ling3Reference(model_cfg, dtype)
    state = {k: torch.from_numpy(v.copy()).to(dtype) for k, v in reference_state_dict(jax_model).items()}
    missing, unexpected = reference.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"weight conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return reference.train()
