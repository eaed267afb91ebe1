"""Long-context collator: rows divide over 2 x context x chunk, documents stay whole, truncation is counted."""
import logging

import numpy as np
import pytest

from lingpack.data.long_context import LongContextCollator
from lingpack.parallel.reorder import check_length

EOD, PAD = 9, 10


def doc(n, fill=1):
    return np.concatenate([np.full(n - 1, fill), [EOD]])


def test_rows_divide_and_documents_stay_whole(caplog):
    collator = LongContextCollator(seq_length=200, context=4, chunk_size=16, eod_id=EOD, pad_id=PAD)
    assert collator.row_length == 256                      # 200 rounded up to 2 x 4 x 16 = 128
    docs = [doc(100, 1), doc(120, 2), doc(50, 3), doc(257, 4), doc(3, 5)]
    with caplog.at_level(logging.WARNING):
        batch, stats = collator(docs)
    assert not caplog.records
    check_length(batch["inputs"].shape[1], 4, True, 16)   # the zigzag layout's contract holds
    # windows of 257 tokens, first fit: [257] exactly (closes at once) | [100, 120, 3] + 34 pad | [50] + 207
    assert stats == dict(documents=5, cut_documents=0, cut_pieces=0, rows=3, tokens=530, padding_tokens=241)
    seg = batch["inputs_segmentation"]
    tokens = [batch["inputs"][r][seg[r] == s] for r in range(len(seg)) for s in np.unique(seg[r][seg[r] > 0])]
    lengths = [t.size for t in tokens]
    # each document appears whole as one segment (its last token is only a target when it ends the window)
    assert lengths == [256, 100, 120, 3, 50]
    for t, d in zip(tokens, [docs[i] for i in (3, 0, 1, 4, 2)]):
        np.testing.assert_array_equal(t, d[:t.size])
    assert (batch["inputs_position"][1, 100:103] == [0, 1, 2]).all()      # positions restart per document
    assert batch["targets_segmentation"][seg == 0].sum() == 0              # padding trains nothing


def test_long_documents_are_cut_counted_and_logged(caplog):
    collator = LongContextCollator(seq_length=64, context=2, chunk_size=16, eod_id=EOD, pad_id=PAD)
    long = np.concatenate([np.arange(99) + 20, [EOD]])
    with caplog.at_level(logging.WARNING, logger="lingpack.data"):
        batch, stats = collator([doc(10), long, doc(5)])
    assert stats["cut_documents"] == 1 and stats["cut_pieces"] == 2
    assert "cut into 2 row-length pieces" in caplog.text and batch["inputs"].shape == (2, 64)
    # the first piece is a full window (tokens 0..64), the tail starts at its last token: nothing dropped
    np.testing.assert_array_equal(batch["inputs"][0], long[:64])
    assert batch["targets"][0, -1] == long[64]
    seg = batch["inputs_segmentation"][1]
    np.testing.assert_array_equal(batch["inputs"][1][seg == 2], long[64:])


def test_bad_documents_and_pad_name_the_fix():
    collator = LongContextCollator(seq_length=64, context=2, chunk_size=16, eod_id=EOD, pad_id=PAD)
    with pytest.raises(ValueError, match="append-eod"):
        collator([np.array([1, 2, 3])])
    with pytest.raises(ValueError, match="pad_id"):
        LongContextCollator(seq_length=64, context=2, chunk_size=16, eod_id=EOD, pad_id=EOD)
