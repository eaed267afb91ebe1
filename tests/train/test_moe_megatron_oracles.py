"""The expert-bias update and the router z-loss against megatron-core's own functions (CPU torch).

`get_updated_expert_bias` all-reduces the load counts over its data-parallel group first: here the world
has one rank, so that all-reduce is the identity and is replaced by one (the only glue). Ling3 then
re-centres the bias to mean 0 (a constant shift: it changes no top-k choice), which Megatron does not.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lingpack.models.moe import MoE, MoEConfig, update_expert_bias
from lingpack.train import loss as L
from lingpack.train.configs import LossConfig
from tests.optional import require

torch = require("torch")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    moe_utils = require("megatron.core.transformer.moe.moe_utils")

CFG = MoEConfig(num_experts=8, top_k=2, expert_dim=8, num_shared_experts=0, n_groups=1, topk_groups=1)
D, COEF = 16, 0.05   # large enough that the z-term is not lost in the fp32 objective it is read from


def _moe(seed=0):
    moe = MoE(CFG, D, rngs=nnx.Rngs(seed))
    moe.router[...] = jax.random.normal(jax.random.key(seed), moe.router.shape)   # O(1) router logits
    moe.expert_bias[...] = 0.01 * jax.random.normal(jax.random.key(seed + 1), (CFG.num_experts,))
    return moe


def test_expert_bias_update_matches_megatron(monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None, **kw: None)   # one rank
    monkeypatch.setattr(moe_utils.parallel_state, "get_tensor_and_data_parallel_group", lambda **kw: None)
    moe = _moe()
    rate = 1e-3
    for seed in range(3):   # several updates, balanced experts (offset 0) included
        load = np.random.default_rng(seed).integers(0, 12, CFG.num_experts).astype(np.float32)
        load[:2] = load.mean() if seed == 2 else load[:2]
        before = np.asarray(moe.expert_bias[...])
        expected = moe_utils.get_updated_expert_bias(torch.tensor(load), torch.tensor(before), rate).numpy()
        update_expert_bias(moe, jnp.asarray(load), rate)
        np.testing.assert_allclose(np.asarray(moe.expert_bias[...]), expected - expected.mean(), atol=1e-9)
        assert np.abs(expected - before).max() == pytest.approx(rate)   # Megatron moved it: the check has teeth


def _z_term(moe, x_MBTD, seg_MBTD, cfg):
    """The router z-loss share of lingpack's step objective, over M micro-batches (LM and MTP terms off)."""
    M, B, T, _ = x_MBTD.shape
    batch = {"targets": jnp.zeros((M * B, T), jnp.int32), "targets_segmentation": jnp.asarray(seg_MBTD.reshape(M * B, T)),
             "inputs_segmentation": jnp.asarray(seg_MBTD.reshape(M * B, T))}
    totals = L.totals(batch, 0)
    total = 0.0
    for m in range(M):
        _, aux = moe(jnp.asarray(x_MBTD[m]), jnp.asarray(seg_MBTD[m]))
        aux = {k: v[None] for k, v in aux.items()}   # one MoE layer
        mb = {k: v[m * B:(m + 1) * B] for k, v in batch.items()}
        logits = jnp.zeros((B, T, 2), jnp.float32)
        with_z, _ = L.micro_batch_loss(logits, [], aux, mb, cfg, totals, num_micro_batches=M, moe_z_loss_weight=COEF)
        without, _ = L.micro_batch_loss(logits, [], None, mb, cfg, totals, num_micro_batches=M)
        total += float(with_z - without)
    return total


@pytest.mark.parametrize("mode,per_token_loss", [("megatron", False), ("megatron", True), ("per_token", False)])
def test_router_z_loss_matches_megatron_in_every_loss_mode(mode, per_token_loss):
    """Megatron's router (router.py apply_z_loss): z = z_loss_func(logits, coeff, padding_mask), a mean over a
    micro-batch's real tokens. calculate_per_token_loss=False: its autoscaler weights each micro-batch by 1/M;
    True: it adds z * num_tokens and the whole objective is later divided by the step's loss-token count.
    lingpack's per_token mode is the global token mean: z_loss_func over the whole step's real tokens."""
    moe = _moe(1)
    rng = np.random.default_rng(3)
    M, B, T = 2, 2, 12
    x = rng.standard_normal((M, B, T, D)).astype(np.float32)
    seg = np.ones((M, B, T), np.int32)
    seg[0, 1, 7:] = 0   # padding, excluded from the z-loss
    seg[1, 0, 3:] = 2
    cfg = LossConfig(mode=mode, calculate_per_token_loss=per_token_loss)
    ours = _z_term(moe, x, seg, cfg)

    logits = [torch.tensor(np.asarray(x[m].reshape(-1, D) @ np.asarray(moe.router[...]))) for m in range(M)]
    padding = [torch.tensor(seg[m].reshape(-1) == 0) for m in range(M)]
    if mode == "per_token":
        expected = float(moe_utils.z_loss_func(torch.cat(logits), COEF, torch.cat(padding)))
    elif per_token_loss:
        loss_tokens = (seg != 0).sum()
        expected = sum(float(moe_utils.z_loss_func(lg, COEF, pad)) * int((~pad).sum())
                       for lg, pad in zip(logits, padding)) / loss_tokens
    else:
        expected = sum(float(moe_utils.z_loss_func(lg, COEF, pad)) for lg, pad in zip(logits, padding)) / M
    np.testing.assert_allclose(ours, expected, rtol=1e-5)
    assert expected > COEF   # O(1) router logits: lse^2 > 1, the term is not trivially small
