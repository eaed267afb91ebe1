"""Training FLOPs per token (train/flops.py) against what the model computes, and the CPU MFU ceiling: a matmul
throughput measured once per process, shared by the fake CPU devices."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from lingpack.models.head import LMHead
from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3, Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from lingpack.models.mtp import MTPConfig
from lingpack.train import flops

MODEL = Ling3Config(vocab_size=256, emb_dim=32, num_layers=2, inhomogeneous_layer_cycle_interval=2, mlp_dim=64,
                    kda=KDAConfig(num_heads=2, head_dim=16), kda_chunk_size=16, attention_block_size=16,
                    mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                    moe=MoEConfig(num_experts=8, top_k=2, expert_dim=16, n_groups=2, topk_groups=1),
                    mtp_num_layers=2, mtp=MTPConfig(use_moe=True))


def test_cpu_peak_is_the_measured_matmul_ceiling_per_device():
    measured = flops.measured_matmul_flops()
    assert measured > 1e8 and flops.measured_matmul_flops() == measured  # measured once, then cached
    assert jax.devices()[0].platform == "cpu"
    n = len(jax.local_devices(backend="cpu"))
    assert n == 8 and flops.peak_flops_per_device() == measured / n  # conftest's 8 fake devices share the cores


@pytest.mark.parametrize("tie", [False, True])
def test_every_pass_through_the_output_head_is_counted(tie):
    """Each LMHead the model returns (the main one, one per MTP depth) is an h [T, D] @ w [D, V] matmul: 6 V D
    training FLOPs a token. The parameter count holds the shared head once, so the FLOPs per token must grow by
    6 D x (heads the model returns) per vocabulary column."""
    cfg = dataclasses.replace(MODEL, tie_embeddings=tie)
    graph, state = nnx.split(nnx.eval_shape(lambda: Ling3(cfg, rngs=nnx.Rngs(0))))
    out = jax.eval_shape(lambda s, x: nnx.merge(graph, s)(x), state, jax.ShapeDtypeStruct((1, 64), jnp.int32))
    heads = [h for h in jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, LMHead)) if isinstance(h, LMHead)]
    assert len(heads) == 1 + cfg.mtp_num_layers
    assert all(h.w.shape == ((cfg.vocab_size, cfg.emb_dim) if tie else (cfg.emb_dim, cfg.vocab_size)) for h in heads)
    wider = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 64)
    grown = flops.flops_per_token(wider, 64) - flops.flops_per_token(cfg, 64)
    assert grown == pytest.approx(64 * 6 * cfg.emb_dim * len(heads), rel=1e-12)
