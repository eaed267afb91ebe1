"""Random-access Megatron samples: datasets + GPT indices (+ blend indices) -> token windows.

`build_samples(cfg, split_name)` reproduces what megatron-core's BlendedMegatronDatasetBuilder
builds for one split: a single GPTDataset, or a BlendedDataset over several, with the same sample
counts, seeds and order. Indices are built here ("build") or memory-mapped from a Megatron run's
cache ("mmap_npy"). Item i of the result is the i-th sample Megatron reads: `seq_length + 1` tokens.
With `packing="whole_documents"` each dataset's samples are its packed rows instead (packing.py), and a
blend picks rows exactly as Megatron's blend picks samples.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import uuid

import numpy as np

from lingpack.data import indices as ix
from lingpack.data import megatron_cache
from lingpack.data.config import DataConfig
from lingpack.data.indexed import IndexedDataset
from lingpack.data.packing import PackedRows, build_packed_rows
from lingpack.data.sources import FlatTokenDocuments, SyntheticDocuments
from lingpack.errors import ConfigError

CACHE_FORMAT_VERSION = 1
log = logging.getLogger("lingpack.data")
_REPORTED: set = set()   # packed splits already reported by this process: the counts are logged once


class MegatronSamples:
    """`len()` samples; `[i]` -> int64 `[seq_length + 1]` window. Picklable (datasets re-open)."""

    def __init__(
        self,
        documents: list,
        gpt_indices: list,
        blend: tuple[np.ndarray, np.ndarray] | None,
        *,
        seq_length: int,
        pad_id: int,
        vocab_size: int | None,
        eod_id: int = -1,
    ) -> None:
        """`gpt_indices`: per dataset, its `GPTIndices` (Megatron samples) or `PackedRows` (whole documents)."""
        self.documents, self.gpt_indices, self.blend = documents, gpt_indices, blend
        self.seq_length, self.pad_id, self.vocab_size, self.eod_id = seq_length, pad_id, vocab_size, eod_id

    def __len__(self) -> int:
        return int(len(self.blend[0]) if self.blend is not None else len(self.gpt_indices[0]))

    def locate(self, sample: int) -> tuple[int, int]:
        """(dataset number, sample number within that dataset) of the blend's `sample`."""
        if self.blend is None:
            return 0, sample
        return int(self.blend[0][sample]), int(self.blend[1][sample])

    def __getitem__(self, sample: int) -> np.ndarray:
        sample = int(sample)
        if not 0 <= sample < len(self):
            raise IndexError(f"sample {sample} out of range [0, {len(self)})")
        dataset, dataset_sample = self.locate(sample)
        documents, indices = self.documents[dataset], self.gpt_indices[dataset]
        if isinstance(indices, PackedRows):
            window = indices.read(documents, dataset_sample, self.seq_length + 1, self.pad_id, self.eod_id)
        else:
            window = ix.read_sample(documents, indices, dataset_sample, self.seq_length, self.pad_id)
        if self.vocab_size is not None:
            bad = (window >= self.vocab_size) | ((window < 0) & (window != self.pad_id))
            if bad.any():
                raise ConfigError(
                    f"{documents.name}: token id {int(window[np.argmax(bad)])} in sample {sample} "
                    f"is outside the vocabulary [0, {self.vocab_size}); set data.vocab_size to the "
                    "tokenizer's vocabulary size or re-tokenize the data"
                )
        return window


def open_documents(cfg: DataConfig) -> tuple[list, list[str], list[float] | None]:
    """(document collections, their names for the cache, blend weights or None)."""
    if cfg.source == "synthetic":
        documents = SyntheticDocuments(
            num_documents=cfg.synthetic_num_documents,
            distribution=cfg.synthetic_length_distribution,
            mean_length=cfg.synthetic_mean_length,
            sigma=cfg.synthetic_length_sigma,
            min_length=cfg.synthetic_min_length,
            max_length=cfg.synthetic_max_length,
            vocab_size=cfg.vocab_size,
            eod_id=cfg.eod_id,
            pad_id=cfg.pad_id,
            seed=cfg.seed,
        )
        return [documents], ["synthetic"], None
    prefixes, weights = ix.parse_blend(cfg.paths)
    if cfg.source == "npy":
        return [FlatTokenDocuments(p, cfg.eod_id) for p in prefixes], prefixes, weights
    return [IndexedDataset(p) for p in prefixes], prefixes, weights


