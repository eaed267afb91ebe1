"""pipeline.py: exact resume, per-host sharding, synthetic and .npy sources, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_helpers import EOD, PAD, VOCAB, random_documents, write_corpus

from lingpack.data.config import DataConfig
from lingpack.data.indexed import write_indexed_dataset
from lingpack.data.pipeline import make_dataset, make_iterator
from lingpack.data.sampling import build_samples
from lingpack.data.split import BATCH_KEYS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("pipeline"), "c", seed=4, num_documents=400)


def _config(paths, **overrides) -> DataConfig:
    base = dict(paths=tuple(paths), seq_length=48, global_batch_size=8, eod_id=EOD, pad_id=PAD,
                vocab_size=VOCAB, split="1,0,0", eod_mask_loss=True)
    return DataConfig(**{**base, **overrides})


def _assert_batches_equal(a, b):
    assert set(a) == set(b) == set(BATCH_KEYS)
    for key in BATCH_KEYS:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("read_threads", [0, 2])
def test_state_round_trip_mid_epoch(corpus, read_threads):
    cfg = _config([corpus], read_threads=read_threads, num_samples=3000)
    iterator = make_iterator(cfg, process_index=0, process_count=1)
    for _ in range(5):
        next(iterator)
    state = iterator.get_state()
    json.dumps(state)  # checkpointable as JSON beside Orbax
    expected = [next(iterator) for _ in range(3)]

    resumed = make_iterator(cfg, process_index=0, process_count=1)
    resumed.set_state(state)
    for batch in expected:
        _assert_batches_equal(next(resumed), batch)


def test_batches_shape_and_dtype(corpus):
    batch = next(make_iterator(_config([corpus]), process_index=0, process_count=1))
    for key in BATCH_KEYS:
        assert batch[key].shape == (8, 48) and batch[key].dtype == np.int32, key


@pytest.mark.parametrize("process_count", [2, 4])
def test_hosts_partition_the_global_batch(corpus, process_count):
    cfg = _config([corpus])
    global_batches = make_dataset(cfg, process_index=0, process_count=1)
    hosts = [make_dataset(cfg, process_index=h, process_count=process_count)
             for h in range(process_count)]
    assert all(len(host) == len(global_batches) for host in hosts)
    for number in (0, 3, len(global_batches) - 1):
        pieces = [host[number] for host in hosts]
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(
                np.concatenate([piece[key] for piece in pieces]), global_batches[number][key]
            )


def test_npy_source_equals_indexed_source(tmp_path):
    documents = random_documents(seed=8, num_documents=150)
    flat = str(tmp_path / "tokens.npy")
    np.save(flat, np.concatenate(documents).astype(np.int32))
    prefix = write_indexed_dataset(str(tmp_path / "same"), documents)
    from_npy = make_dataset(_config([flat], source="npy", num_samples=500),
                            process_index=0, process_count=1)
    from_bin = make_dataset(_config([prefix], num_samples=500), process_index=0, process_count=1)
    assert len(from_npy) == len(from_bin)
    for number in range(len(from_bin)):
        _assert_batches_equal(from_npy[number], from_bin[number])


def test_synthetic_source_is_deterministic_and_well_formed():
    cfg = DataConfig(source="synthetic", seq_length=64, global_batch_size=4, split="1,0,0",
                     eod_id=5, pad_id=6, vocab_size=50, synthetic_num_documents=300,
                     synthetic_mean_length=40, synthetic_min_length=2, synthetic_max_length=200)
    samples = build_samples(cfg)
    documents = samples.documents[0]
    lengths = documents.sequence_lengths
    assert lengths.min() >= 2 and lengths.max() <= 200
    assert 25 < lengths.mean() < 60
    for index in range(0, 300, 37):
        tokens = documents.get(index)
        assert tokens[-1] == 5 and not np.isin(tokens[:-1], [5, 6]).any()
    first = [make_dataset(cfg, process_index=0, process_count=1)[i] for i in range(3)]
    again = [make_dataset(cfg, process_index=0, process_count=1)[i] for i in range(3)]
    for a, b in zip(first, again):
        _assert_batches_equal(a, b)
    assert first[0]["inputs_segmentation"].max() > 1  # documents really are packed


@pytest.mark.parametrize("distribution", ["lognormal", "exponential", "uniform", "fixed"])
def test_synthetic_length_distributions(distribution):
    cfg = DataConfig(source="synthetic", split="1,0,0", synthetic_length_distribution=distribution,
                     synthetic_num_documents=2000, synthetic_mean_length=100,
                     synthetic_min_length=1, synthetic_max_length=199)
    lengths = build_samples(cfg).documents[0].sequence_lengths
    assert 1 <= lengths.min() and lengths.max() <= 199
    assert 75 < lengths.mean() < 125, distribution


def test_build_mode_cache_is_reused(corpus, tmp_path):
    cfg = _config([corpus], cache_dir=str(tmp_path / "cache"), num_samples=900)
    built = build_samples(cfg)
    cached = build_samples(cfg)
    assert isinstance(cached.gpt_indices[0].shuffle_index, np.memmap)
    for sample in (0, 1, 450, len(built) - 1):
        np.testing.assert_array_equal(built[sample], cached[sample])


def test_token_ids_beyond_vocab_name_the_file(tmp_path):
    tokens = np.append(np.arange(100), EOD)
    tokens[50] = 600
    prefix = write_indexed_dataset(str(tmp_path / "oov"), [tokens])
    samples = build_samples(_config([prefix], vocab_size=VOCAB, seq_length=8))
    with pytest.raises(ValueError, match=r"oov\.bin: token id 600 in sample \d+ is outside the "
                                         r"vocabulary \[0, 512\)"):
        for sample in range(len(samples)):
            samples[sample]


def test_dataset_shorter_than_one_sample_names_the_file(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "tiny"), [np.array([1, 2, EOD])])
    with pytest.raises(ValueError, match=r"tiny\.bin \(train split\): 3 tokens in the split, "
                                         r"shorter than one sample"):
        build_samples(_config([prefix]))


def test_config_errors():
    with pytest.raises(ValueError, match="blend weights do not parse"):
        DataConfig(paths=("0.3", "a", "b"))
    with pytest.raises(ValueError, match="split 'x' does not parse"):
        DataConfig(paths=("a",), split="x")
    with pytest.raises(ValueError, match="pad_id == eod_id"):
        DataConfig(paths=("a",), eod_id=3, pad_id=3)
    with pytest.raises(ValueError, match="source='parquet' is not one of"):
        DataConfig(paths=("a",), source="parquet")


def test_batch_and_host_errors(corpus):
    with pytest.raises(ValueError, match="not divisible by the 3 processes"):
        make_iterator(_config([corpus]), process_index=0, process_count=3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        make_iterator(_config([corpus], global_batch_size=100000), process_index=0,
                      process_count=1)
    with pytest.raises(ValueError, match="a weighted blend needs a sample count"):
        build_samples(_config(["0.5", corpus, "0.5", corpus]))


@pytest.mark.slow
def test_worker_processes_resume_exactly(corpus):
    cfg = _config([corpus], worker_count=2, num_samples=2000)
    iterator = make_iterator(cfg, process_index=0, process_count=1)
    for _ in range(4):
        next(iterator)
    state = iterator.get_state()
    expected = [next(iterator) for _ in range(3)]
    resumed = make_iterator(cfg, process_index=0, process_count=1)
    resumed.set_state(state)
    for batch in expected:
        _assert_batches_equal(next(resumed), batch)
    in_process = make_dataset(cfg, process_index=0, process_count=1)
    _assert_batches_equal(expected[0], in_process[4])
