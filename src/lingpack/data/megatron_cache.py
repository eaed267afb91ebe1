"""Find and memory-map the index `.npy` files a Megatron run cached ("mmap_npy" index mode).

megatron-core names its cached files `<md5>-<Class>-<split>-<what>.npy` where `<md5>` hashes the
JSON in the sibling `<md5>-<Class>-<split>-description.txt`:

    GPTDataset:     document_index.npy, sample_index.npy, shuffle_index.npy
    BlendedDataset: dataset_index.npy, dataset_sample_index.npy

The hash covers Megatron's tokenizer description, which lingpack cannot reproduce, so instead of
recomputing it we read every description in the cache directory and pick the one whose dataset
path, split, seed, sequence length and sample count match the run, checking the hash on the way.
With no `--data-cache-path`, Megatron caches GPT indices in `<prefix>/cache/GPTDataset_indices`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

import numpy as np

from lingpack.data.indices import GPTIndices, parse_split
from lingpack.errors import ConfigError, MissingFileError


def default_cache_dir(prefix: str) -> str:
    return os.path.join(prefix, "cache", "GPTDataset_indices")


def _descriptions(cache_dir: str, class_name: str, split_name: str) -> list[tuple[str, dict]]:
    pattern = os.path.join(glob.escape(cache_dir), f"*-{class_name}-{split_name}-description.txt")
    found = []
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8") as stream:
            text = stream.read()
        file_hash = os.path.basename(path).split("-", 1)[0]
        text_hash = hashlib.md5(text.encode("utf-8")).hexdigest()
        if text_hash != file_hash:
            raise ConfigError(
                f"{path}: its content hashes to {text_hash}, not to its name; the Megatron cache "
                "was edited or is corrupt, rebuild it"
            )
        found.append((path[: -len("description.txt")], json.loads(text)))
    return found


def _same_path(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def _same_split(a: str | None, b: str) -> bool:
    try:
        return a is None or parse_split(a) == parse_split(b)
    except ValueError:
        return False


def _summary(description: dict) -> str:
    keys = ("dataset_path", "index_split", "random_seed", "sequence_length", "num_samples", "split")
    return "{" + ", ".join(f"{k}={description.get(k)!r}" for k in keys) + "}"


def find_gpt_indices(
    cache_dir: str | None,
    *,
    dataset_path: str,
    split_name: str,
    split: str,
    seed: int,
    seq_length: int,
    num_samples: int | None,
) -> GPTIndices:
    """Memory-map the GPTDataset indices Megatron cached for this dataset and split."""
    cache_dir = cache_dir or default_cache_dir(dataset_path)
    candidates = _descriptions(cache_dir, "GPTDataset", split_name)
    matches = [
        (base, d)
        for base, d in candidates
        if _same_path(str(d.get("dataset_path")), dataset_path)
        and d.get("random_seed") == seed
        and d.get("sequence_length") == seq_length
        and d.get("num_samples") == num_samples
        and _same_split(d.get("split"), split)
    ]
    want = _summary(
        dict(dataset_path=dataset_path, index_split=split_name, random_seed=seed,
             sequence_length=seq_length, num_samples=num_samples, split=split)
    )
    if not matches:
        have = "; ".join(_summary(d) for _, d in candidates) or "none"
        raise MissingFileError(
            f"{cache_dir}: no Megatron GPTDataset {split_name} indices for {want}. Found: {have}. "
            "Point data.cache_dir at the Megatron run's --data-cache-path and use its seed, seq_length, "
            "split and sample count (data.num_samples: its train iterations x global batch size), or use "
            "data.index_mode=build"
        )
    if len(matches) > 1:
        raise ConfigError(
            f"{cache_dir}: {len(matches)} cached GPTDataset index sets match {want} (they differ "
            f"in tokenizer or other fields): {[base for base, _ in matches]}; keep one"
        )
    base = matches[0][0]
    return GPTIndices(
        document_index=np.load(base + "document_index.npy", mmap_mode="r", allow_pickle=False),
        sample_index=np.load(base + "sample_index.npy", mmap_mode="r", allow_pickle=False),
        shuffle_index=np.load(base + "shuffle_index.npy", mmap_mode="r", allow_pickle=False),
    )


def find_blend_indices(
    cache_dir: str | None, *, dataset_paths: list[str], split_name: str, size: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map Megatron's BlendedDataset (dataset_index, dataset_sample_index) for a blend."""
    if cache_dir is None:
        raise ConfigError(
            "data.index_mode=mmap_npy with a blend needs data.cache_dir: Megatron caches blend indices "
            "only under --data-cache-path"
        )
    candidates = _descriptions(cache_dir, "BlendedDataset", split_name)
    matches = []
    for base, description in candidates:
        paths = [str(d.get("dataset_path")) for d in description.get("datasets", [])]
        if (
            len(paths) == len(dataset_paths)
            and all(_same_path(a, b) for a, b in zip(paths, dataset_paths))
            and description.get("size") == size
        ):
            matches.append(base)
    if len(matches) != 1:
        raise MissingFileError(
            f"{cache_dir}: expected one cached Megatron BlendedDataset {split_name} index for "
            f"datasets {dataset_paths} with size {size}, found {len(matches)} ({matches})"
        )
    base = matches[0]
    return (
        np.load(base + "dataset_index.npy", mmap_mode="r", allow_pickle=False),
        np.load(base + "dataset_sample_index.npy", mmap_mode="r", allow_pickle=False),
    )
