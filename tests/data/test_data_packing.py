"""data.packing=whole_documents: every document token trained once, documents whole unless longer than a row,
Megatron's document order, exact resume, one-line config errors, CP-rounded rows."""

from __future__ import annotations

import collections
import json
import logging

import numpy as np
import pytest

from lingpack import config as config_lib
from lingpack.data import indices as ix
from lingpack.data.config import DataConfig
from lingpack.data.indexed import write_indexed_dataset
from lingpack.data.packing import PackedRows, pack_documents
from lingpack.data.pipeline import make_dataset, make_iterator
from lingpack.data.sampling import build_samples
from lingpack.data.split import BATCH_KEYS, SplitOptions, split_window
from lingpack.errors import ConfigError
from lingpack.parallel.reorder import check_length

EOD, PAD, T = 0, 1, 32
CAPACITY = T + 1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of unique tokens (each token id says its document and position), some longer than a row."""
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(np.log(14.0), 1.0, 120).astype(int), 1, 5 * CAPACITY)
    lengths[[5, 17]] = [CAPACITY, 3 * CAPACITY + 7]       # exactly one row; a cut into four pieces
    documents, next_id = [], 2
    for n in lengths:
        documents.append(np.append(np.arange(next_id, next_id + n - 1), EOD))
        next_id += n - 1
    prefix = str(tmp_path_factory.mktemp("packing") / "unique")
    write_indexed_dataset(prefix, documents, np.int32)
    return prefix, documents, next_id


def _config(prefix, vocab, **overrides) -> DataConfig:
    base = dict(paths=(prefix,), seq_length=T, global_batch_size=4, eod_id=EOD, pad_id=PAD, vocab_size=vocab,
                split="1,0,0", eod_mask_loss=False, packing="whole_documents", packing_open_rows=4, num_epochs=1)
    return DataConfig(**{**base, **overrides})


def check_rows(windows: np.ndarray, documents: list[np.ndarray]) -> collections.Counter:
    """Asserts what training on `windows` ([R, T + 1]) must see of `documents` (unique non-EOD tokens): every
    within-document prediction (token i-1 -> token i) made exactly once, a document of at most T + 1 tokens
    whole in one row (one segment, positions 0..n-1), padding only at a row's end and never trained.
    Returns how many rows each document touches."""
    batch = split_window(windows, SplitOptions(eod_id=EOD, pad_id=PAD, eod_mask_loss=False))
    owner = {int(t): (d, i) for d, doc in enumerate(documents) for i, t in enumerate(doc[:-1])}
    pads = windows == PAD
    assert (np.diff(pads.astype(int), axis=1) >= 0).all(), "padding inside a row"
    assert not (batch["targets_segmentation"][pads[:, 1:]]).any(), "a pad target is trained"
    predictions, rows_of = collections.Counter(), collections.Counter()
    for r in range(windows.shape[0]):
        seg, pos = batch["inputs_segmentation"][r], batch["inputs_position"][r]
        for s in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == s)
            tokens = windows[r, where]
            if tokens.size == 1 and tokens[0] == EOD:     # an empty document: just its EOD
                continue
            first = owner.get(int(tokens[0]))
            assert first is not None, f"row {r} segment {s} starts with an EOD"
            d = first[0]
            rows_of[d] += 1
            expected = documents[d][first[1]:first[1] + tokens.size]
            np.testing.assert_array_equal(tokens, expected, err_msg=f"row {r}: not a slice of document {d}")
            np.testing.assert_array_equal(pos[where], np.arange(tokens.size))   # positions restart per piece
            end = where[-1] + 1            # the segment's last input predicts the next window token
            for i, t in zip(range(first[1] + 1, first[1] + 1 + tokens.size), windows[r, where[0] + 1:end + 1]):
                if i < documents[d].size and t == documents[d][i]:
                    predictions[(d, i)] += 1
    for d, doc in enumerate(documents):
        for i in range(1, doc.size):
            assert predictions[(d, i)] == 1, f"document {d} token {i} predicted {predictions[(d, i)]} times"
        if 1 < doc.size <= CAPACITY:
            assert rows_of[d] == 1, f"document {d} ({doc.size} tokens, fits a row) split over {rows_of[d]} rows"
    return rows_of


def test_rows_hold_every_document_token_once(corpus, caplog):
    prefix, documents, vocab = corpus
    with caplog.at_level(logging.INFO, logger="lingpack.data"):
        samples = build_samples(_config(prefix, vocab))
    windows = np.stack([samples[i] for i in range(len(samples))])
    assert windows.shape[1] == CAPACITY
    rows_of = check_rows(windows, documents)
    long = [d for d, doc in enumerate(documents) if doc.size > CAPACITY]
    assert rows_of[17] == 4 and all(rows_of[d] >= 2 for d in long)    # only the long ones are cut
    stats = samples.gpt_indices[0].stats(samples.documents[0].sequence_lengths, CAPACITY)
    assert stats["cut_documents"] == len(long) and stats["cut_pieces"] == sum(rows_of[d] for d in long)
    assert stats["documents"] == len(documents) and stats["rows"] == len(samples)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{len(long)} document(s) longer than a row" in warnings[0]
    build_samples(_config(prefix, vocab))      # the same split again: counted, not logged again
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_the_row_check_fails_on_broken_packing(corpus):
    """check_rows catches pieces cut without Megatron's one-token overlap, and a short document split."""
    _, documents, _ = corpus
    doc = documents[17]
    pieces = [doc[i:i + CAPACITY] for i in range(0, doc.size, CAPACITY)]    # no overlap: a prediction is lost
    windows = np.full((len(pieces) + 1, CAPACITY), PAD)
    for r, piece in enumerate(pieces):
        windows[r, :piece.size] = piece
    with pytest.raises(AssertionError, match="document 0 token 33 predicted 0 times"):
        check_rows(windows[:-1], [doc])
    short = next(d for d in documents if 4 < d.size <= CAPACITY)
    split = np.full((2, CAPACITY), PAD)
    split[0, :4], split[1, :short.size - 3] = short[:4], short[3:]
    with pytest.raises(AssertionError, match="split over 2 rows"):
        check_rows(split, [short])


