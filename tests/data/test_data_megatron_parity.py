"""megatron-core's GPTDataset / BlendedDataset (CPU) is the oracle: same files, same seed, same samples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.optional import installed

installed("megatron.core.datasets.gpt_dataset")   # imported by the tests that use it (data_helpers)

from data_helpers import EOD, PAD, VOCAB, assert_matches_megatron, megatron_datasets, write_corpus

from lingpack.data.config import DataConfig
from lingpack.data.pipeline import make_iterator
from lingpack.data.sampling import build_samples
from lingpack.data.split import split_window

SEQ = 64


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpora")
    return {
        "a": write_corpus(directory, "a", seed=0, num_documents=300),
        "b": write_corpus(directory, "b", seed=1, num_documents=120),
    }


@pytest.fixture
def rank_zero(monkeypatch):
    """BlendedDataset asks torch.distributed for the rank when it writes its cache, even when
    torch.distributed is not initialised; answer 0 as a one-process job would."""
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kwargs: 0)


def _config(paths, **overrides) -> DataConfig:
    # Megatron's switches default to off; lingpack's segment switches default to on.
    base = dict(paths=tuple(paths), seq_length=SEQ, eod_id=EOD, pad_id=PAD, vocab_size=VOCAB,
                reset_attention_mask=False, reset_position_ids=False)
    return DataConfig(**{**base, **overrides})


def _assert_same_samples(ours, theirs, cfg: DataConfig, where: str) -> None:
    assert len(ours) == len(theirs), where
    options = cfg.split_options()
    for sample in range(len(ours)):
        row = split_window(ours[sample], options)
        assert_matches_megatron(row, theirs[sample], f"{where}: sample {sample}")


def _tokens_per_epoch(prefix: str, fraction: float) -> int:
    from lingpack.data.indexed import IndexedDataset

    lengths = IndexedDataset(prefix).sequence_lengths
    return int(lengths[: int(round(fraction * len(lengths)))].sum())


@pytest.mark.parametrize(
    "epochs, flags, separate_final_epoch",
    [
        (None, (False, False, False), False),  # one epoch, Megatron's default switches
        (2.3, (True, True, True), True),  # final epoch < 80%: shuffled separately
        (2.9, (True, False, True), False),  # final epoch >= 80%: shuffled with the others
        (3.5, (False, True, False), True),
    ],
)
def test_single_dataset_matches_megatron(corpora, epochs, flags, separate_final_epoch):
    eod_mask_loss, reset_attention_mask, reset_position_ids = flags
    tokens_per_epoch = _tokens_per_epoch(corpora["a"], 0.9)
    num_samples = None if epochs is None else int(epochs * tokens_per_epoch) // SEQ
    switches = dict(eod_mask_loss=eod_mask_loss, reset_attention_mask=reset_attention_mask,
                    reset_position_ids=reset_position_ids)
    train, valid, _ = megatron_datasets(
        ([corpora["a"]], None), split="90,10,0", sizes=[num_samples, None, None],
        seq_length=SEQ, seed=7, cache_dir=None, **switches,
    )
    cfg = _config([corpora["a"]], split="90,10,0", seed=7, num_samples=num_samples, **switches)
    for split_name, theirs in (("train", train), ("valid", valid)):
        ours = build_samples(cfg, split_name)
        indices = ours.gpt_indices[0]
        np.testing.assert_array_equal(indices.document_index, theirs.document_index)
        np.testing.assert_array_equal(indices.sample_index, theirs.sample_index)
        np.testing.assert_array_equal(indices.shuffle_index, theirs.shuffle_index)
        assert indices.shuffle_index.dtype == theirs.shuffle_index.dtype
        _assert_same_samples(ours, theirs, cfg, f"{split_name} epochs={epochs}")
        # Megatron cached these indices beside the data (no --data-cache-path): read them back.
        cached = build_samples(dataclasses.replace(cfg, index_mode="mmap_npy"), split_name)
        assert isinstance(cached.gpt_indices[0].sample_index, np.memmap)
        np.testing.assert_array_equal(cached.gpt_indices[0].shuffle_index, theirs.shuffle_index)
        np.testing.assert_array_equal(cached[len(cached) - 1], ours[len(ours) - 1])
    if epochs is not None:
        assert len(train) >= num_samples
        epochs_built = -(-(num_samples * SEQ + 1) // tokens_per_epoch)
        before_final = ((epochs_built - 1) * tokens_per_epoch - 1) // SEQ
        # A separate final epoch shows as a shuffle that keeps earlier samples before it.
        separated = bool(train.shuffle_index[:before_final].max() < before_final)
        assert separated == separate_final_epoch


@pytest.mark.parametrize("weights", [("0.3", "0.7"), ("30", "70"), ("1", "3")])
def test_weighted_blend_matches_megatron(corpora, weights):
    a, b = corpora["a"], corpora["b"]
    # 1500 samples at 70% needs several epochs of the small corpus b.
    sizes = [1500, 60, 20]
    float_weights = [float(w) for w in weights]
    train, valid, test = megatron_datasets(
        ([a, b], float_weights), split="80,15,5", sizes=sizes, seq_length=SEQ, seed=3,
        cache_dir=None, reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True,
    )
    cfg = _config(
        [weights[0], a, weights[1], b], split="80,15,5", seed=3, num_samples=sizes[0],
        eval_num_samples=sizes[1], eod_mask_loss=True, reset_attention_mask=True,
        reset_position_ids=True,
    )
    ours = build_samples(cfg, "train")
    np.testing.assert_array_equal(ours.blend[0], train.dataset_index)
    np.testing.assert_array_equal(ours.blend[1], train.dataset_sample_index)
    _assert_same_samples(ours, train, cfg, f"blend {weights} train")
    _assert_same_samples(build_samples(cfg, "valid"), valid, cfg, f"blend {weights} valid")


@pytest.mark.parametrize("size", [None, 200])
def test_unweighted_blend_matches_megatron(corpora, size):
    a, b = corpora["a"], corpora["b"]
    train, _, _ = megatron_datasets(
        ([a, b], None), split="1,0,0", sizes=[size, None, None], seq_length=SEQ, seed=5,
        cache_dir=None,
    )
    cfg = _config([a, b], split="1,0,0", seed=5, num_samples=size)
    ours = build_samples(cfg, "train")
    np.testing.assert_array_equal(ours.blend[0], train.dataset_index)
    _assert_same_samples(ours, train, cfg, f"unweighted blend size={size}")


def test_mmap_npy_reads_megatron_cached_indices(corpora, tmp_path, rank_zero):
    """A Megatron run caches its indices; lingpack memory-maps those very files."""
    a, b = corpora["a"], corpora["b"]
    cache = str(tmp_path / "megatron_cache")
    sizes = [700, 40, 10]
    train, _, _ = megatron_datasets(
        ([a, b], [0.4, 0.6]), split="90,8,2", sizes=sizes, seq_length=SEQ, seed=11,
        cache_dir=cache, reset_attention_mask=True, reset_position_ids=True,
    )
    cfg = _config(["0.4", a, "0.6", b], split="90,8,2", seed=11, num_samples=sizes[0],
                  eval_num_samples=sizes[1], index_mode="mmap_npy", cache_dir=cache,
                  reset_attention_mask=True, reset_position_ids=True)
    ours = build_samples(cfg, "train")
    assert isinstance(ours.blend[0], np.memmap)
    assert all(isinstance(i.shuffle_index, np.memmap) for i in ours.gpt_indices)
    _assert_same_samples(ours, train, cfg, "mmap_npy blend")

    single_train, _, _ = megatron_datasets(
        ([a], None), split="90,8,2", sizes=[300, None, None], seq_length=SEQ, seed=11,
        cache_dir=cache,
    )
    single = _config([a], split="90,8,2", seed=11, num_samples=300, index_mode="mmap_npy",
                     cache_dir=cache)
    _assert_same_samples(build_samples(single, "train"), single_train, single, "mmap_npy single")

    with pytest.raises(FileNotFoundError, match="no Megatron GPTDataset train indices"):
        build_samples(_config([a], split="90,8,2", seed=12, num_samples=300,
                              index_mode="mmap_npy", cache_dir=cache), "train")


def test_grain_batches_are_megatron_samples_in_order(corpora):
    """Through the whole Grain pipeline, global batch k is Megatron samples [kB, (k+1)B)."""
    train, _, _ = megatron_datasets(
        ([corpora["a"]], None), split="1,0,0", sizes=[None, None, None], seq_length=SEQ, seed=9,
        cache_dir=None, reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True,
    )
    cfg = _config([corpora["a"]], split="1,0,0", seed=9, global_batch_size=8, eod_mask_loss=True,
                  reset_attention_mask=True, reset_position_ids=True)
    batches = list(make_iterator(cfg, process_index=0, process_count=1))
    assert len(batches) == len(train) // 8
    for number, batch in enumerate(batches):
        for row in range(8):
            ours = {key: value[row] for key, value in batch.items()}
            assert_matches_megatron(ours, train[number * 8 + row], f"batch {number} row {row}")
