"""Optimizer: Megatron's own OptimizerParamScheduler, torch AdamW + clip_grad_norm_ as oracles."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lingpack import precision
from lingpack.train.configs import OptimConfig
from lingpack.train.optim import applies_weight_decay, decay_mask, learning_rate, make_optimizer, resolve
from tests.optional import require


def _megatron_scheduler(cfg: OptimConfig, optimizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        OptimizerParamScheduler = require("megatron.core.optimizer_param_scheduler").OptimizerParamScheduler
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
                                   lr_warmup_steps=cfg.warmup_steps, lr_decay_steps=cfg.decay_steps,
                                   lr_decay_style=cfg.schedule, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
                                   wd_incr_steps=cfg.decay_steps, wd_incr_style="constant")


@pytest.mark.parametrize("master_dtype,rtol", [("float32", 1e-6), ("float64", 1e-15)])
@pytest.mark.parametrize("schedule,warmup", [("cosine", 3), ("linear", 3), ("constant", 2), ("cosine", 0)])
def test_schedule_matches_megatron(schedule, warmup, master_dtype, rtol):
    """fp32, or float64 (as Megatron's Python floats, to 1 ulp) for float64 master weights."""
    torch = require("torch")
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=warmup, decay_steps=10, schedule=schedule,
                      master_dtype=master_dtype)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = _megatron_scheduler(cfg, opt)
    ours = learning_rate(cfg)
    with precision.x64(master_dtype == "float64"):
        for update in range(14):   # Megatron: the lr in place at num_steps = updates already applied
            np.testing.assert_allclose(float(ours(update)), opt.param_groups[0]["lr"], rtol=rtol, atol=1e-20,
                                       err_msg=f"update {update}")
            sched.step(1)


def _params(rng):
    return {"layer": {"kernel": rng.normal(size=(4, 3)), "bias": rng.normal(size=(3,))},
            "norm": {"weight": rng.normal(size=(3,))},
            "kda": {"A_log": rng.normal(size=(2,)), "dt_bias": rng.normal(size=(6,)), "embedding": rng.normal(size=(5, 3))}}


def test_decay_mask():
    mask = decay_mask(jax.tree.map(jnp.asarray, _params(np.random.default_rng(0))))
    assert mask == {"layer": {"kernel": True, "bias": False}, "norm": {"weight": False},
                    "kda": {"A_log": False, "dt_bias": False, "embedding": True}}
    # the same rule on transformers' parameter names, where A_log is [1, 1, H, 1]
    assert not applies_weight_decay("model.layers.0.self_attn.forget_gate.A_log", 4)
    assert not applies_weight_decay("model.layers.3.mlp.gate.e_score_correction_bias", 1)
    assert applies_weight_decay("model.layers.0.self_attn.q_proj.weight", 2)


@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_adamw_clip_matches_torch(clip):
    torch = require("torch")
    rng = np.random.default_rng(1)
    params = _params(rng)
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape) * 3.0, params) for _ in range(6)]
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=6, weight_decay=0.1, b1=0.9, b2=0.95,
                      eps=1e-8, clip_grad_norm=clip)

    # ours
    tx = make_optimizer(cfg)
    p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    state = tx.init(p)
    for g in grads:
        updates, state = tx.update(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g), state, p)
        p = optax.apply_updates(p, updates)

    # torch: two param groups (decay / no decay), Megatron's scheduler sets lr, clip_grad_norm_ before step
    flat, treedef = jax.tree.flatten(params)
    mask = jax.tree.leaves(decay_mask(jax.tree.map(jnp.asarray, params)))
    tp = [torch.nn.Parameter(torch.tensor(x, dtype=torch.float64)) for x in flat]
    opt = torch.optim.AdamW([{"params": [t for t, m in zip(tp, mask) if m], "weight_decay": cfg.weight_decay},
                             {"params": [t for t, m in zip(tp, mask) if not m], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.b1, cfg.b2), eps=cfg.eps)
    sched = _megatron_scheduler(cfg, opt)   # the oracle's lr: Megatron's scheduler, never our own schedule
    for g in grads:
        for t, gx in zip(tp, jax.tree.leaves(g)):
            t.grad = torch.tensor(gx, dtype=torch.float64)
        if clip:
            torch.nn.utils.clip_grad_norm_(tp, clip)
        opt.step()
        sched.step(1)
        for group, wd in zip(opt.param_groups, (cfg.weight_decay, 0.0)):
            group["weight_decay"] = wd   # the scheduler writes its wd into every group; keep ours per group
    for ours, ref in zip(jax.tree.leaves(p), tp):
        np.testing.assert_allclose(np.asarray(ours), ref.detach().numpy(), rtol=2e-5, atol=2e-6)


def test_resolve_and_errors():
    assert resolve(OptimConfig(warmup_steps=5), 100).decay_steps == 100
    with pytest.raises(ValueError, match="schedule"):
        OptimConfig(schedule="wsd")
    with pytest.raises(ValueError, match="decay_steps"):
        learning_rate(OptimConfig())
    with pytest.raises(ValueError, match="master_dtype"):
        OptimConfig(master_dtype="fp8")
