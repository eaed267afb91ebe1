"""Ling3's transformers configuration: KimiLinear's, plus what Ling3 sets that KimiLinear cannot express.

Written by lingpack's exporter into a model directory; it imports only transformers, so the directory loads
with `AutoConfig.from_pretrained(path, trust_remote_code=True)` where lingpack is not installed.

Extra fields (beyond KimiLinearConfig's):
* kda_lower_bound: the safe KDA forget gate `g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))`
  (fla-org/flash-linear-attention:fla/ops/kda/gate.py); None keeps KimiLinear's softplus gate.
* kda_gate_activation: the activation gating the KDA output norm ("sigmoid" or "silu").
* mla_rope_type: "none" (KimiLinear's NoPE MLA) or "rope" (DeepSeek-V3 MLA with RoPE on the rope slice);
  rope_theta, rope_interleave and mla_rotary_dim (how many rope features rotate; the rest pass through).
* mtp_num_layers, mtp_use_moe: the multi-token-prediction layers stored beside the model (`mtp.{d}.*`).
"""

from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig


class Ling3Config(KimiLinearConfig):
    model_type = "ling3"

    def __init__(self, kda_lower_bound=None, kda_gate_activation="sigmoid", mla_rope_type="none",
                 rope_theta=10000.0, rope_interleave=True, mla_rotary_dim=None, mtp_num_layers=0,
                 mtp_use_moe=True, **kwargs):
        self.kda_lower_bound = kda_lower_bound
        self.kda_gate_activation = kda_gate_activation
        self.mla_rope_type = mla_rope_type
        self.rope_theta = rope_theta
        self.rope_interleave = rope_interleave
        self.mla_rotary_dim = mla_rotary_dim
        self.mtp_num_layers = mtp_num_layers
        self.mtp_use_moe = mtp_use_moe
        super().__init__(**kwargs)


__all__ = ["Ling3Config"]
