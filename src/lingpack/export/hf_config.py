"""config.json both ways: a Ling3Config as transformers' KimiLinear or as Ling3's own (remote-code) config, and a
transformers directory's config.json back to a Ling3Config checked against a run's.

The layout: `KimiLinearForCausalLM` when `parity/convert.py` can express the config (softplus KDA gate, NoPE MLA,
latent norm eps 1e-6, the installed port's output-gate activation), else `Ling3ForCausalLM` from the modeling
file written beside the weights (`remote/`), which adds what KimiLinear lacks as extra config fields.
"""

from __future__ import annotations

import dataclasses
import json
import os

from lingpack.errors import ConfigError
from lingpack.models.ling3 import Ling3Config
from lingpack.parity import convert

KIMI, LING3 = "kimi_linear", "ling3"
AUTO_MAP = {"AutoConfig": "configuration_ling3.Ling3Config", "AutoModelForCausalLM": "modeling_ling3.Ling3ForCausalLM"}

# What a checkpoint's config fixes: the run's model must agree on these to take its weights. Implementation
# choices (kernels, remat, scan, dtypes) and training-only settings (bias update rate, z-loss, MTP loss scale) are
# the run's own.
ARCHITECTURE = ("vocab_size", "emb_dim", "num_layers", "inhomogeneous_layer_cycle_interval", "first_dense_layers",
                "mlp_dim", "norm_eps", "tie_embeddings", "kda.num_heads", "kda.head_dim", "kda.conv_size",
                "kda.lower_bound", "kda.gate_activation", "mla.num_heads", "mla.q_lora_rank", "mla.kv_lora_rank",
                "mla.qk_nope_head_dim", "mla.qk_rope_head_dim", "mla.v_head_dim", "mla.rope_type",
                "mla.latent_norm_eps", "moe.num_experts", "moe.top_k", "moe.expert_dim", "moe.num_shared_experts",
                "moe.n_groups", "moe.topk_groups", "moe.routed_scaling_factor", "moe.norm_topk_prob")
ROPE = ("mla.rope_theta", "mla.partial_rotary_factor", "mla.rope_interleaved")   # only with mla.rope_type="rope"


def layout_of(cfg: Ling3Config) -> tuple[str, str | None]:
    """(KIMI, None) when transformers' KimiLinear expresses `cfg`, else (LING3, what KimiLinear lacks)."""
    try:
        convert.kimi_config_from_ling3(cfg)
        return KIMI, None
    except ValueError as err:
        return LING3, str(err)


def config_json(cfg: Ling3Config, layout: str, *, mtp: bool, eos_id: int | None, pad_id: int | None) -> dict:
    """The config.json of an export in `layout`; `mtp`: the MTP layers are stored (`mtp.{d}.*`)."""
    base = cfg if layout == KIMI else dataclasses.replace(   # KimiLinear's part; the rest as extra fields
        cfg, kda=dataclasses.replace(cfg.kda, lower_bound=None, gate_activation=convert.hf_gated_norm_activation()),
        mla=dataclasses.replace(cfg.mla, rope_type="none"))
    out = convert.kimi_config_from_ling3(base).to_dict()
    valid = lambda i: i if i is not None and 0 <= i < cfg.vocab_size else None
    out.update(eos_token_id=valid(eos_id), pad_token_id=valid(pad_id), bos_token_id=None, dtype="float32",
               mtp_num_layers=cfg.mtp_num_layers if mtp else 0, mtp_use_moe=cfg.mtp.use_moe)
    if layout == KIMI:
        out["architectures"] = ["KimiLinearForCausalLM"]
        return out
    out.update(model_type="ling3", architectures=["Ling3ForCausalLM"], auto_map=dict(AUTO_MAP),
               kda_lower_bound=cfg.kda.lower_bound, kda_gate_activation=cfg.kda.gate_activation,
               mla_rope_type=cfg.mla.rope_type, rope_theta=cfg.mla.rope_theta,
               rope_interleave=cfg.mla.rope_interleaved, mla_rotary_dim=cfg.mla.rotary_dim)
    return out


def read_config_json(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model.init_from={directory}: no config.json there; give a transformers model directory "
                          "(what `python -m lingpack.export` or save_pretrained writes)")
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


def ling3_config_from_json(d: dict, directory: str) -> Ling3Config:
    """The Ling3Config a KimiLinear or Ling3 config.json describes (MTP layers as stored: `mtp_num_layers`)."""
    from transformers import KimiLinearConfig
    kind = d.get("model_type")
    if kind not in (KIMI, LING3):
        raise ConfigError(f"model.init_from={directory}: model_type {kind!r} is not {KIMI!r} or {LING3!r}; lingpack "
                          "starts from KimiLinear checkpoints and its own Ling3 exports")
    plain = {k: v for k, v in d.items() if k not in ("model_type", "auto_map", "architectures")}
    try:
        cfg = convert.ling3_config_from_kimi(KimiLinearConfig(**plain))
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model.init_from={directory}: {err}") from err
    mtp = int(d.get("mtp_num_layers", 0))
    cfg = dataclasses.replace(cfg, mtp_num_layers=mtp,
                              mtp=dataclasses.replace(cfg.mtp, use_moe=bool(d.get("mtp_use_moe", True))))
    if kind == LING3:
        rope = d.get("mla_rope_type", "none")
        factor = (d.get("mla_rotary_dim") or cfg.mla.qk_rope_head_dim) / cfg.mla.qk_rope_head_dim
        cfg = dataclasses.replace(
            cfg, kda=dataclasses.replace(cfg.kda, lower_bound=d.get("kda_lower_bound"),
                                         gate_activation=d.get("kda_gate_activation", cfg.kda.gate_activation)),
            mla=dataclasses.replace(cfg.mla, rope_type=rope, rope_theta=float(d.get("rope_theta", 10000.0)),
                                    rope_interleaved=bool(d.get("rope_interleave", True)),
                                    partial_rotary_factor=factor))
    return cfg


def _field(cfg: Ling3Config, name: str):
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_matches(stored: Ling3Config, run: Ling3Config, directory: str) -> None:
    """ConfigError, one line, naming every architecture field where the checkpoint and the run's model differ."""
    names = ARCHITECTURE + (ROPE if run.mla.rope_type == "rope" == stored.mla.rope_type else ())
    diff = [f"model.{n}: checkpoint {_field(stored, n)!r}, this run {_field(run, n)!r}" for n in names
            if _field(stored, n) != _field(run, n)]
    if diff:
        raise ConfigError(f"model.init_from={directory} holds another model: {'; '.join(diff)}. Set the run's model "
                          "keys to the checkpoint's (e.g. model.vocab_size) or start from a matching checkpoint")