def test_first_fit_order_and_cuts():
    """Hand-packed oracle: rows of 8 tokens, 2 open rows."""
    plan = pack_documents(np.array([5, 3, 8, 2, 20, 4, 1, 0, 6]), capacity=8, open_rows=2)
    rows = PackedRows(np.arange(9), **plan)
    assert [rows.pieces(r) for r in range(len(rows))] == [
        [(0, 0, 5), (1, 0, 3)],            # 5 + 3 fills row A exactly: it closes
        [(2, 0, 8)],                       # 8 fills a row alone
        [(4, 0, 8)], [(4, 7, 8)],          # 20 > 8: full rows, each starting at the last token of the one before
        [(3, 0, 2), (4, 14, 6)],           # the tail (6) joins the open row holding the 2
        [(5, 0, 4), (6, 0, 1)],            # 6 (doc 8) fits neither open row: the oldest closes
        [(8, 0, 6)],
    ]
    one = pack_documents(np.array([5, 3, 8, 2]), capacity=8, open_rows=1)   # one open row: next fit
    assert one["row_start"].tolist() == [0, 2, 3, 4]


def test_reading_order_is_megatrons_document_index(corpus):
    prefix, documents, vocab = corpus
    samples = build_samples(_config(prefix, vocab, num_epochs=None, num_samples=200, seed=7))
    rows = samples.gpt_indices[0]
    lengths = np.array([d.size for d in documents], np.int32)
    epochs = rows.document_index.size // len(documents)
    ids = np.arange(len(documents), dtype=np.int32)
    megatron = ix.build_document_index(ids, epochs, np.random.RandomState(7), False)   # its first shuffle
    np.testing.assert_array_equal(rows.document_index, megatron)
    assert len(rows) >= 200 and epochs > 1
    least = ix.num_epochs_needed(int(lengths.sum()), T, 200)      # what Megatron reads for 200 samples
    assert epochs >= least
    if epochs > least:                                            # one epoch fewer would not fill 200 rows
        fewer = ix.build_document_index(ids, epochs - 1, np.random.RandomState(7), False)
        assert pack_documents(lengths[fewer], capacity=CAPACITY, open_rows=4)["row_start"].size - 1 < 200


