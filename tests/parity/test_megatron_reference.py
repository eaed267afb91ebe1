"""The reference's step objective (megatron-core's z_loss_func per rank and roll_tensor for MTP, Megatron's
reductions) vs train/loss.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from lingpack.parity.megatron_reference import megatron_objective
from lingpack.train import loss as loss_lib
from lingpack.train.configs import LossConfig
from tests.optional import require

torch = require("torch")

B, T, V, L, E, M = 4, 5, 7, 2, 4, 2


@pytest.mark.parametrize("mode, per_token_loss, ranks, padding", [
    ("megatron", False, 1, True), ("megatron", True, 1, True), ("per_token", False, 1, True),
    ("megatron", False, 2, False), ("megatron", True, 2, True)])
def test_reference_objective_matches_train_loss(mode, per_token_loss, ranks, padding):
    """Same logits, MTP logits (one depth), router logits and masks on both sides; only the reduction code differs.

    (Two ranks with padding in the default mode is left out: train/loss.py takes the router z-loss mean over
    the whole micro-batch there, an approximation its docstring states.)"""
    from megatron.core.transformer.moe.moe_utils import z_loss_func
    from megatron.core.transformer.multi_token_prediction import roll_tensor
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    mtp_logits = rng.normal(size=(B, T, V)).astype(np.float32) * 2
    router = rng.normal(size=(L, B, T, E)).astype(np.float32) * 2
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    real = np.ones((B, T), np.int32)
    if padding:
        real[1, 3:] = 0
        real[3, 1:] = 0
    loss_mask = real * (rng.random((B, T)) > 0.3)
    weight = 0.3  # large, so that a wrongly scaled z-loss term shows
    cfg = LossConfig(mode=mode, calculate_per_token_loss=per_token_loss, megatron_dp_size=ranks, mtp_loss_scale=0.5)

    batch = {"targets": targets, "targets_segmentation": loss_mask, "inputs_segmentation": real}
    totals = loss_lib.totals({k: jnp.asarray(v) for k, v in batch.items()}, 1)
    ours = 0.0
    for m in range(M):
        rows = slice(m * B // M, (m + 1) * B // M)
        lse2 = np.log(np.exp(router[:, rows]).sum(-1)) ** 2
        aux = {"router_z_loss": jnp.asarray((lse2 * real[rows]).sum((1, 2))),
               "num_tokens": jnp.asarray(np.full(L, real[rows].sum(), np.float32)), "load_counts": jnp.zeros((L, E))}
        mb = {k: jnp.asarray(v[rows]) for k, v in batch.items()}
        ours += float(loss_lib.micro_batch_loss(jnp.asarray(logits[rows]), [jnp.asarray(mtp_logits[rows])], aux, mb,
                                                cfg, totals, num_micro_batches=M, moe_z_loss_weight=weight)[0])

    groups, per_group = [], B // (M * ranks)
    for u in range(M * ranks):  # Megatron's order: micro-batch, then rank
        rows = slice(u * per_group, (u + 1) * per_group)
        xent = torch.nn.functional.cross_entropy(torch.from_numpy(logits[rows]).reshape(-1, V),
                                                 torch.from_numpy(targets[rows]).reshape(-1).long(), reduction="none")
        mask = torch.from_numpy(loss_mask[rows]).reshape(-1).float()
        pad = torch.from_numpy(real[rows]).reshape(-1) == 0
        z = [z_loss_func(torch.from_numpy(router[l, rows]).reshape(-1, E), weight, padding_mask=pad) for l in range(L)]
        # one document per row, padding after it: rolling each row (last position zeroed) is Megatron's MTP roll
        mtp_labels, _ = roll_tensor(torch.from_numpy(targets[rows]).long(), shifts=-1, dims=-1)
        mtp_mask, mtp_count = roll_tensor(torch.from_numpy(loss_mask[rows]).float(), shifts=-1, dims=-1)
        mtp_xent = torch.nn.functional.cross_entropy(torch.from_numpy(mtp_logits[rows]).reshape(-1, V),
                                                     mtp_labels.reshape(-1), reduction="none")
        mtp = [(torch.sum(mtp_xent * mtp_mask.reshape(-1)), mtp_count)]
        groups.append((torch.sum(xent * mask), torch.sum(mask), int((~pad).sum()), z, mtp))
    theirs = float(megatron_objective(groups, cfg, M * ranks))
    np.testing.assert_allclose(ours, theirs, rtol=2e-6)
