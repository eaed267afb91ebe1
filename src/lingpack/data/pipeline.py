"""The Grain pipeline: Megatron samples -> this host's rows -> split -> batch -> prefetch.

(The per-host selection comes before split and batch so each host reads only its own rows.)

    make_iterator(cfg, split="train")  ->  grain DatasetIterator of batches

A batch is a dict of int32 numpy arrays `[global_batch_size / process_count, seq_length]` with keys
`inputs, targets, inputs_segmentation, targets_segmentation, inputs_position, targets_position`
(see `split.py`). Global batch k holds samples `[k * B, (k + 1) * B)` in Megatron's reading order;
host h of P takes rows `[h * B / P, (h + 1) * B / P)` of it (or the rows its devices hold, `rows=`),
so the union over hosts is exactly Megatron's global batch. A trailing partial global batch is dropped.

Shuffling and epochs live in Megatron's indices (see `indices.py`), not in Grain, which is why the
pipeline is a `MapDataset` end to end until `to_iter_dataset`: the iterator's state is just the next
batch number and `get_state()` / `set_state()` resume at exactly the next batch.
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from lingpack.data.config import DataConfig
from lingpack.data.sampling import MegatronSamples, build_samples
from lingpack.data.split import BATCH_KEYS, SplitOptions, split_window
from lingpack.errors import ConfigError

__all__ = ["DataConfig", "make_dataset", "make_iterator", "BATCH_KEYS"]


@dataclasses.dataclass(frozen=True)
class HostRows:
    """Samples this host reads, in order: rows `row_ids` of each global batch."""

    samples: MegatronSamples
    global_batch_size: int
    row_ids: tuple[int, ...]

    @property
    def rows_per_host(self) -> int:
        return len(self.row_ids)

    def __len__(self) -> int:
        return (len(self.samples) // self.global_batch_size) * self.rows_per_host

    def __getitem__(self, row: int) -> np.ndarray:
        batch, row_in_host = divmod(int(row), self.rows_per_host)
        return self.samples[batch * self.global_batch_size + self.row_ids[row_in_host]]


@dataclasses.dataclass(frozen=True)
class SplitWindow:
    """Grain map step: token window -> dict of int32 arrays (picklable for worker processes)."""

    options: SplitOptions

    def __call__(self, window: np.ndarray) -> dict[str, np.ndarray]:
        return split_window(window, self.options)


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.stack([row[key] for row in rows]) for key in BATCH_KEYS}


def _ensure_absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags; outside an absl app nobody parsed them, so take
    the defaults (otherwise Grain raises UnparsedFlagAccessError)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _processes(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax  # only asked when the caller did not say

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    return int(process_index), int(process_count)


def make_dataset(
    cfg: DataConfig,
    *,
    split: str = "train",
    process_index: int | None = None,
    process_count: int | None = None,
    rows: tuple[int, ...] | None = None,
) -> grain.MapDataset:
    """The host's batches as a random-access Grain MapDataset (batch k = this host's rows of k).

    `rows`: the rows of every global batch this host reads (`distributed.process_rows` of the batch
    sharding); default: block `process_index` of `process_count` equal contiguous blocks.
    """
    B = cfg.global_batch_size
    if rows is None:
        process_index, process_count = _processes(process_index, process_count)
        if B % process_count:
            raise ValueError(
                f"global_batch_size {B} is not divisible by the "
                f"{process_count} processes; make it a multiple of {process_count}"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        rows = tuple(range(process_index * B // process_count, (process_index + 1) * B // process_count))
    if not rows or any(not 0 <= r < B for r in rows):
        raise ValueError(f"host rows {rows} must be a non-empty subset of the global batch's rows [0, {B})")
    samples = build_samples(cfg, split)
    if len(samples) < cfg.global_batch_size:
        raise ConfigError(
            f"the {split} split has {len(samples)} samples, fewer than one global batch of "
            f"{cfg.global_batch_size}; add data, lower data.global_batch_size or raise data.num_samples"
        )
    host_rows = HostRows(samples, B, tuple(int(r) for r in rows))
    return (
        grain.MapDataset.source(host_rows)
        .map(SplitWindow(cfg.split_options()))
        .batch(host_rows.rows_per_host, drop_remainder=True, batch_fn=_stack)
    )


def make_iterator(
    cfg: DataConfig,
    *,
    split: str = "train",
    process_index: int | None = None,
    process_count: int | None = None,
    rows: tuple[int, ...] | None = None,
) -> grain.DatasetIterator:
    """An iterator of this host's batches whose `get_state()` / `set_state()` resume exactly."""
    dataset = make_dataset(
        cfg, split=split, process_index=process_index, process_count=process_count, rows=rows
    )
    read_options = grain.ReadOptions(
        num_threads=cfg.read_threads, prefetch_buffer_size=cfg.prefetch_buffer_size
    )
    iterable = dataset.to_iter_dataset(read_options)
    if cfg.worker_count > 0:
        _ensure_absl_flags_parsed()
        iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    return iter(iterable)
