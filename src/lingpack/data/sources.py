"""Document collections other than Megatron `.bin/.idx`: synthetic documents and flat `.npy` tokens.

Every collection offers what the Megatron index code needs: `sequence_lengths` (int32, one per
document), `get(index, offset, length)` and a `name` for error messages. Each document ends with
the EOD token, as Megatron's `--append-eod` preprocessing leaves them.
"""

from __future__ import annotations

import os

import numpy as np

from lingpack.errors import ConfigError, MissingFileError


def synthetic_lengths(
    num_documents: int,
    distribution: str,
    mean_length: float,
    sigma: float,
    min_length: int,
    max_length: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Document lengths (EOD included) drawn from a named distribution, clipped to [min, max]."""
    if distribution == "lognormal":
        # mu chosen so that the (unclipped) mean is mean_length: E[exp(N(mu, s^2))] = exp(mu + s^2/2).
        mu = np.log(mean_length) - 0.5 * sigma**2
        raw = rng.lognormal(mu, sigma, num_documents)
    elif distribution == "exponential":
        raw = rng.exponential(mean_length, num_documents)
    elif distribution == "uniform":
        raw = rng.uniform(min_length, max_length + 1, num_documents)
    elif distribution == "fixed":
        raw = np.full(num_documents, float(mean_length))
    else:
        raise ValueError(f"unknown length distribution {distribution!r}")
    return np.clip(np.floor(raw), min_length, max_length).astype(np.int32)


class SyntheticDocuments:
    """Random documents of random lengths, deterministic in `seed`; tokens avoid eod and pad."""

    name = "synthetic"

    def __init__(
        self,
        *,
        num_documents: int,
        distribution: str,
        mean_length: float,
        sigma: float,
        min_length: int,
        max_length: int,
        vocab_size: int,
        eod_id: int,
        pad_id: int,
        seed: int,
    ) -> None:
        rng = np.random.default_rng(seed)
        self.sequence_lengths = synthetic_lengths(
            num_documents, distribution, mean_length, sigma, min_length, max_length, rng
        )
        ordinary = np.setdiff1d(np.arange(vocab_size), [eod_id, pad_id])
        total = int(self.sequence_lengths.sum(dtype=np.int64))
        self.tokens = ordinary[rng.integers(0, ordinary.size, total)].astype(np.int32)
        self.starts = np.zeros(num_documents + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=self.starts[1:])
        self.tokens[self.starts[1:] - 1] = eod_id  # the last token of every document is its EOD

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self.starts[index]) + offset
        end = int(self.starts[index + 1]) if length is None else start + length
        return self.tokens[start:end]


class FlatTokenDocuments:
    """A 1-D `.npy` of token ids; a document ends after each `eod_id` (a trailing tail is one more)."""

    def __init__(self, path: str, eod_id: int) -> None:
        self.path, self.eod_id = str(path), eod_id
        self._open()

    @property
    def name(self) -> str:
        return self.path

    def __getstate__(self) -> dict:
        return {"path": self.path, "eod_id": self.eod_id}

    def __setstate__(self, state: dict) -> None:
        self.path, self.eod_id = state["path"], state["eod_id"]
        self._open()

    def _open(self) -> None:
        if not os.path.isfile(self.path):
            raise MissingFileError(f"{self.path}: token file not found (data.paths, data.source=npy)")
        try:
            self.tokens = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except ValueError as error:
            raise ConfigError(f"{self.path}: not a readable .npy token array ({error})") from error
        if self.tokens.ndim != 1 or self.tokens.dtype.kind not in "iu":
            raise ConfigError(
                f"{self.path}: expected a 1-D integer token array, got {self.tokens.dtype} "
                f"of shape {self.tokens.shape}"
            )
        if self.tokens.size == 0:
            raise ConfigError(f"{self.path}: the token array is empty")
        ends = np.flatnonzero(np.asarray(self.tokens) == self.eod_id) + 1
        if ends.size == 0 or ends[-1] != self.tokens.size:
            ends = np.append(ends, self.tokens.size)
        self.starts = np.concatenate([[0], ends]).astype(np.int64)
        self.sequence_lengths = np.diff(self.starts).astype(np.int32)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self.starts[index]) + offset
        end = int(self.starts[index + 1]) if length is None else start + length
        return self.tokens[start:end]
