"""Megatron's document / sample / shuffle indices and blend indices, rebuilt bit for bit.

Semantics follow megatron-core's `GPTDataset`, `BlendedDataset` and `BlendedMegatronDatasetBuilder`
(the tests compare against them):

- split string "969,30,1": every number in it (regex `[.0-9]+`), padded to three with zeros,
  normalised in float64; split i owns sequences `[round(lo_i * N), round(hi_i * N))` (Python's
  round, i.e. half to even), an empty share is no split at all.
- one epoch is every sequence of the split; `num_samples` asks for the fewest epochs whose tokens
  cover `num_samples * seq_length + 1`. Epochs share one shuffled document index, unless the last
  epoch would contribute fewer than 80% of an epoch's samples: then it is shuffled separately
  ("separate final epoch") and its samples are shuffled separately too.
- the random stream is one `numpy.random.RandomState(seed)` per dataset split, consumed as:
  document-index shuffle(s), then sample shuffle(s).
- sample i is `seq_length + 1` tokens starting `i * seq_length` tokens into the concatenation of
  the documents in document-index order (consecutive samples overlap by one token); samples are
  never padded in training (the tail shorter than a sample is dropped).
- blends: weights normalised in float64; dataset d is asked for
  `ceil(ceil(size * w_d) * (1 + surplus))` samples (surplus 0.005), the blend has
  `sum_d ceil(size * w_d)` samples, assigned greedily to the dataset whose share lags most.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from lingpack.errors import ConfigError

SPLIT_NAMES = ("train", "valid", "test")
# Fraction of an epoch below which Megatron shuffles the final epoch on its own.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Extra samples Megatron builds per blended dataset so the blend never runs dry.
MID_LEVEL_DATASET_SURPLUS = 0.005


# ----------------------------------------------------------------------------- split strings


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> [0.969, 0.03, 0.001] (float64-normalised, padded to three)."""
    numbers = re.findall(r"[.0-9]+", str(split))
    try:
        weights = [float(number) for number in numbers]
    except ValueError:
        weights = []
    if not weights or len(weights) > len(SPLIT_NAMES) or sum(weights) <= 0:
        raise ValueError(
            f"split {split!r} does not parse: give up to three non-negative weights for "
            "train,valid,test with a positive sum, e.g. '969,30,1' or '1,0,0'"
        )
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    return normalize_weights(weights)


def split_bookends(split: str) -> list[tuple[float, float] | None]:
    """Per split, the (start, end) fraction of the sequences it owns, or None when it owns none."""
    fractions = parse_split(split)
    edges = [0.0]
    for fraction in fractions:
        edges.append(edges[-1] + fraction)  # python float sums, in Megatron's order
    return [(lo, hi) if hi > lo else None for lo, hi in zip(edges[:-1], edges[1:])]


def split_sequence_range(num_sequences: int, split: str, split_name: str) -> np.ndarray:
    """The int32 sequence ids of `split_name`; raises if that split owns none."""
    bookend = split_bookends(split)[split_index(split_name)]
    if bookend is None:
        raise ValueError(f"split {split!r} gives the {split_name!r} split no share of the data")
    begin = int(round(bookend[0] * float(num_sequences)))
    end = int(round(bookend[1] * float(num_sequences)))
    return np.arange(begin, end, dtype=np.int32)


def split_index(split_name: str) -> int:
    if split_name not in SPLIT_NAMES:
        raise ValueError(f"split name {split_name!r} is not one of {SPLIT_NAMES}")
    return SPLIT_NAMES.index(split_name)


# ----------------------------------------------------------------------------- blends


