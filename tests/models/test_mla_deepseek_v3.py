"""lingpack's MLA with RoPE (partial rotary, interleaved or half-split) against transformers' DeepseekV3Attention.

Each packed document runs alone through DeepseekV3Attention (weights from `convert.mla_to_deepseek_v3`,
positions from 0, a causal mask); lingpack runs the packed rows with restarting positions. fp32 <= 1e-5.
"""
import jax
import numpy as np
import pytest
from flax import nnx

from lingpack.models.mla import MLA, MLAConfig
from lingpack.parity import convert
from tests.kernels.kda_cases import segments_from_lengths
from tests.optional import require

torch = require("torch")
transformers = require("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

D = 40
ROWS, T = [[1, 23, 30], [54], [9, 40]], 60   # a length-1 document, a full row, trailing padding


def _mla(cfg, seed=0):
    mla = MLA(cfg, D, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for _, var in nnx.iter_graph(mla):   # O(1) activations, so a wrong rotation shows in the output
        if isinstance(var, nnx.Param):
            key, sub = jax.random.split(key)
            var[...] = (jax.random.normal(sub, var.shape) / np.sqrt(var.shape[-2]) if var.ndim >= 2
                        else 0.5 + jax.random.uniform(sub, var.shape))
    return mla


def _deepseek_v3(cfg, mla):
    config = convert.deepseek_v3_config_from_mla(cfg, D)
    config._attn_implementation = "eager"
    attention = hf.DeepseekV3Attention(config, layer_idx=0).eval()
    attention.load_state_dict({k: torch.tensor(v) for k, v in convert.mla_to_deepseek_v3(mla).items()}, strict=True)
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    rotary.inv_freq = torch.tensor(convert.deepseek_v3_rope_inv_freq(cfg))
    return attention, rotary


def _reference_document(attention, rotary, x_TD):
    n = x_TD.shape[0]
    x = torch.tensor(x_TD)[None]
    cos_sin = rotary(x, torch.arange(n)[None])
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return attention(x, position_embeddings=cos_sin, attention_mask=causal)[0][0].numpy()


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("partial_rotary_factor,q_lora_rank", [(0.5, 16), (1.0, None), (0.25, 16)])
def test_mla_matches_deepseek_v3_per_document(interleaved, partial_rotary_factor, q_lora_rank):
    cfg = MLAConfig(num_heads=3, q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=16,
                    v_head_dim=12, rope_type="rope", rope_theta=500.0, partial_rotary_factor=partial_rotary_factor,
                    rope_interleaved=interleaved)
    mla = _mla(cfg)
    attention, rotary = _deepseek_v3(cfg, mla)
    seg = segments_from_lengths(ROWS, T)
    pos = np.zeros_like(seg)
    for b, row in enumerate(ROWS):
        start = 0
        for n in row:
            pos[b, start:start + n] = np.arange(n)
            start += n
    x = np.random.default_rng(0).standard_normal((len(ROWS), T, D)).astype(np.float32)
    ours = np.asarray(nnx.jit(lambda m, x, s, p: m(x, s, p))(mla, x, seg, pos))
    for b, row in enumerate(ROWS):
        start = 0
        for n in row:
            ref = _reference_document(attention, rotary, x[b, start:start + n])
            np.testing.assert_allclose(ours[b, start:start + n], ref, atol=1e-5, rtol=1e-5)
            start += n
    assert np.std(ours[seg > 0]) > 0.3


def test_rope_order_is_a_permutation_and_refusals():
    for interleaved in (True, False):
        for factor in (0.25, 0.5, 1.0):
            cfg = MLAConfig(qk_rope_head_dim=16, partial_rotary_factor=factor, rope_interleaved=interleaved)
            assert sorted(convert._rope_order(cfg)) == list(range(16))
            freqs = convert.deepseek_v3_rope_inv_freq(cfg)
            assert freqs.shape == (8,) and (freqs > 0).sum() == cfg.rotary_dim // 2
    with pytest.raises(ValueError, match="rope_type"):
        convert.deepseek_v3_config_from_mla(MLAConfig(rope_type="none"), D)
