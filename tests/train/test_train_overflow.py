"""Documents beyond the aligned kernels' max_segs: out of the loss and every gradient, counted, or halted on.

Oracles: the same batch with those documents' loss mask zeroed (router z-loss off) or made padding (router
z-loss on), run on the segment-native kernel, which has no slot limit; and each surviving document run alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train_helpers import TinyConfig, tree_allclose

from lingpack.data import DataConfig
from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3, Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from lingpack.parity.packing import packing_parity
from lingpack.train import loop as loop_lib
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.step import ModelDef, accumulate_gradients, drop_overflow, init_fn

from tests.models.packing_cases import packed_batch

MODEL = Ling3Config(vocab_size=64, emb_dim=32, num_layers=2, inhomogeneous_layer_cycle_interval=2, mlp_dim=64,
                    kda=KDAConfig(num_heads=2, head_dim=16), kda_chunk_size=16,
                    mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                    moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, z_loss_coef=1e-2))
ROWS, T, MAX_SEGS = [[9, 12, 11], [5, 14, 7, 6]], 32, 4   # 7 documents: row 1's last three do not fit
DROPPED = (slice(1, 2), slice(5, 32))                    # row 1 from its second document on


def _defs(z_loss_coef: float = MODEL.moe.z_loss_coef) -> dict:
    """The aligned (overflowing) and segment-native model definitions, with this router z-loss weight."""
    model = dataclasses.replace(MODEL, moe=dataclasses.replace(MODEL.moe, z_loss_coef=z_loss_coef))
    aligned_cfg = dataclasses.replace(model, kda_impl="chunked_aligned", kda_max_segs=MAX_SEGS)
    native_cfg = dataclasses.replace(model, kda_impl="chunked")
    return {name: ModelDef.from_constructor(lambda c=c: Ling3(c, rngs=nnx.Rngs(0)), c)
            for name, c in (("aligned", aligned_cfg), ("native", native_cfg))}


@pytest.fixture(scope="module")
def setup():
    aligned_cfg = dataclasses.replace(MODEL, kda_impl="chunked_aligned", kda_max_segs=MAX_SEGS)
    defs = _defs()
    state = init_fn(lambda: Ling3(aligned_cfg, rngs=nnx.Rngs(0)), OptimConfig(decay_steps=10), 0)()
    batch = packed_batch(ROWS, T, vocab=64)
    return defs, state, batch


def _grads(model_def, state, batch, loss_cfg):
    fn = jax.jit(lambda p, r, b: accumulate_gradients(model_def, loss_cfg, p, r, b, micro_batches=1)[:2])
    return fn(state.params, state.rest, {k: jnp.asarray(v) for k, v in batch.items()})


def _without_dropped(batch, *keys):
    out = {k: v.copy() for k, v in batch.items()}
    for key in keys:
        out[key][DROPPED] = 0
    return out


def test_drop_overflow_keeps_the_first_max_segs_documents(setup):
    _, _, batch = setup
    kept, counts = drop_overflow({k: jnp.asarray(v)[None] for k, v in batch.items()}, MAX_SEGS)
    want = _without_dropped(batch, "inputs_segmentation", "targets_segmentation")
    for key in batch:
        np.testing.assert_array_equal(np.asarray(kept[key][0]), want[key], err_msg=key)
    assert int(counts["dropped_documents"]) == 3 and int(counts["dropped_tokens"]) == 14 + 7 + 6


def test_drop_overflow_in_zigzag_layout_matches_token_order(setup):
    """Under zigzag context parallelism the batch arrives reordered; the dropped documents are the same."""
    from types import SimpleNamespace

    from lingpack.parallel.reorder import reorder_batch
    _, _, batch = setup
    context = SimpleNamespace(size=2, load_balance=True)
    want, want_counts = drop_overflow({k: jnp.asarray(v)[None] for k, v in batch.items()}, MAX_SEGS)
    zigzag = reorder_batch(batch, context.size)
    got, got_counts = drop_overflow({k: jnp.asarray(v)[None] for k, v in zigzag.items()}, MAX_SEGS, context)
    for key in batch:
        np.testing.assert_array_equal(np.asarray(got[key][0]), reorder_batch({key: np.asarray(want[key][0])}, 2)[key])
    assert {k: int(v) for k, v in got_counts.items()} == {k: int(v) for k, v in want_counts.items()}


@pytest.mark.parametrize("z_loss,oracle_keys", [
    (0.0, ("targets_segmentation",)),                           # the loss mask alone removes them
    pytest.param(1e-2, ("targets_segmentation", "inputs_segmentation"),  # with router z-loss: padding
                 marks=pytest.mark.slow),
])
def test_overflow_gradients_equal_the_batch_without_those_documents(setup, z_loss, oracle_keys):
    _, state, batch = setup
    loss_cfg, defs = LossConfig(), _defs(z_loss)
    g_overflow, s_overflow = _grads(defs["aligned"], state, batch, loss_cfg)
    g_oracle, s_oracle = _grads(defs["native"], state, _without_dropped(batch, *oracle_keys), loss_cfg)
    assert int(s_overflow["dropped_documents"]) == 3 and int(s_oracle["dropped_documents"]) == 0
    np.testing.assert_allclose(float(s_overflow["objective"]), float(s_oracle["objective"]), rtol=1e-5)
    assert float(s_overflow["lm_tokens"]) == float(s_oracle["lm_tokens"])
    tree_allclose(g_overflow, g_oracle, rtol=2e-4, atol=1e-6)
    if z_loss:  # MoE statistics count only the documents that trained
        np.testing.assert_array_equal(np.asarray(s_overflow["moe_z_tokens"]), np.asarray(s_oracle["moe_z_tokens"]))


@pytest.mark.slow  # default suite: the surviving documents' loss and gradients (the z_loss=0 case above)
def test_surviving_documents_match_the_per_document_result(setup):
    defs, state, batch = setup
    model = defs["aligned"].merge(state.params, state.rest)
    result = packing_parity(model, batch)
    assert result["documents"] == MAX_SEGS and result["dropped_documents"] == 3
    assert result["rel_diff"] < 1e-5


DATA = DataConfig(source="synthetic", seq_length=32, global_batch_size=8, synthetic_mean_length=8,
                  synthetic_num_documents=400, read_threads=1, prefetch_buffer_size=1)


def _train(tmp_path, policy, max_segs):
    model = TinyConfig(kda_impl="chunked_aligned", kda_max_segs=max_segs)
    return loop_lib.train(model, DATA, LossConfig(), OptimConfig(decay_steps=3), ParallelConfig(data=2, fsdp=2, tensor=2),
                          CheckpointConfig(directory=str(tmp_path / "ckpt"), save_every=10),
                          TrainConfig(steps=3, micro_batches=2, progress_bar=False, overflow_policy=policy))


def test_warn_counts_and_halt_stops_before_the_update(tmp_path):
    warned = _train(tmp_path / "warn", "warn", max_segs=12)
    dropped = [h["dropped_documents"] for h in warned.history]
    assert any(dropped) and all(h["applied"] for h in warned.history)
    assert all(h["dropped_tokens"] > 0 for h in warned.history if h["dropped_documents"])
    first = next(i for i, d in enumerate(dropped) if d)
    with pytest.raises(loop_lib.OverflowHaltError, match="do not fit kernel.max_segs=12") as err:
        _train(tmp_path / "halt", "halt", max_segs=12)
    assert [h["applied"] for h in err.value.history] == [1] * first + [0]
    assert err.value.checkpoint_step == first   # the state before the overflowing batch
    assert [h["loss"] for h in err.value.history[:first]] == [h["loss"] for h in warned.history[:first]]
