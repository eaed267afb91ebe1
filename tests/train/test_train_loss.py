"""Loss modes: hand-computed values, and a PyTorch transcription of Megatron's loss_func + schedule reduction."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lingpack.models.mtp import mtp_loss_terms
from lingpack.train import loss as L
from lingpack.train.configs import LossConfig
from tests.optional import require


def _batch(targets, mask, seg=None):
    targets = jnp.asarray(targets, jnp.int32)
    mask = jnp.asarray(mask, jnp.int32)
    seg = jnp.ones_like(targets) if seg is None else jnp.asarray(seg, jnp.int32)
    return {"targets": targets, "targets_segmentation": mask * seg, "inputs_segmentation": seg,
            "inputs": targets, "inputs_position": jnp.zeros_like(targets)}


def _logits_with_xent(xent):
    """[..., 2] logits whose cross-entropy against target 0 is exactly `xent` (xent = log(1 + e^a))."""
    xent = np.asarray(xent, np.float64)
    a = np.log(np.expm1(xent))
    return jnp.asarray(np.stack([np.zeros_like(a), a], axis=-1), jnp.float32)


def _objective(logits_BTV, batch, cfg, M, mtp_logits=(), moe_aux=None, moe_w=0.0):
    B = logits_BTV.shape[0]
    totals = L.totals(batch, len(mtp_logits))
    total, stats_sum = 0.0, None
    for m in range(M):
        sl = slice(m * B // M, (m + 1) * B // M)
        mb = {k: v[sl] for k, v in batch.items()}
        aux = None if moe_aux is None else {k: v[m] for k, v in moe_aux.items()}
        obj, stats = L.micro_batch_loss(logits_BTV[sl], [x[sl] for x in mtp_logits], aux, mb, cfg, totals,
                                        num_micro_batches=M, moe_z_loss_weight=moe_w)
        total = total + obj
        stats_sum = stats if stats_sum is None else jax.tree.map(jnp.add, stats_sum, stats)
    return total, L.metrics(stats_sum, cfg, num_micro_batches=M)


def test_hand_computed_modes():
    # micro-batch 0: losses 1, 3 (both trained); micro-batch 1: loss 5 trained, 7 masked.
    logits = _logits_with_xent([[1.0, 3.0], [5.0, 7.0]])
    batch = _batch(np.zeros((2, 2)), [[1, 1], [1, 0]])
    obj, m = _objective(logits, batch, LossConfig(mode="megatron"), M=2)
    np.testing.assert_allclose(obj, (2.0 + 5.0) / 2, rtol=1e-6)          # mean of micro-batch means
    np.testing.assert_allclose(m["lm_loss"], 3.0, rtol=1e-6)             # token-weighted report
    obj, m = _objective(logits, batch, LossConfig(mode="megatron", calculate_per_token_loss=True), M=2)
    np.testing.assert_allclose(obj, 3.0, rtol=1e-6)
    obj, m = _objective(logits, batch, LossConfig(mode="per_token"), M=2)
    np.testing.assert_allclose(obj, 3.0, rtol=1e-6)
    np.testing.assert_allclose(m["lm_loss"], 3.0, rtol=1e-6)
    assert float(m["loss_tokens"]) == 3.0
    # two "ranks" per micro-batch (megatron_dp_size=2): rows are the groups -> (1 + 3 + 5 + [empty: 0]) / 4
    obj, _ = _objective(logits, _batch(np.zeros((2, 2)), [[1, 1], [1, 0]]), LossConfig(megatron_dp_size=2), M=1)
    np.testing.assert_allclose(obj, (2.0 + 5.0) / 2, rtol=1e-6)
    obj, _ = _objective(_logits_with_xent([[1.0, 3.0], [5.0, 7.0]]), _batch(np.zeros((2, 2)), [[1, 1], [0, 0]]),
                        LossConfig(megatron_dp_size=2), M=1)
    np.testing.assert_allclose(obj, (2.0 + 0.0) / 2, rtol=1e-6)           # an all-masked rank adds 0 (clamp)


def test_z_loss_joins_objective_not_report():
    logits = _logits_with_xent([[1.0, 3.0]])
    batch = _batch(np.zeros((1, 2)), [[1, 1]])
    lse = np.log1p(np.expm1([1.0, 3.0]))  # logsumexp([0, a]) = log(1 + e^a) = xent here
    obj, m = _objective(logits, batch, LossConfig(z_loss_weight=0.1), M=1)
    np.testing.assert_allclose(obj, np.mean([1.0, 3.0] + 0.1 * lse ** 2), rtol=1e-6)
    np.testing.assert_allclose(m["lm_loss"], 2.0, rtol=1e-6)


def _random_case(seed, M=3, G=2, rows=2, T=6, V=11, D=5):
    rng = np.random.default_rng(seed)
    B = M * G * rows
    x = rng.normal(size=(B, T, D))
    theta = rng.normal(size=(D, V)) * 0.5
    targets = rng.integers(0, V, size=(B, T))
    mask = (rng.random((B, T)) < 0.6).astype(np.int32)
    mask[G * rows: G * rows + rows] = 0      # micro-batch 1, rank 0 has no loss token at all
    return x, theta, targets, mask


def _megatron_torch(x, theta, targets, mask, M, G, cptl):
    """pretrain_gpt.loss_func + schedules.forward_step_calc_loss + DDP / finalize_model_grads, per rank."""
    torch = require("torch")
    B, T, _ = x.shape
    rows = B // (M * G)
    theta = torch.tensor(theta, dtype=torch.float64)

    def loss_func(loss_mask, output_tensor):  # pretrain_gpt.py
        losses = output_tensor.view(-1).float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * loss_mask)
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
        return loss, num_tokens, {"lm loss": reporting_loss}

    rank_grads, reports, total_tokens, objective = [], [], 0, 0.0
    for rank in range(G):
        param = theta.clone().requires_grad_(True)
        for m in range(M):                      # Megatron sampler: global batch ordered [micro-batch, rank, row]
            rows_ = slice((m * G + rank) * rows, (m * G + rank + 1) * rows)
            logits = torch.tensor(x[rows_]) @ param
            per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                          torch.tensor(targets[rows_]).reshape(-1), reduction="none")
            output_tensor, num_tokens, loss_reduced = loss_func(torch.tensor(mask[rows_]), per_token)
            if not cptl:
                output_tensor = output_tensor / torch.clamp(num_tokens, min=1)
                output_tensor = output_tensor / M
            output_tensor.backward()
            objective += float(output_tensor.detach()) / (1 if cptl else G)
            total_tokens += int(num_tokens)
            reports.append(loss_reduced["lm loss"])
        rank_grads.append(param.grad.double())
    if cptl:   # DDP sums over ranks (scaling 1), finalize_model_grads divides by the all-reduced token count
        grad = sum(rank_grads) / total_tokens if total_tokens > 0 else sum(rank_grads)
        objective = objective / total_tokens
    else:      # DDP averages over data-parallel ranks
        grad = sum(g / G for g in rank_grads)
    reported = torch.stack(reports).sum(0)     # training.py: numerator / denominator over micro-batches and ranks
    return objective, grad.numpy(), float(reported[0] / reported[1])


@pytest.mark.parametrize("cptl", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_megatron_torch_transcription(cptl, seed):
    M, G = 3, 2
    x, theta, targets, mask = _random_case(seed, M=M, G=G)
    batch = _batch(targets, mask)
    cfg = LossConfig(mode="megatron", calculate_per_token_loss=cptl, megatron_dp_size=G)

    def f(theta_):
        logits = jnp.asarray(x, jnp.float32) @ theta_
        obj, metrics = _objective(logits, batch, cfg, M=M)
        return obj, metrics
    (obj, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(theta, jnp.float32))
    ref_obj, ref_grad, ref_lm = _megatron_torch(x, theta, targets, mask, M, G, cptl)
    np.testing.assert_allclose(obj, ref_obj, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["lm_loss"], ref_lm, rtol=1e-5)


def test_megatron_modes_differ_when_counts_differ():
    """The oracle test above could pass trivially if both modes were equal; they are not here."""
    x, theta, targets, mask = _random_case(0)
    a = _megatron_torch(x, theta, targets, mask, 3, 2, False)
    b = _megatron_torch(x, theta, targets, mask, 3, 2, True)
    assert abs(a[0] - b[0]) > 1e-3 and abs(a[2] - b[2]) < 1e-12


def test_mtp_term_matches_model_helper_and_megatron_scaling():
    rng = np.random.default_rng(3)
    B, T, V = 4, 8, 7
    seg = np.array([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 3, 3, 3, 3, 0],
                    [1, 1, 1, 1, 2, 2, 2, 2]])
    targets = rng.integers(0, V, size=(B, T))
    mask = (seg != 0).astype(np.int32)
    batch = _batch(targets, mask, seg)
    logits = jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32)
    mtp = [jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32) for _ in range(2)]
    terms = [(float(s), float(c)) for s, c in mtp_loss_terms(mtp, batch["targets"], batch["targets_segmentation"],
                                                             batch["inputs_segmentation"])]
    xent = np.asarray(L.token_xent(logits, batch["targets"])[0])
    lm_sum, n = float(np.sum(xent * mask)), float(mask.sum())
    scale = 0.1

    obj, m = _objective(logits, batch, LossConfig(mode="per_token", mtp_loss_scale=scale), M=1, mtp_logits=mtp)
    np.testing.assert_allclose(obj, lm_sum / n + scale * np.mean([s / c for s, c in terms]), rtol=1e-5)
    np.testing.assert_allclose(m["mtp_loss"], np.mean([s / c for s, c in terms]), rtol=1e-5)
    obj, _ = _objective(logits, batch, LossConfig(mode="megatron", calculate_per_token_loss=True), M=1, mtp_logits=mtp)
    np.testing.assert_allclose(obj, (lm_sum + scale / 2 * sum(s for s, _ in terms)) / n, rtol=1e-5)
    obj, _ = _objective(logits, batch, LossConfig(mode="megatron"), M=1, mtp_logits=mtp)
    np.testing.assert_allclose(obj, lm_sum / n + scale / 2 * sum(s / c for s, c in terms), rtol=1e-5)


def test_moe_router_z_loss_reduction():
    logits = _logits_with_xent([[1.0, 1.0], [1.0, 1.0]])
    batch = _batch(np.zeros((2, 2)), [[1, 1], [1, 1]])
    # two micro-batches, one MoE layer each: z sums 8 over 2 tokens, 30 over 3 tokens
    aux = {"router_z_loss": jnp.array([[8.0], [30.0]]), "num_tokens": jnp.array([[2.0], [3.0]]),
           "load_counts": jnp.zeros((2, 1, 4))}
    w = 0.5
    obj, m = _objective(logits, batch, LossConfig(mode="megatron"), M=2, moe_aux=aux, moe_w=w)
    np.testing.assert_allclose(obj, 1.0 + w * (8 / 2 + 30 / 3) / 2, rtol=1e-6)
    obj, _ = _objective(logits, batch, LossConfig(mode="per_token"), M=2, moe_aux=aux, moe_w=w)
    np.testing.assert_allclose(obj, 1.0 + w * 38 / 4, rtol=1e-6)    # real tokens = inputs_segmentation != 0
    np.testing.assert_allclose(m["moe_z_loss"], 38 / 5, rtol=1e-6)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="mode"):
        LossConfig(mode="mean")
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        LossConfig(mode="per_token", calculate_per_token_loss=True)
    with pytest.raises(ValueError, match="megatron_dp_size"):
        L.group_sums(jnp.ones((3, 2)), 2)


def test_all_masked_step_is_finite():
    obj, m = _objective(_logits_with_xent([[1.0, 2.0]]), _batch(np.zeros((1, 2)), [[0, 0]]),
                        LossConfig(mode="per_token"), M=1)
    assert math.isfinite(float(obj)) and float(m["lm_loss"]) == 0.0