def normalize_weights(weights) -> list[float]:
    """Divide by the sum in float64, as Megatron's `normalize` does."""
    array = np.asarray(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def parse_blend(paths) -> tuple[list[str], list[float] | None]:
    """Megatron `--data-path` syntax: 'a b' or '30 a 70 b' (a string or a sequence of words).

    Returns (prefixes, weights) with weights None when none were given.
    """
    words = paths.split() if isinstance(paths, str) else [w for p in paths for w in str(p).split()]
    if not words:
        raise ValueError("no data path given: set paths to a prefix, or 'weight prefix ...' pairs")

    def as_weight(word: str) -> float | None:
        try:
            return float(word)
        except ValueError:
            return None

    parsed = [as_weight(word) for word in words]
    if len(words) % 2 == 0 and all(parsed[i] is not None for i in range(0, len(words), 2)):
        weights = [parsed[i] for i in range(0, len(words), 2)]
        prefixes = words[1::2]
        bad = [w for w in weights if not (math.isfinite(w) and w > 0)]
        if bad:
            raise ValueError(f"blend weights must be finite and > 0, got {weights} in {words}")
        return prefixes, weights
    if all(value is None for value in parsed):
        return words, None
    raise ValueError(
        f"blend weights do not parse in {words}: write 'weight prefix weight prefix ...' "
        "with numeric weights, or only prefixes"
    )


def blend_sample_counts(weights: list[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples to request from each dataset of a blend of `size` samples."""
    return [int(math.ceil(math.ceil(size * weight) * (1 + surplus))) for weight in weights]


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64): each step takes the dataset whose
    achieved count lags its weighted target most (first one on ties)."""
    weights = [float(w) for w in weights]
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    counts = [0] * len(weights)
    for sample in range(size):
        # Megatron uses max(sample, 1) so the very first pick already follows the weights.
        scale = float(max(sample, 1))
        best, best_error = 0, weights[0] * scale - counts[0]
        for dataset in range(1, len(weights)):
            error = weights[dataset] * scale - counts[dataset]
            if error > best_error:
                best, best_error = dataset, error
        dataset_index[sample] = best
        dataset_sample_index[sample] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Blend exactly `sizes[d]` samples of each dataset, interleaved in proportion to the sizes."""
    total = int(sum(sizes))
    weights = [size / float(total) for size in sizes]
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    counts = [0] * len(sizes)
    unspent = [d for d in range(len(sizes)) if sizes[d] > 0]
    for sample in range(total):
        scale = float(max(sample, 1))
        best, best_error = -1, -math.inf
        for dataset in unspent:  # ascending order, strict > keeps the first on ties
            error = weights[dataset] * scale - counts[dataset]
            if error > best_error:
                best, best_error = dataset, error
        dataset_index[sample] = best
        dataset_sample_index[sample] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, dataset_sample_index


# ----------------------------------------------------------------------------- GPT indices


@dataclasses.dataclass(frozen=True)
class GPTIndices:
    """Megatron's three arrays for one dataset split.

    document_index: [num_epochs * num_docs] sequence ids in reading order.
    sample_index:   [num_samples + 1, 2] (position in document_index, token offset) where each
                    sample starts; sample i ends where sample i + 1 starts, plus one token.
    shuffle_index:  [num_samples] permutation: the i-th sample read is sample shuffle_index[i].
    """

    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """Fewest epochs whose tokens cover `num_samples` samples (one extra token for the last label)."""
    if num_samples is None:
        return 1
    tokens_requested = num_samples * seq_length + 1
    return max(1, -(-tokens_requested // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(document_index)
        return document_index
    first_epochs = build_document_index(documents, num_epochs - 1, rng, False)
    final_epoch = build_document_index(documents, 1, rng, False)
    return np.concatenate((first_epochs, final_epoch))


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """[num_samples + 1, 2] start (document_index position, offset) of every sample.

    Sample i starts at token i * seq_length of the document stream; its start is located in the
    last document whose first token is at or before that position (empty documents are skipped,
    except that sample 0 always starts at (0, 0)).
    """
    lengths_in_order = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    document_starts = np.zeros(len(lengths_in_order) + 1, dtype=np.int64)
    np.cumsum(lengths_in_order, out=document_starts[1:])
    sample_starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(document_starts, sample_starts, side="right") - 1
    offsets = sample_starts - document_starts[positions]
    # Megatron records the first start as (0, 0) even when leading documents are empty.
    positions[0], offsets[0] = 0, 0
    return np.stack([positions, offsets], axis=1)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffle [0, num_samples) and, separately, [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray,
    *,
    seq_length: int,
    seed: int,
    num_samples: int | None,
    name: str = "dataset",
) -> GPTIndices:
    """The indices megatron-core's GPTDataset builds (add_extra_token=True, drop last partial)."""
    if seq_length < 2:
        raise ValueError(f"seq_length must be >= 2, got {seq_length}")
    if len(documents) == 0:
        raise ConfigError(f"{name}: the split has no documents; give it a share of data.split or add data")
    tokens_per_epoch = int(np.asarray(sequence_lengths, dtype=np.int64)[documents].sum())
    if tokens_per_epoch < seq_length + 1:
        raise ConfigError(
            f"{name}: {tokens_per_epoch} tokens in the split, shorter than one sample of "
            f"data.seq_length + 1 = {seq_length + 1} tokens; lower data.seq_length or add data"
        )
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)

    separate_final_epoch = False
    samples_before_final_epoch = 0
    if num_epochs > 1:
        samples_before_final_epoch = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_from_final_epoch = num_samples - samples_before_final_epoch
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= samples_from_final_epoch <= samples_per_epoch + 1
        separate_final_epoch = samples_from_final_epoch < int(
            SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch
        )

    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, total_samples)
    shuffled_first = samples_before_final_epoch if separate_final_epoch else total_samples
    shuffle_index = build_shuffle_index(shuffled_first, total_samples, rng)
    return GPTIndices(document_index, sample_index, shuffle_index)


def read_sample(
    documents, indices: GPTIndices, sample: int, seq_length: int, pad_id: int
) -> np.ndarray:
    """Tokens of the `sample`-th sample read: `seq_length + 1` int64, padded with pad_id if short.

    `documents` is anything with `sequence_lengths` and `get(index, offset, length)`.
    """
    window = np.empty(seq_length + 1, dtype=np.int64)
    position, offset = (int(v) for v in indices.sample_index[int(indices.shuffle_index[sample])])
    filled = 0
    while filled < window.size and position < len(indices.document_index):
        sequence = int(indices.document_index[position])
        take = min(int(documents.sequence_lengths[sequence]) - offset, window.size - filled)
        window[filled : filled + take] = documents.get(sequence, offset, take)
        filled += take
        position, offset = position + 1, 0
    window[filled:] = pad_id
    return window