def test_resume_mid_epoch_equals_an_uninterrupted_run(corpus):
    prefix, _, vocab = corpus
    cfg = _config(prefix, vocab, num_epochs=None, num_samples=120)
    straight = [next(it) for it in [make_iterator(cfg, process_index=0, process_count=1)] for _ in range(7)]
    first = make_iterator(cfg, process_index=0, process_count=1)
    for _ in range(4):
        next(first)
    state = json.loads(json.dumps(first.get_state()))        # through the checkpoint's JSON
    resumed = make_iterator(cfg, process_index=0, process_count=1)
    resumed.set_state(state)
    for expected in straight[4:]:
        got = next(resumed)
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    hosts = [make_dataset(cfg, process_index=h, process_count=2)[3]["inputs"] for h in range(2)]
    np.testing.assert_array_equal(np.concatenate(hosts), straight[3]["inputs"])   # hosts split the same rows


def test_documents_without_eod_are_one_line_errors(tmp_path):
    prefix = str(tmp_path / "noeod")
    write_indexed_dataset(prefix, [np.arange(2, 9), np.arange(9, 12)], np.int32)
    samples = build_samples(_config(prefix, 64))
    with pytest.raises(ConfigError, match=r"ends with token (8|11), not data.eod_id=0.*--append-eod"):
        samples[0]


@pytest.mark.parametrize("overrides,message", [
    (["data.packing=documents"], "packing='documents' is not one of ('samples', 'whole_documents')"),
    (["data.packing=whole_documents", "data.packing_open_rows=0"], "packing_open_rows=0 must be >= 1"),
    (["data.packing=whole_documents", "data.index_mode=mmap_npy"],
     "index_mode='mmap_npy' reads Megatron's sample index: set index_mode=build"),
])
def test_bad_values_are_one_line_config_errors(overrides, message, tmp_path):
    cfg = config_lib.compose([*overrides, f"data.cache_dir={tmp_path}"], run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        config_lib.build(cfg, str(tmp_path), open_data=False)
    assert "\n" not in str(err.value)


def test_rows_round_up_to_the_context_parallel_multiple(tmp_path):
    overrides = ["parallel=context", "parallel.context=4", f"data.cache_dir={tmp_path}", "data.seq_length=100",
                 "data.packing=whole_documents"]
    rc = config_lib.build(config_lib.compose(overrides, run_dir=str(tmp_path)), str(tmp_path), open_data=False)
    assert rc.data.seq_length == 512                          # 2 x 4 x 64 (KDA chunk) = 512
    check_length(rc.data.seq_length, 4, True, rc.kernel.chunk_size)
    assert any("data.seq_length=100 rounded up to 512" in note for note in rc.notes)
    staged = overrides + ["+schedule.stages=[{seq_length: 300, steps: 2}, {seq_length: 1024, steps: 2}]"]
    rc = config_lib.build(config_lib.compose(staged, run_dir=str(tmp_path)), str(tmp_path), open_data=False)
    assert [s.seq_length for s in rc.schedule.stages] == [512, 1024]
    with pytest.raises(ConfigError, match="data.seq_length=100 does not divide into 8 chunks"):   # samples: as before
        config_lib.build(config_lib.compose(overrides[:-1], run_dir=str(tmp_path)), str(tmp_path), open_data=False)
