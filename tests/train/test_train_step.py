"""Gradient accumulation equals one big batch; the full step (update, NaN guard, expert bias, bf16 master)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.kda_cases import rms_ratio
from train_helpers import TinyConfig, synthetic_batch, tiny_model_def, to_jnp, tree_allclose

from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig
from lingpack.train.sharding import make_mesh
from lingpack.train.step import accumulate_gradients, init_train_state, make_train_step


@pytest.fixture(scope="module")
def setup():
    model_def, make = tiny_model_def()
    mesh = make_mesh(ParallelConfig(data=1), devices=jax.devices()[:1])
    state, shardings = init_train_state(model_def, make, OptimConfig(decay_steps=10), 0, mesh, ParallelConfig().rules)
    return model_def, make, state, to_jnp(synthetic_batch(rows=8))


def _grads(model_def, state, batch, cfg, M):
    fn = jax.jit(lambda p, r, b: accumulate_gradients(model_def, cfg, p, r, b, micro_batches=M)[:2])
    return fn(state.params, state.rest, batch)


def _loss(stats):
    return float(stats["objective"])


@pytest.mark.parametrize("case", ["per_token", pytest.param("megatron_cptl", marks=pytest.mark.slow), "megatron"])
def test_accumulation_equals_big_batch(setup, case):
    model_def, _, state, batch = setup
    k = 4
    if case == "per_token":      # the global token mean: k micro-batches == one batch, every term included
        small, big = LossConfig(mode="per_token"), LossConfig(mode="per_token")
    elif case == "megatron_cptl":
        small = big = LossConfig(mode="megatron", calculate_per_token_loss=True)
    else:                         # mean of k micro-batch means == one batch of k "ranks" (router z-loss off: see loss.py)
        small, big = LossConfig(mode="megatron"), LossConfig(mode="megatron", megatron_dp_size=k)
        tiny = TinyConfig()
        model_def, _ = tiny_model_def(dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, z_loss_coef=0.0)))
    g_small, s_small = _grads(model_def, state, batch, small, k)
    g_big, s_big = _grads(model_def, state, batch, big, 1)
    np.testing.assert_allclose(_loss(s_small), _loss(s_big), rtol=1e-6)
    tree_allclose(g_small, g_big, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(s_small["load_counts"], s_big["load_counts"])
    if case == "megatron":        # and the megatron objective really differs from the token mean on this batch
        _, s_tok = _grads(model_def, state, batch, LossConfig(mode="per_token"), 1)
        assert abs(_loss(s_tok) - _loss(s_big)) > 1e-4


def test_step_updates_and_guards_nan(setup):
    model_def, make, _, batch = setup
    mesh = make_mesh(ParallelConfig(data=1), devices=jax.devices()[:1])
    rules = ParallelConfig().rules
    optim = OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=10)
    state, shardings = init_train_state(model_def, make, optim, 0, mesh, rules)
    before = jax.tree.map(np.asarray, state)
    step = make_train_step(model_def, LossConfig(), optim, micro_batches=2, mesh=mesh, rules=rules,
                           shardings=shardings)
    state, m = step(state, batch)
    assert int(m["finite"]) == 1 and int(state.step) == 1 and int(state.updates) == 1
    assert float(m["lr"]) == pytest.approx(1e-2)
    assert not np.allclose(np.asarray(state.params["up"]), before.params["up"])
    bias = np.asarray(state.rest["moe"]["expert_bias"])
    assert np.abs(bias).max() > 0 and abs(bias.mean()) < 1e-6      # moved by the load counts, re-centred

    good = jax.tree.map(np.asarray, state)
    poisoned = dict(batch, targets=batch["targets"].at[0, 0].set(10**6))   # out-of-vocab target -> NaN loss
    state, m = step(state, poisoned)
    assert int(m["finite"]) == 0 and int(state.step) == 2 and int(state.updates) == 1
    tree_allclose(state.params, good.params, rtol=0, atol=0)
    tree_allclose(state.opt_state, good.opt_state, rtol=0, atol=0)


def test_bf16_compute_fp32_master():
    cfg = TinyConfig()
    model_def, make = tiny_model_def(cfg)
    # a bf16 model: every parameter the model creates in bf16; the master copy stays fp32
    from flax import nnx
    from train_helpers import TinyLM

    class BF16(TinyLM):
        def __init__(self, cfg, rngs):
            super().__init__(cfg, rngs)
            self.up = nnx.Param(self.up[...].astype(jnp.bfloat16))
    make16 = lambda: BF16(cfg, nnx.Rngs(0))
    from lingpack.train.step import ModelDef
    md16 = ModelDef.from_constructor(make16, cfg)
    mesh = make_mesh(ParallelConfig(data=1), devices=jax.devices()[:1])
    state, _ = init_train_state(md16, make16, OptimConfig(decay_steps=4), 0, mesh, ParallelConfig().rules)
    assert state.params["up"].dtype == jnp.float32
    model = md16.merge(state.params, state.rest)
    assert model.up[...].dtype == jnp.bfloat16
    batch = to_jnp(synthetic_batch(rows=4))
    g, _ = _grads(md16, state, batch, LossConfig(), 1)
    g32, _ = _grads(model_def, state, batch, LossConfig(), 1)   # the same fp32 master weights, all fp32 compute
    assert g["up"].dtype == jnp.float32
    # x @ up promotes to fp32 (x is fp32), so only up's own gradient passes through bf16: it is rounded, not wrong
    assert 0 < rms_ratio(g32["up"], g["up"]) < 2 ** -8, rms_ratio(g32["up"], g["up"])
    tree_allclose({k: v for k, v in g.items() if k != "up"}, {k: v for k, v in g32.items() if k != "up"}, 0, 0)


def test_evaluation_sums_what_training_sums(setup):
    # evaluate.make_eval_step runs the training step's forward and loss statistics without the update
    from lingpack.train.evaluate import STAT_KEYS, make_eval_step
    model_def, _, state, batch = setup
    cfg = LossConfig(megatron_dp_size=2)
    _, train_stats = _grads(model_def, state, batch, cfg, 2)
    eval_stats = make_eval_step(model_def, cfg, micro_batches=2)(state.params, state.rest, batch)
    assert float(train_stats["lm_tokens"]) > 0 and np.asarray(eval_stats["mtp_sum"]).size > 0
    for key in STAT_KEYS:
        np.testing.assert_allclose(eval_stats[key], train_stats[key], rtol=1e-5, err_msg=key)


def test_micro_batch_errors(setup):
    model_def, _, state, batch = setup
    with pytest.raises(ValueError, match="micro_batches=3"):
        _grads(model_def, state, batch, LossConfig(), 3)
    with pytest.raises(ValueError, match="megatron_dp_size=3"):
        _grads(model_def, state, batch, LossConfig(megatron_dp_size=3), 2)
