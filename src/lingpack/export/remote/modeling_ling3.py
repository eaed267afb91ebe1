"""Ling3 as a transformers model: KimiLinear's network with Ling3's safe KDA gate, RoPE MLA and MTP layers.

Written by lingpack's exporter into a model directory next to `configuration_ling3.py`; it imports only torch
and transformers, so `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` loads it where
lingpack is not installed. The network is transformers' `KimiLinearForCausalLM` (embeddings, pre-norm decoder
layers, KDA with its fused short convolution, MoE with grouped sigmoid routing and the correction bias, the
LM head) with two modules swapped where the config asks:
* the KDA forget gate, for `kda_lower_bound` (Ling3's safe gate, fla-org/flash-linear-attention:fla/ops/kda/gate.py);
* the MLA layers, for `mla_rope_type="rope"`: transformers' DeepseekV3Attention (MLA with RoPE, the same
  parameter names), the rotary frequencies theta^(-2i / mla_rotary_dim) on the first rotated pairs and
  frequency 0 (the identity) on the pass-through ones.
The MTP layers (`mtp.{d}.enorm / hnorm / eh_proj / block`) are kept as weights; `forward` and `generate` use
the main model only. Generation runs with KimiLinear's cache (recurrent KDA state and conv state, compressed
MLA latents), the same as a `KimiLinearForCausalLM`.
"""

import copy

import torch
from torch import nn
from transformers import DeepseekV3Config
from transformers import initialization as init
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek_v3
from transformers.models.kimi_linear import modeling_kimi_linear as kimi

from .configuration_ling3 import Ling3Config


class Ling3LowerBoundGate(nn.Module):
    """KimiLinearForgetGate's parameters (same names and shapes) with the lower-bound (safe) gate formula."""

    def __init__(self, config: Ling3Config):
        super().__init__()
        self.head_dim, self.num_heads = config.linear_head_dim, config.linear_num_heads
        self.lower_bound = float(config.kda_lower_bound)
        self.f_a_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, self.head_dim * self.num_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.head_dim * self.num_heads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.num_heads, 1))

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:2], self.num_heads, self.head_dim)
        # the gate in fp32: exp(A_log) scales before the sigmoid, so a low-precision A_log would shift every decay
        g_raw = self.f_b_proj(self.f_a_proj(hidden_states)).float() + self.dt_bias.float()
        g = self.lower_bound * torch.sigmoid(torch.exp(self.A_log.float()) * g_raw.view(shape))
        return g.to(hidden_states.dtype)


def _deepseek_config(config: Ling3Config) -> DeepseekV3Config:
    """A DeepseekV3Config whose attention computes one Ling3 MLA layer."""
    return DeepseekV3Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rope_interleave=config.rope_interleave,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}, attention_bias=False)


def rope_inv_freq(config: Ling3Config) -> torch.Tensor:
    """[qk_rope_head_dim / 2] frequencies (float64): the rotated pairs', then 0 (cos 1, sin 0) for the rest."""
    half = config.qk_rope_head_dim // 2
    rotary = config.mla_rotary_dim or config.qk_rope_head_dim
    freqs = config.rope_theta ** (-torch.arange(rotary // 2, dtype=torch.float64) * 2.0 / rotary)
    return torch.cat([freqs, torch.zeros(half - rotary // 2, dtype=torch.float64)])


class Ling3RopeAttention(deepseek_v3.DeepseekV3Attention):
    """DeepseekV3Attention (MLA with RoPE), called the way KimiLinear's decoder layer calls its attention."""

    def __init__(self, config: Ling3Config, layer_idx: int):
        super().__init__(_deepseek_config(config), layer_idx)
        self.outer_config = config   # the attention implementation follows the model's (the mask is built for it)
        self.rotary = deepseek_v3.DeepseekV3RotaryEmbedding(self.config)   # inv_freq replaced in forward

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, **kwargs):
        self.config._attn_implementation = self.outer_config._attn_implementation
        kwargs.pop("use_cache", None)
        self.rotary.inv_freq = rope_inv_freq(self.outer_config).to(hidden_states.device, torch.float32)
        cos_sin = self.rotary(hidden_states, position_ids)
        return super().forward(hidden_states, position_embeddings=cos_sin, attention_mask=attention_mask,
                               cache=cache, **kwargs)


def _swap_modules(block, config: Ling3Config, layer_idx: int) -> None:
    """Put Ling3's gate / RoPE attention / norm activation into one KimiLinearDecoderLayer."""
    if isinstance(block.self_attn, kimi.KimiLinearDeltaAttention):
        if config.kda_lower_bound is not None:
            block.self_attn.forget_gate = Ling3LowerBoundGate(config)
        block.self_attn.o_norm.activation = config.kda_gate_activation
    elif config.mla_rope_type == "rope":
        block.self_attn = Ling3RopeAttention(config, layer_idx)


class Ling3MTPLayer(nn.Module):
    """One multi-token-prediction layer: block(eh_proj([enorm(embedding of token t+1+d), hnorm(h)]))."""

    def __init__(self, config: Ling3Config):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = kimi.KimiLinearRMSNorm(size, eps), kimi.KimiLinearRMSNorm(size, eps)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        one = copy.deepcopy(config)
        one.num_hidden_layers, one.layer_types = 1, ["full_attention"]
        one.mlp_layer_types = ["sparse" if config.mtp_use_moe else "dense"]
        self.block = kimi.KimiLinearDecoderLayer(one, 0)
        _swap_modules(self.block, config, 0)


class Ling3ForCausalLM(kimi.KimiLinearForCausalLM):
    """KimiLinearForCausalLM with Ling3's modules; `forward(input_ids, labels=...)` gives logits and the mean
    next-token loss (transformers' causal LM loss), `generate` works as for any causal LM."""

    config_class = Ling3Config
    _keys_to_ignore_on_load_unexpected = None

    def __init__(self, config: Ling3Config):
        super().__init__(config)
        for i, block in enumerate(self.model.layers):
            _swap_modules(block, config, i)
        self.mtp = nn.ModuleList([Ling3MTPLayer(config) for _ in range(config.mtp_num_layers)])
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Ling3LowerBoundGate):   # any finite start; real weights come from the checkpoint
            init.zeros_(module.A_log)
            init.zeros_(module.dt_bias)


__all__ = ["Ling3ForCausalLM"]