def build_samples(cfg: DataConfig, split_name: str = "train") -> MegatronSamples:
    documents, names, weights = open_documents(cfg)
    size = cfg.num_samples if split_name == "train" else cfg.eval_num_samples
    packed = cfg.packing == "whole_documents"
    if cfg.num_epochs is not None:
        if len(documents) > 1:
            raise ConfigError("data.num_epochs needs a single dataset; give a blend data.num_samples instead")
        size = None if packed else _samples_for_epochs(cfg, documents[0], split_name)

    def gpt(dataset: int, num_samples: int | None):
        if packed:
            return _packed_rows(cfg, documents[dataset], names[dataset], split_name, num_samples)
        return _gpt_indices(cfg, documents[dataset], names[dataset], split_name, num_samples)

    common = dict(seq_length=cfg.seq_length, pad_id=cfg.pad_id, eod_id=cfg.eod_id,
                  vocab_size=cfg.vocab_size if cfg.check_token_range else None)
    if len(documents) == 1 and weights is None:
        return MegatronSamples(documents, [gpt(0, size)], None, **common)

    if weights is not None:
        if size is None:
            raise ConfigError(
                f"a weighted blend needs a sample count for the {split_name} split: set "
                f"{'data.num_samples' if split_name == 'train' else 'data.eval_num_samples'}"
            )
        weights = ix.normalize_weights(weights)
        targets = ix.blend_sample_counts(weights, size)
        buffers = ix.blend_sample_counts(weights, size, ix.MID_LEVEL_DATASET_SURPLUS)
        per_dataset = [gpt(d, buffers[d]) for d in range(len(documents))]
        blend_size, blend_weights = sum(targets), ix.normalize_weights(weights)
    else:  # unweighted blend: weights are the datasets' one-epoch lengths
        per_dataset = [gpt(d, None) for d in range(len(documents))]
        lengths = [len(indices) for indices in per_dataset]
        blend_size = None if size is None else min(size, sum(lengths))
        blend_weights = None if blend_size is None else ix.normalize_weights(lengths)

    blend = _blend_indices(cfg, names, split_name, blend_weights, blend_size, per_dataset)
    counts = np.bincount(np.asarray(blend[0]), minlength=len(documents))
    for dataset, count in enumerate(counts):
        if count > len(per_dataset[dataset]):
            raise ValueError(
                f"{names[dataset]}: the {split_name} blend takes {count} samples from it but it "
                f"has {len(per_dataset[dataset])}; Megatron fails here too (raise its "
                "mid_level_dataset_surplus)"
            )
    return MegatronSamples(documents, per_dataset, blend, **common)


def _samples_for_epochs(cfg: DataConfig, documents, split_name: str) -> int | None:
    if cfg.num_epochs == 1:
        return None
    sequence_ids = ix.split_sequence_range(len(documents.sequence_lengths), cfg.split, split_name)
    tokens_per_epoch = int(np.asarray(documents.sequence_lengths, np.int64)[sequence_ids].sum())
    # This many samples spans exactly num_epochs epochs and never separates the final one.
    return (cfg.num_epochs * tokens_per_epoch - 1) // cfg.seq_length


def _gpt_indices(cfg, documents, name, split_name, num_samples) -> ix.GPTIndices:
    if cfg.index_mode == "mmap_npy":
        return megatron_cache.find_gpt_indices(
            cfg.cache_dir, dataset_path=name, split_name=split_name, split=cfg.split,
            seed=cfg.seed, seq_length=cfg.seq_length, num_samples=num_samples,
        )
    lengths = documents.sequence_lengths
    sequence_ids = ix.split_sequence_range(len(lengths), cfg.split, split_name)

    def build() -> dict[str, np.ndarray]:
        built = ix.build_gpt_indices(
            lengths, sequence_ids, seq_length=cfg.seq_length, seed=cfg.seed,
            num_samples=num_samples, name=f"{documents.name} ({split_name} split)",
        )
        return dict(document_index=built.document_index, sample_index=built.sample_index,
                    shuffle_index=built.shuffle_index)

    key = dict(kind="gpt", dataset=_fingerprint(cfg, documents, name), split=cfg.split,
               split_name=split_name, seed=cfg.seed, seq_length=cfg.seq_length,
               num_samples=num_samples)
    return ix.GPTIndices(**_cached(cfg.cache_dir if cfg.source != "synthetic" else None, key, build))


