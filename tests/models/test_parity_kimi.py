"""Whole-model parity with transformers' KimiLinearForCausalLM (CPU torch, fp32), weights converted both ways."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3, Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from lingpack.parity import convert
from tests.optional import require

torch = require("torch")
transformers = require("transformers")


def kimi_like_config(**overrides) -> Ling3Config:
    """KDA (softplus gate), NoPE MLA, one dense layer then MoE with groups: everything the port can express."""
    cfg = Ling3Config(
        vocab_size=96, emb_dim=32, num_layers=4, inhomogeneous_layer_cycle_interval=4, first_dense_layers=1,
        mlp_dim=48, norm_eps=1e-6, mtp_num_layers=1,
        kda=KDAConfig(num_heads=2, head_dim=16, lower_bound=None, gate_activation=convert.hf_gated_norm_activation()),
        mla=MLAConfig(num_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=12, rope_type="none"),
        moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, num_shared_experts=1, n_groups=2, topk_groups=1,
                      routed_scaling_factor=2.5, norm_topk_prob=False))
    return dataclasses.replace(cfg, **overrides)


def _randomize_hf(model, seed=0):
    """O(1) activations (the default 0.02 init makes every logit ~0 and the comparison vacuous)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if p.ndim == 1 or name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def _hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor(tokens)).logits.numpy()


def _our_logits(model, tokens):
    return np.asarray(nnx.jit(lambda m, x: m(x).logits_BTV)(model, jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def setup():
    cfg = kimi_like_config()
    torch.manual_seed(0)
    hf_model = transformers.KimiLinearForCausalLM(convert.kimi_config_from_ling3(cfg)).eval()
    _randomize_hf(hf_model)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 70))  # 70: two KDA chunks, a partial one
    return cfg, hf_model, tokens


def test_hf_to_lingpack_logits(setup):
    cfg, hf_model, tokens = setup
    model = Ling3(cfg, rngs=nnx.Rngs(1))
    convert.load_hf_state_dict(model, hf_model.state_dict())
    ref = _hf_logits(hf_model, tokens)
    assert np.std(ref) > 0.3  # a real test: logits are O(1)
    np.testing.assert_allclose(_our_logits(model, tokens), ref, atol=1e-4 * np.abs(ref).max(), rtol=1e-4)
    # the round trip back to transformers names reproduces every tensor
    back = convert.to_hf_state_dict(model)
    sd = hf_model.state_dict()
    assert set(back) == set(sd)
    for name, value in back.items():
        np.testing.assert_array_equal(value, sd[name].numpy(), err_msg=name)


def test_lingpack_to_hf_logits(setup):
    cfg, _, tokens = setup
    model = Ling3(cfg, rngs=nnx.Rngs(2))
    key = jax.random.key(3)
    for path, var in nnx.iter_graph(model):  # O(1) activations, as above
        if isinstance(var, nnx.Param) and var.ndim >= 2 and path[-1] not in ("conv",):
            key, sub = jax.random.split(key)
            fan_in = var.shape[-2]
            var[...] = jax.random.normal(sub, var.shape) / np.sqrt(fan_in)
    hf_model = transformers.KimiLinearForCausalLM(convert.kimi_config_from_ling3(cfg)).eval()
    missing, unexpected = hf_model.load_state_dict({k: torch.tensor(v) for k, v in convert.to_hf_state_dict(model).items()},
                                                   strict=True)
    assert not missing and not unexpected
    ref = _hf_logits(hf_model, tokens)
    assert np.std(ref) > 0.3
    np.testing.assert_allclose(_our_logits(model, tokens), ref, atol=1e-4 * np.abs(ref).max(), rtol=1e-4)


def test_config_round_trip_and_refusals():
    cfg = kimi_like_config(mtp_num_layers=0)
    assert convert.ling3_config_from_kimi(convert.kimi_config_from_ling3(cfg)) == dataclasses.replace(
        cfg, mtp=cfg.mtp)
    with pytest.raises(ValueError, match="softplus"):
        convert.kimi_config_from_ling3(dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, lower_bound=-5.0)))
    with pytest.raises(ValueError, match="NoPE"):
        convert.kimi_config_from_ling3(dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, rope_type="rope")))
    other = "silu" if convert.hf_gated_norm_activation() == "sigmoid" else "sigmoid"
    with pytest.raises(ValueError, match="gate_activation"):
        convert.kimi_config_from_ling3(dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, gate_activation=other)))


@pytest.mark.slow
def test_q_lora_and_normalised_topk_variant():
    cfg = kimi_like_config(mla=dataclasses.replace(kimi_like_config().mla, q_lora_rank=12),
                           moe=dataclasses.replace(kimi_like_config().moe, norm_topk_prob=True, n_groups=1, topk_groups=1))
    hf_model = transformers.KimiLinearForCausalLM(convert.kimi_config_from_ling3(cfg)).eval()
    _randomize_hf(hf_model, seed=1)
    model = Ling3(cfg, rngs=nnx.Rngs(1))
    convert.load_hf_state_dict(model, hf_model.state_dict())
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 40))
    ref = _hf_logits(hf_model, tokens)
    np.testing.assert_allclose(_our_logits(model, tokens), ref, atol=1e-4 * np.abs(ref).max(), rtol=1e-4)


def test_scanned_model_converts_both_ways():
    """A model whose MoE layers are scanned (stacked weights) loads, runs and exports like the unrolled one."""
    cfg = kimi_like_config(num_layers=6, inhomogeneous_layer_cycle_interval=2, mtp_num_layers=0)
    assert cfg.scanned_layers() == range(1, 6)  # layer 0 (dense) unrolled, 1-5 scanned: MLA KDA MLA KDA MLA
    hf_model = transformers.KimiLinearForCausalLM(convert.kimi_config_from_ling3(cfg)).eval()
    _randomize_hf(hf_model, seed=2)
    model = Ling3(cfg, rngs=nnx.Rngs(1))
    assert model.stack is not None
    convert.load_hf_state_dict(model, hf_model.state_dict())
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 40))
    ref = _hf_logits(hf_model, tokens)
    assert np.std(ref) > 0.3
    np.testing.assert_allclose(_our_logits(model, tokens), ref, atol=1e-4 * np.abs(ref).max(), rtol=1e-4)
    back, sd = convert.to_hf_state_dict(model), hf_model.state_dict()
    assert set(back) == set(sd)
    for name, value in back.items():
        np.testing.assert_array_equal(value, sd[name].numpy(), err_msg=name)
