"""indices.py against megatron-core's split parsing, C++ index helpers and builder arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lingpack.data import indices as ix
from tests.optional import require


@pytest.fixture(scope="module")
def megatron_helpers():
    return require("megatron.core.datasets.helpers")


@pytest.mark.parametrize("split", ["969,30,1", "98,2,0", "1,0,0", "0.9, 0.1", "1/1/1", "3,0,7"])
def test_split_matches_megatron(split):
    config = require("megatron.core.datasets.blended_megatron_dataset_config")
    convert_split_vector_to_split_matrix = config.convert_split_vector_to_split_matrix
    parse_and_normalize_split = config.parse_and_normalize_split

    assert ix.parse_split(split) == parse_and_normalize_split(split)
    assert ix.split_bookends(split) == convert_split_vector_to_split_matrix(
        parse_and_normalize_split(split)
    )
    for num_sequences in (1, 7, 10, 999, 12345):
        for name, bookend in zip(ix.SPLIT_NAMES, ix.split_bookends(split)):
            if bookend is None:
                continue
            ours = ix.split_sequence_range(num_sequences, split, name)
            begin, end = int(round(bookend[0] * num_sequences)), int(round(bookend[1] * num_sequences))
            np.testing.assert_array_equal(ours, np.arange(begin, end, dtype=np.int32))


@pytest.mark.parametrize("split", ["", "a,b", "0,0,0", "1,2,3,4"])
def test_bad_split_strings(split):
    with pytest.raises(ValueError, match="does not parse"):
        ix.parse_split(split)


def test_blend_parsing_matches_megatron_and_rejects_garbage():
    get_blend_from_list = require("megatron.core.datasets.utils").get_blend_from_list

    for words in (["a"], ["a", "b"], ["30", "a", "70", "b"], ["0.25", "x", "0.75", "y"]):
        assert ix.parse_blend(words) == get_blend_from_list(words)
    assert ix.parse_blend("0.3 a 0.7 b") == (["a", "b"], [0.3, 0.7])
    for bad in (["0.3", "a", "b", "c"], ["0.3", "a", "x0.7", "b"], ["a", "0.5"], ["1", "2", "3"]):
        with pytest.raises(ValueError, match="blend weights do not parse"):
            ix.parse_blend(bad)
    with pytest.raises(ValueError, match="finite and > 0"):
        ix.parse_blend(["0", "a", "1", "b"])
    with pytest.raises(ValueError, match="no data path"):
        ix.parse_blend([])


def test_weight_normalisation_is_float64_like_megatron():
    _get_size_per_split_per_dataset = require(
        "megatron.core.datasets.blended_megatron_dataset_builder")._get_size_per_split_per_dataset
    normalize = require("megatron.core.datasets.utils").normalize

    weights = [0.1, 0.2, 0.3000000001, 1e-7]
    assert ix.normalize_weights(weights) == normalize(weights)
    normalized = ix.normalize_weights(weights)
    for size in (1, 17, 1000, 123457):
        for surplus in (0.0, 0.005):
            theirs = _get_size_per_split_per_dataset(normalized, [size], surplus)
            assert ix.blend_sample_counts(normalized, size, surplus) == [t[0] for t in theirs]


@settings(max_examples=30, deadline=None)
@given(
    weights=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=5),
    size=st.integers(1, 3000),
)
def test_blending_indices_match_megatron_cpp(megatron_helpers, weights, size):
    normalized = ix.normalize_weights(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    megatron_helpers.build_blending_indices(
        dataset_index, dataset_sample_index, normalized, len(normalized), size, False
    )
    ours = ix.build_blending_indices(normalized, size)
    np.testing.assert_array_equal(ours[0], dataset_index)
    np.testing.assert_array_equal(ours[1], dataset_sample_index)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=4))
def test_exhaustive_blending_matches_megatron_cpp(megatron_helpers, sizes):
    total = sum(sizes)
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    megatron_helpers.build_exhaustive_blending_indices(
        dataset_index, dataset_sample_index, np.asarray(sizes, dtype=np.int64), len(sizes)
    )
    ours = ix.build_exhaustive_blending_indices(sizes)
    np.testing.assert_array_equal(ours[0], dataset_index)
    np.testing.assert_array_equal(ours[1], dataset_sample_index)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 200), min_size=1, max_size=60),
    seq_length=st.integers(2, 150),
    num_epochs=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_index_matches_megatron_cpp(megatron_helpers, lengths, seq_length, num_epochs, seed):
    """Random document lengths, empty documents included, several epochs."""
    sizes = np.asarray(lengths, dtype=np.int32)
    tokens_per_epoch = int(sizes.sum())
    if tokens_per_epoch < seq_length + 2:
        return
    document_index = np.tile(np.arange(len(sizes), dtype=np.int32), num_epochs)
    np.random.RandomState(seed).shuffle(document_index)
    theirs = megatron_helpers.build_sample_idx(
        sizes, document_index, seq_length, num_epochs, tokens_per_epoch, True, True
    )
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    ours = ix.build_sample_index(sizes, document_index, seq_length, num_samples)
    np.testing.assert_array_equal(ours, theirs)


def test_long_document_is_cut_into_overlapping_windows():
    """A document longer than a sample becomes consecutive seq_length + 1 windows that share one
    token (the last label of one sample is the first input of the next); the tail is dropped."""
    document = np.arange(23)

    class OneDocument:
        name = "one"
        sequence_lengths = np.array([23], dtype=np.int32)

        @staticmethod
        def get(index, offset=0, length=None):
            return document[offset : offset + length]

    built = ix.build_gpt_indices(OneDocument.sequence_lengths, np.array([0], np.int32),
                                 seq_length=5, seed=0, num_samples=None)
    assert len(built) == (23 - 1) // 5 == 4
    windows = sorted(ix.read_sample(OneDocument, built, i, 5, -1).tolist() for i in range(4))
    assert windows == [list(range(s, s + 6)) for s in (0, 5, 10, 15)]


def test_too_short_dataset_and_empty_split():
    with pytest.raises(ValueError, match=r"tiny \(train split\): 5 tokens in the split, shorter "
                                         r"than one sample of data.seq_length \+ 1 = 9"):
        ix.build_gpt_indices(np.array([2, 3], np.int32), np.array([0, 1], np.int32),
                             seq_length=8, seed=0, num_samples=None, name="tiny (train split)")
    with pytest.raises(ValueError, match="gives the 'test' split no share"):
        ix.split_sequence_range(10, "1,0,0", "test")
