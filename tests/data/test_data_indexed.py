"""indexed.py: Megatron byte compatibility both ways, every dtype code, pickling, threads, bad files."""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import struct

import numpy as np
import pytest

from tests.optional import require
from lingpack.data.indexed import (
    DTYPE_BY_CODE,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    write_indexed_dataset,
)


def _documents(dtype, seed=0, count=20):
    rng = np.random.default_rng(seed)
    high = 100 if np.dtype(dtype).kind != "f" else 1000
    return [rng.integers(0, high, int(rng.integers(1, 50))).astype(dtype) for _ in range(count)]


@pytest.mark.parametrize("code", sorted(DTYPE_BY_CODE))
def test_round_trip_every_dtype_code(tmp_path, code):
    dtype = DTYPE_BY_CODE[code]
    documents = _documents(dtype)
    prefix = write_indexed_dataset(str(tmp_path / f"d{code}"), documents, dtype)
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == dtype and len(dataset) == len(documents)
    with open(prefix + ".idx", "rb") as stream:
        assert stream.read(18)[17] == code
    for index, document in enumerate(documents):
        np.testing.assert_array_equal(dataset[index], document)
        np.testing.assert_array_equal(dataset.get(index, 1, len(document) - 1), document[1:])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_byte_identical_to_megatron_and_readable_by_it(tmp_path, dtype):
    indexed = require("megatron.core.datasets.indexed_dataset")
    torch = require("torch")
    documents = _documents(dtype, seed=1)
    ours = write_indexed_dataset(str(tmp_path / "ours"), documents, dtype)
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for document in documents:
        builder.add_document(torch.from_numpy(document.astype(np.int64)), [len(document)])
    builder.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        with open(ours + suffix, "rb") as a, open(str(tmp_path / "theirs") + suffix, "rb") as b:
            assert a.read() == b.read(), suffix
    theirs = indexed.IndexedDataset(ours)
    for index, document in enumerate(documents):
        np.testing.assert_array_equal(theirs.get(index, offset=2 if len(document) > 2 else 0),
                                      document[2 if len(document) > 2 else 0:])


def test_reads_megatron_multi_sequence_documents(tmp_path):
    prefix = str(tmp_path / "multi")
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        writer.add_document(np.arange(10), sequence_lengths=[3, 7])
        writer.add_document(np.arange(4))
    dataset = IndexedDataset(prefix)
    assert dataset.sequence_lengths.tolist() == [3, 7, 4]
    assert dataset.document_indices.tolist() == [0, 2, 3]
    np.testing.assert_array_equal(dataset[1], np.arange(3, 10))


def test_pickle_and_threads(tmp_path):
    documents = _documents(np.uint16, seed=2, count=200)
    dataset = IndexedDataset(write_indexed_dataset(str(tmp_path / "p"), documents))
    clone = pickle.loads(pickle.dumps(dataset))
    assert len(pickle.dumps(dataset)) < 1000  # the path, not the tokens
    np.testing.assert_array_equal(clone[7], documents[7])

    def read(index):
        return np.array_equal(dataset.get(index % 200), documents[index % 200])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, range(4000)))


def _valid(tmp_path, name="x", documents=None):
    return write_indexed_dataset(str(tmp_path / name), documents or _documents(np.uint16))


def test_truncated_bin_names_file(tmp_path):
    prefix = _valid(tmp_path)
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as stream:
        stream.truncate(size - 3)
    with pytest.raises(IndexedDatasetError, match=r"x\.bin: truncated data file"):
        IndexedDataset(prefix)


def _patch_idx(prefix, offset, data):
    with open(prefix + ".idx", "r+b") as stream:
        stream.seek(offset)
        stream.write(data)


def test_bad_magic_version_and_dtype(tmp_path):
    prefix = _valid(tmp_path, "magic")
    _patch_idx(prefix, 0, b"NOTMEGA\x00\x00")
    with pytest.raises(IndexedDatasetError, match=r"magic\.idx: bad magic"):
        IndexedDataset(prefix)
    prefix = _valid(tmp_path, "version")
    _patch_idx(prefix, 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match=r"version\.idx: unsupported index version 2"):
        IndexedDataset(prefix)
    prefix = _valid(tmp_path, "dtype")
    _patch_idx(prefix, 17, bytes([42]))
    with pytest.raises(IndexedDatasetError, match=r"dtype\.idx: unknown dtype code 42"):
        IndexedDataset(prefix)


def test_truncated_idx_and_missing_files(tmp_path):
    prefix = _valid(tmp_path, "short")
    with open(prefix + ".idx", "r+b") as stream:
        stream.truncate(40)
    with pytest.raises(IndexedDatasetError, match=r"short\.idx: truncated index"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx: not found"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_empty_documents_rejected_unless_allowed(tmp_path):
    prefix = write_indexed_dataset(
        str(tmp_path / "empty"), [np.arange(3), np.zeros(0), np.arange(2)], np.uint16
    )
    with pytest.raises(IndexedDatasetError, match=r"empty\.idx: 1 empty document\(s\), first at "
                                                  r"sequence 1"):
        IndexedDataset(prefix)
    assert IndexedDataset(prefix, allow_empty_documents=True).sequence_lengths.tolist() == [3, 0, 2]


def test_token_range_check_and_writer_overflow(tmp_path):
    dataset = IndexedDataset(write_indexed_dataset(
        str(tmp_path / "vocab"), [np.arange(5), np.array([1, 700, 2])], np.uint16))
    dataset.check_token_range(701)
    with pytest.raises(IndexedDatasetError, match=r"vocab\.bin: token id 700 in sequence 1"):
        dataset.check_token_range(512)
    with pytest.raises(ValueError, match="uint16 cannot hold"):
        write_indexed_dataset(str(tmp_path / "big"), [np.array([70000])], np.uint16)
