"""MTP rolls, masks and loss scaling against megatron-core's own multi-token-prediction code (CPU torch).

Megatron flattens a packed micro-batch to THD `[1, B*T]` with `cu_seqlens`; `roll_tensor(...,
packed_seq_params)` rolls each sequence left and zeroes its last position, and `GPTModel` rolls the
labels and the loss mask once per MTP depth, divides each depth's masked sum by the rolled mask's sum
(the `num_tokens` roll_tensor returns) and scales by `mtp_loss_scaling_factor / mtp_num_layers`.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lingpack.models.mtp import mtp_targets, roll_and_mask_by_segment
from lingpack.train import loss as L
from lingpack.train.configs import LossConfig
from packing_cases import packed_batch
from tests.optional import require

torch = require("torch")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mtp_module = require("megatron.core.transformer.multi_token_prediction")
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

ROWS, T, VOCAB, DEPTHS = [[5, 1, 20, 16], [48], [1, 30], []], 48, 50, 2


def thd_params(seg_BT):
    """Megatron's packed-sequence parameters for the flattened batch: one sequence per document, one per
    padding run (every row boundary ends a sequence, as every row boundary ends a document)."""
    flat = seg_BT.reshape(-1)
    row_start = (np.arange(flat.size) % seg_BT.shape[1]) == 0
    starts = np.nonzero(row_start | np.r_[True, flat[1:] != flat[:-1]])[0]
    cu = torch.tensor(np.r_[starts, flat.size], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)


def megatron_roll(x_BT, params):
    rolled, total = mtp_module.roll_tensor(torch.tensor(np.asarray(x_BT).reshape(1, -1)), shifts=-1, dims=-1,
                                           packed_seq_params=params)
    return rolled.numpy().reshape(np.shape(x_BT)), float(total)


@pytest.fixture(scope="module")
def batch():
    return packed_batch(ROWS, T, vocab=VOCAB)


def test_rolls_and_masks_match_megatron(batch):
    seg = batch["inputs_segmentation"]
    real = seg != 0
    params = thd_params(seg)
    labels, mask = batch["targets"], (batch["targets_segmentation"] != 0).astype(np.int32)
    ids = batch["inputs"]
    ours_ids, ours_labels = jnp.asarray(ids), jnp.asarray(labels)
    for depth in range(DEPTHS):   # Megatron rolls cumulatively, once per MTP layer
        ids, _ = megatron_roll(ids, params)
        labels, _ = megatron_roll(labels, params)
        mask, num_tokens = megatron_roll(mask, params)
        ours_ids, ours_labels = roll_and_mask_by_segment(ours_ids, seg), roll_and_mask_by_segment(ours_labels, seg)
        tgt, our_mask = mtp_targets(batch["targets"], batch["targets_segmentation"], depth, segment_ids_BT=seg)
        np.testing.assert_array_equal(np.asarray(ours_ids)[real], ids[real], err_msg=f"depth {depth}")
        np.testing.assert_array_equal(np.asarray(tgt)[real], labels[real], err_msg=f"depth {depth}")
        np.testing.assert_array_equal(np.asarray(our_mask)[real], mask[real], err_msg=f"depth {depth}")
        assert float(np.asarray(our_mask).sum()) == num_tokens      # padding sequences roll zeros: same count
        assert not np.asarray(our_mask)[~real].any() and not np.asarray(ours_ids)[~real].any()
        assert 0 < num_tokens < real.sum()


def test_rolled_embeddings_match_megatrons_embedded_rolled_ids(batch):
    """Megatron embeds the rolled ids; lingpack rolls the embeddings. They agree wherever the rolled loss mask
    can be 1; at a document's last position Megatron embeds id 0 and lingpack puts a zero vector, and
    Megatron's rolled mask is 0 there, so neither reaches the loss."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCAB, 8)).astype(np.float32)
    seg = batch["inputs_segmentation"]
    params = thd_params(seg)
    ids, _ = megatron_roll(batch["inputs"], params)
    ours = np.asarray(roll_and_mask_by_segment(jnp.asarray(table[batch["inputs"]]), seg))
    last = (seg != 0) & (np.asarray(roll_and_mask_by_segment(jnp.ones_like(seg), seg)) == 0)
    np.testing.assert_array_equal(ours[(seg != 0) & ~last], table[ids][(seg != 0) & ~last])
    assert not ours[last].any()
    ones_mask, _ = megatron_roll(np.ones_like(seg), params)
    assert not ones_mask[last].any()


def _xent_torch(logits_BTV, labels_BT):
    return torch.nn.functional.cross_entropy(torch.tensor(np.asarray(logits_BTV)).reshape(-1, VOCAB),
                                             torch.tensor(labels_BT).long().reshape(-1), reduction="none"
                                             ).reshape(labels_BT.shape)


@pytest.mark.parametrize("per_token", [False, True])
def test_mtp_loss_scaling_matches_megatron(batch, per_token):
    """The MTP share of the objective: Megatron's per-depth sum / num_tokens (calculate_per_token_loss=False), or
    the raw sums later divided by the LM token count (True), times mtp_loss_scaling_factor / mtp_num_layers."""
    scale = TransformerConfig.__dataclass_fields__["mtp_loss_scaling_factor"].default   # Megatron's default, 0.1
    cfg = LossConfig(mode="megatron", calculate_per_token_loss=per_token, mtp_loss_scale=scale)
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((len(ROWS), T, VOCAB)), jnp.float32)
    mtp_logits = [jnp.asarray(rng.standard_normal((len(ROWS), T, VOCAB)) * 2, jnp.float32) for _ in range(DEPTHS)]
    totals = L.totals(jbatch, DEPTHS)
    with_mtp, _ = L.micro_batch_loss(logits, mtp_logits, None, jbatch, cfg, totals, num_micro_batches=1)
    without, _ = L.micro_batch_loss(logits, [], None, jbatch, cfg, L.totals(jbatch, 0), num_micro_batches=1)

    params = thd_params(batch["inputs_segmentation"])
    labels, mask = batch["targets"], (batch["targets_segmentation"] != 0).astype(np.float32)
    lm_tokens = mask.sum()
    expected = 0.0
    for depth in range(DEPTHS):
        labels, _ = megatron_roll(labels, params)
        mask, num_tokens = megatron_roll(mask, params)
        mtp_loss = float((torch.tensor(mask) * _xent_torch(mtp_logits[depth], labels)).sum())
        expected += scale / DEPTHS * (mtp_loss / lm_tokens if per_token else mtp_loss / num_tokens)
    np.testing.assert_allclose(float(with_mtp - without), expected, rtol=1e-5)
    assert expected > 0.01
