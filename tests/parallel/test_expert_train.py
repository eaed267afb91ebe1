"""Expert parallelism in the train step (TrainProgram: the run's mesh, shardings and jitted step).

- The compiled step of a small Ling3 (8 experts) for `expert=4 x data=2` and `expert=4 x context=2`: all-to-alls
  present, no all-gather whose result is a whole [E, D, I] / [E, I, D] expert tensor, no all-reduce of the
  MoE's [N*k, D] (or [N, D]) token rows.
- Traced for TPU and GPU the step exports with XLA's ragged all-to-all.
- Three train steps with `expert=4 x data=2` equal one device: every step's metrics, the parameters, the
  expert bias (moved by the global load counts) and the optimizer state after them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from lingpack.plan import hlo
from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from lingpack.parallel import expert
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.program import TrainProgram
from tests.models.packing_cases import packed_batch

ROWS, T = 8, 64
MODEL = Ling3Config(vocab_size=256, emb_dim=32, num_layers=2, inhomogeneous_layer_cycle_interval=2, mlp_dim=64,
                    kda=KDAConfig(num_heads=2, head_dim=16), kda_chunk_size=16, attention_block_size=16,
                    mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                    moe=MoEConfig(num_experts=8, top_k=2, expert_dim=16, n_groups=2, topk_groups=1, z_loss_coef=1e-3,
                                  bias_update_rate=1e-2),
                    mtp_num_layers=0)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, decay_steps=10, clip_grad_norm=0.0)
LOSS = LossConfig(megatron_dp_size=2)


def _program(parallel: ParallelConfig, devices: int) -> TrainProgram:
    return TrainProgram.build(MODEL, LOSS, OPTIM, parallel, TrainConfig(), rows=ROWS, seq_length=T,
                              devices=jax.devices()[:devices], donate=False)


def expert_collectives(compiled, moe: MoEConfig, D: int):
    """(all-to-all count, all-gathers of a whole expert tensor, all-reduces of global token rows) in the HLO."""
    ops, _ = hlo.collective_ops(compiled.as_text())
    whole = {(moe.num_experts, D, moe.expert_dim), (moe.num_experts, moe.expert_dim, D)}
    rows = {ROWS * T * moe.top_k, ROWS * T}
    gathers = [op.shape for op in ops if op.kind == "all-gather" and any(tuple(d) in whole for d in op.dims)]
    reduces = [op.shape for op in ops if op.kind == "all-reduce" and any(d[:1] and d[0] in rows for d in op.dims)]
    return sum(op.kind == "all-to-all" for op in ops), gathers, reduces


@pytest.mark.slow
@pytest.mark.parametrize("axes", [dict(data=2, expert=4), dict(data=1, expert=4, context=2)],
                         ids=["expert4-data2", "expert4-context2"])
def test_compiled_step_exchanges_tokens_not_experts(axes):
    compiled = _program(ParallelConfig(**axes), 8).lower().compile()
    to_all, gathers, reduces = expert_collectives(compiled, MODEL.moe, MODEL.emb_dim)
    assert to_all >= 4 and gathers == [] and reduces == [], (to_all, gathers, reduces)


def _three_steps(parallel: ParallelConfig, devices: int):
    program = _program(parallel, devices)
    state = jax.jit(program.init, out_shardings=program.shardings)()
    metrics = []
    for seed in range(3):
        batch = packed_batch([[20, 30, 14], [64], [5, 40], [63], [1, 2, 3, 50], [33, 31], [10], [60, 4]], T,
                             MODEL.vocab_size, seed=seed)
        state, m = program.step(state, jax.device_put(batch, program.batch_sharding))
        metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics


@pytest.mark.slow
def test_three_steps_expert4_x_data2_equal_one_device():
    ref_state, ref_metrics = _three_steps(ParallelConfig(data=1), 1)
    state, metrics = _three_steps(ParallelConfig(data=2, expert=4), 8)
    for step, (m, r) in enumerate(zip(metrics, ref_metrics)):
        for key in ("loss", "lm_loss", "moe_z_loss", "grad_norm"):
            np.testing.assert_allclose(m[key], r[key], rtol=1e-5, err_msg=f"step {step}: {key}")
    np.testing.assert_array_equal(state.step, 3)
    for (path, r), p in zip(jax.tree_util.tree_leaves_with_path(ref_state.params), jax.tree.leaves(state.params)):
        # Adam moves a parameter by lr * m / (sqrt(v) + eps): a 1e-5 relative gradient difference on a
        # near-zero gradient becomes a visible share of lr, so parameters compare against lr (as in the CP
        # train-step test); the expert bias, the moments and the counters compare relative to their scale
        np.testing.assert_allclose(p, r, rtol=0, atol=1e-2 * OPTIM.lr, err_msg=jax.tree_util.keystr(path))
    for part in ("rest", "opt_state"):
        ref, got = getattr(ref_state, part), getattr(state, part)
        for (path, r), p in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)):
            r, p = np.asarray(r), np.asarray(p)
            assert r.size == 0 or np.abs(p - r).max() <= 1e-4 * np.abs(r).max(), f"{part}{jax.tree_util.keystr(path)}"
    assert np.abs(np.asarray(jax.tree.leaves(state.rest)[0])).max() > 0   # the bias moved (load counts arrived)


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_step_exports_with_ragged_all_to_all(platform):
    text = _program(ParallelConfig(data=2, expert=4), 8).export(platform).mlir_module()
    # as one MoE layer's (tests/parallel/test_expert.py): forward 2 in the first round and 2 in the overflow
    # rounds' loop; backward 2, and 3 in its loop (inputs and cotangents travel apart there)
    assert text.count(f"custom_call @{expert.RAGGED_ALL_TO_ALL}") == 9, platform


def test_save_moe_exchange_runs_each_exchange_once_as_without_remat():
    """`remat_policy=save_moe_exchange` keeps the rows the dispatch delivered and the outputs the return exchange
    brought back: the rematerialised backward re-runs neither exchange, so the lowered step holds as many
    all-to-alls as the step without remat (`nothing_saveable` holds the forward's again: 26 against 18 here)."""
    def exchanges(**model):
        program = TrainProgram.build(dataclasses.replace(MODEL, **model), LOSS, OPTIM, ParallelConfig(data=2, expert=4),
                                     TrainConfig(), rows=ROWS, seq_length=T, devices=jax.devices()[:8], donate=False)
        return program.lower().as_text().count("all_to_all")
    plain = exchanges(remat=False)
    assert plain > 0 and exchanges(remat=True, remat_policy="save_moe_exchange") == plain
