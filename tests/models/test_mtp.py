"""MTP rolls and targets: boundaries, padding, row ends; the MTP loss under packing equals per-document."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lingpack.models.mtp import mtp_loss_terms, mtp_targets, roll_and_mask_by_segment
from packing_cases import packed_batch, per_document_batch


def test_roll_semantics_at_boundaries_padding_and_row_end():
    x = jnp.array([[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26]])
    seg = jnp.array([[1, 1, 2, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(roll_and_mask_by_segment(x, seg),
                                  [[11, 0, 0, 14, 0, 0, 0],       # 1->2, 2->3 boundaries, 3->pad, pad, pad
                                   [21, 22, 23, 24, 25, 26, 0]])  # the row end never wraps around
    emb = jnp.arange(2 * 7 * 3, dtype=jnp.float32).reshape(2, 7, 3)
    rolled = roll_and_mask_by_segment(emb, seg)
    np.testing.assert_array_equal(rolled[0, 0], emb[0, 1])
    assert np.all(np.asarray(rolled[0, 1]) == 0)  # masked embeddings are zero vectors


def test_targets_per_depth():
    targets = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    tseg = jnp.array([[1, 1, 0, 1, 2, 2, 2, 0]])   # position 2's own prediction is masked (e.g. an EOD input)
    t0, m0 = mtp_targets(targets, tseg, 0, seg)
    np.testing.assert_array_equal(t0, [[2, 3, 4, 0, 6, 7, 0, 0]])
    np.testing.assert_array_equal(m0, [[1, 0, 1, 0, 1, 1, 0, 0]])
    t1, m1 = mtp_targets(targets, tseg, 1, seg)
    np.testing.assert_array_equal(t1, [[3, 4, 0, 0, 7, 0, 0, 0]])
    np.testing.assert_array_equal(m1, [[0, 1, 0, 0, 1, 0, 0, 0]])
    with pytest.raises(ValueError, match="0-indexed"):
        mtp_targets(targets, tseg, -1)


def test_mtp_loss_under_packing_equals_per_document():
    """With per-token logits that depend only on a document's own tokens, the packed MTP (sum, count) per
    depth equals the sum over documents run alone."""
    vocab, T = 11, 40
    packed = packed_batch([[7, 1, 12, 20], [40], [2, 3]], T, vocab, seed=4)
    single, docs = per_document_batch(packed)
    table = jax.random.normal(jax.random.key(0), (vocab, 3, vocab))

    def fake_logits(batch, d):  # a function of (token, position) only: identical for a document packed or alone
        return table[batch["inputs"], d]

    for depth in (1, 2):
        terms = {}
        for name, batch in (("packed", packed), ("single", single)):
            b = {k: jnp.asarray(v) for k, v in batch.items()}
            logits = [fake_logits(b, d) for d in range(depth)]
            terms[name] = mtp_loss_terms(logits, b["targets"], b["targets_segmentation"], b["inputs_segmentation"])
        for (s_p, n_p), (s_s, n_s) in zip(terms["packed"], terms["single"]):
            assert float(n_p) == float(n_s) > 0
            np.testing.assert_allclose(float(s_p), float(s_s), rtol=1e-5)
