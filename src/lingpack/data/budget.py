"""What a run's data holds against what the run will read, checked when the config is built.

Per dataset and split (Megatron's `data.split` shares of the documents): documents, tokens and samples
per epoch (`(tokens - 1) // seq_length`: a sample is seq_length + 1 tokens, consecutive samples share one).
A run reads `data.num_samples` training samples (Megatron's `train_iters x global_batch_size` unless set),
as many epochs as that takes; the valid and test splits are sized like Megatron's (train/evaluate.py).
`check` raises a `ConfigError` naming the keys to change when a split the run needs cannot give one
sample, or when an explicit `num_samples` / `num_epochs` / unweighted blend holds fewer samples than the
run reads; it returns the lines to say once at start (a test split with no documents: no test evaluation).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lingpack.data import indices as ix
from lingpack.data.config import DataConfig
from lingpack.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SplitShare:
    """One dataset's share of one split."""

    dataset: str
    split: str
    documents: int
    tokens: int
    samples_per_epoch: int


def shares(cfg: DataConfig) -> dict[str, list[SplitShare]]:
    """Per split, every dataset's share of it (documents 0 when data.split gives that split nothing)."""
    from lingpack.data.sampling import open_documents
    documents, names, _ = open_documents(cfg)
    out = {split: [] for split in ix.SPLIT_NAMES}
    for docs, name in zip(documents, names):
        lengths = np.asarray(docs.sequence_lengths, dtype=np.int64)
        for split in ix.SPLIT_NAMES:
            if ix.split_bookends(cfg.split)[ix.split_index(split)] is None:
                ids = np.zeros(0, dtype=np.int64)
            else:
                ids = ix.split_sequence_range(len(lengths), cfg.split, split)
            tokens = int(lengths[ids].sum())
            out[split].append(SplitShare(name, split, int(ids.size), tokens, max(0, (tokens - 1) // cfg.seq_length)))
    return out


def _describe(share: SplitShare, cfg: DataConfig, total_documents: int) -> str:
    holds = (f"{share.documents} of {total_documents} documents, {share.tokens:,} tokens" if share.documents
             else f"none of its {total_documents} documents")
    return f"the {share.split} split of {share.dataset} (data.split={cfg.split!r} gives it {holds})"


def check(cfg: DataConfig, *, train_samples: int, eval_samples: dict[str, int]) -> tuple[list[str], bool]:
    """ConfigError when the data cannot give the run its samples; else (lines to say once at start, whether
    the test split can be evaluated).

    `eval_samples` holds the valid / test sample counts of the splits the run evaluates ({} when none).
    A test split too small for one sample is a note (Megatron skips its test evaluation then), not an error.
    """
    if cfg.source == "synthetic":
        return [], True
    _, weights = ix.parse_blend(cfg.paths)
    by_split = shares(cfg)
    totals = [sum(column) for column in zip(*([s.documents for s in by_split[k]] for k in ix.SPLIT_NAMES))]
    notes, test = [], True
    for split in ("train", *eval_samples):
        short = [(s, total) for s, total in zip(by_split[split], totals) if s.samples_per_epoch == 0]
        if short:
            share, total = short[0]
            where = _describe(share, cfg, total)
            one_sample = f"one sample of data.seq_length + 1 = {cfg.seq_length + 1} tokens"
            if split == "test":
                notes.append(f"no test evaluation: {where}, less than {one_sample}; give test a larger share of "
                             "data.split, or set train.eval_test=false")
                test = False
                continue
            fix = ("lower data.seq_length or add documents" if split == "train" else
                   f"give {split} a larger share of data.split (e.g. 'data.split=\"90,10,0\"'), lower "
                   "data.seq_length, or set train.eval_every=0")
            raise ConfigError(f"{where}, less than {one_sample}; {fix}")
        _check_sample_count(cfg, split, by_split[split], weights,
                            train_samples if split == "train" else eval_samples[split])
    return notes, test


def _check_sample_count(cfg: DataConfig, split: str, found: list[SplitShare], weights, needed: int) -> None:
    """An explicit epoch count, sample count or an unweighted blend can hold fewer samples than the run reads."""
    if split == "train" and cfg.num_epochs is not None:
        share = found[0]
        available = (cfg.num_epochs * share.tokens - 1) // cfg.seq_length
        if available < needed:
            raise ConfigError(f"data.num_epochs={cfg.num_epochs} gives {available} train samples, but the run reads "
                              f"{needed} (train.steps x data.global_batch_size); raise data.num_epochs, or set it to "
                              "null to read as many epochs as the run needs")
        return
    given = cfg.num_samples if split == "train" else cfg.eval_num_samples
    if given is not None and given < needed:
        key = "data.num_samples" if split == "train" else "data.eval_num_samples"
        reads = "train.steps x data.global_batch_size" if split == "train" else "Megatron's evaluation count"
        raise ConfigError(f"{key}={given}, but the run reads {needed} {split} samples ({reads}); raise it or set "
                          "it to null")
    if len(found) > 1 and weights is None:  # an unweighted blend reads one epoch of each dataset
        available = sum(s.samples_per_epoch for s in found)
        if available < needed:
            raise ConfigError(f"the unweighted blend data.paths={list(cfg.paths)} holds {available} {split} samples "
                              f"(one epoch of each dataset), but the run reads {needed}; give each prefix a weight "
                              "(Megatron then reads as many epochs as needed) or lower train.steps")