def _packed_rows(cfg, documents, name, split_name, num_rows) -> PackedRows:
    lengths = documents.sequence_lengths
    sequence_ids = ix.split_sequence_range(len(lengths), cfg.split, split_name)
    capacity = cfg.seq_length + 1    # a row is a window of T + 1 tokens: the last one is only a target
    epochs = cfg.num_epochs if split_name == "train" else None
    where = f"{documents.name} ({split_name} split)"

    def build() -> dict[str, np.ndarray]:
        rows = build_packed_rows(lengths, sequence_ids, capacity=capacity, open_rows=cfg.packing_open_rows,
                                 seed=cfg.seed, num_rows=num_rows, num_epochs=epochs, name=where)
        return dataclasses.asdict(rows)

    key = dict(kind="packed", dataset=_fingerprint(cfg, documents, name), split=cfg.split, split_name=split_name,
               seed=cfg.seed, capacity=capacity, open_rows=cfg.packing_open_rows, num_rows=num_rows,
               num_epochs=epochs)
    rows = PackedRows(**_cached(cfg.cache_dir if cfg.source != "synthetic" else None, key, build))
    reported = json.dumps(dict(key, name=where, documents=len(lengths)), sort_keys=True)
    if reported in _REPORTED:
        return rows
    _REPORTED.add(reported)
    stats = rows.stats(lengths, capacity)
    log.info("whole-document packing, %s: %d documents in %d rows of %d tokens, %.1f%% padding", where,
             stats["documents"], stats["rows"], cfg.seq_length, 100.0 * stats["padding_tokens"] / (len(rows) * capacity))
    if stats["cut_documents"]:
        log.warning("whole-document packing, %s: %d document(s) longer than a row of %d tokens cut into %d row-length "
                    "pieces (no token dropped; positions restart in each piece); raise data.seq_length to keep them "
                    "whole", where, stats["cut_documents"], cfg.seq_length, stats["cut_pieces"])
    return rows


def _blend_indices(cfg, names, split_name, weights, size, per_dataset):
    if cfg.index_mode == "mmap_npy":
        return megatron_cache.find_blend_indices(
            cfg.cache_dir, dataset_paths=names, split_name=split_name, size=size
        )

    def build() -> dict[str, np.ndarray]:
        if size is None:
            built = ix.build_exhaustive_blending_indices([len(i) for i in per_dataset])
        else:
            built = ix.build_blending_indices(weights, size)
        return dict(dataset_index=built[0], dataset_sample_index=built[1])

    key = dict(kind="blend", datasets=[os.path.realpath(n) for n in names], split=cfg.split,
               split_name=split_name, seed=cfg.seed, seq_length=cfg.seq_length,
               weights=weights, size=size, lengths=[len(i) for i in per_dataset])
    arrays = _cached(cfg.cache_dir, key, build)
    return arrays["dataset_index"], arrays["dataset_sample_index"]


def _fingerprint(cfg: DataConfig, documents, name: str) -> dict:
    if cfg.source == "synthetic":
        return {"synthetic": True}
    path = getattr(documents, "data_file", name)
    status = os.stat(path)
    return dict(path=os.path.realpath(path), bytes=status.st_size, mtime_ns=status.st_mtime_ns)


def _cached(cache_dir: str | None, key: dict, build) -> dict[str, np.ndarray]:
    """Build arrays, or load them from `cache_dir` where an identical key already saved them."""
    if cache_dir is None:
        return build()
    description = json.dumps({"version": CACHE_FORMAT_VERSION, **key}, sort_keys=True)
    digest = hashlib.md5(description.encode("utf-8")).hexdigest()
    base = os.path.join(cache_dir, f"{digest}-lingpack-{key['kind']}-{key['split_name']}")
    marker = base + "-description.json"
    if os.path.isfile(marker):
        names = json.load(open(marker, encoding="utf-8"))["arrays"]
        return {n: np.load(f"{base}-{n}.npy", mmap_mode="r", allow_pickle=False) for n in names}
    arrays = build()
    os.makedirs(cache_dir, exist_ok=True)
    for array_name, array in arrays.items():
        temporary = f"{base}-{array_name}.{uuid.uuid4().hex}.tmp.npy"
        np.save(temporary, array, allow_pickle=False)
        os.replace(temporary, f"{base}-{array_name}.npy")  # atomic: concurrent hosts never see halves
    temporary = f"{marker}.{uuid.uuid4().hex}.tmp"
    with open(temporary, "w", encoding="utf-8") as stream:
        json.dump({"key": json.loads(description), "arrays": sorted(arrays)}, stream, indent=1)
    os.replace(temporary, marker)
    return arrays
