"""Packing statistics per batch and per dataset, and the `kernel.max_segs` they recommend.

`python -m lingpack.data.stats` (data/stats.py) prints `dataset_report` for a run's data config.
A segment is a maximal run of equal non-zero `inputs_segmentation` ids in a row. The flattened
cu_seqlens design packs a whole `[B/M, T]` micro-batch (what one kernel call sees; M = micro-batches)
into one sequence, so the smallest `max_segs` that never overflows is the number of real segments in
the micro-batch (all its rows together); a per-row kernel needs the per-row maximum instead. With
`kernel.max_segs` the report also counts the micro-batches and documents a run would drop.
"""

from __future__ import annotations

import math

import numpy as np

from lingpack.data.pipeline import make_dataset
from lingpack.data.sampling import open_documents
from lingpack.errors import ConfigError


def segment_lengths(segmentation_BT: np.ndarray) -> list[np.ndarray]:
    """Per row, the lengths of its real (non-zero id) segments in order."""
    result = []
    for row in np.asarray(segmentation_BT):
        starts = np.flatnonzero(np.diff(row, prepend=row[:1] - 1) != 0)  # a new run starts here
        lengths = np.diff(np.append(starts, row.size))
        result.append(lengths[row[starts] != 0])
    return result


def batch_stats(batch: dict[str, np.ndarray]) -> dict[str, float]:
    """Segments per row, document (segment) lengths, and the minimal safe `max_segs`."""
    segmentation = np.asarray(batch["inputs_segmentation"])
    rows, length = segmentation.shape
    per_row = segment_lengths(segmentation)
    segments_per_row = np.array([lengths.size for lengths in per_row])
    all_lengths = np.concatenate(per_row) if per_row else np.zeros(0, dtype=np.int64)
    real_tokens = int(np.count_nonzero(segmentation))
    return {
        "segments_per_row_mean": float(segments_per_row.mean()),
        "segments_per_row_max": int(segments_per_row.max()),
        "doc_length_mean": float(all_lengths.mean()) if all_lengths.size else 0.0,
        "doc_length_min": int(all_lengths.min()) if all_lengths.size else 0,
        "doc_length_max": int(all_lengths.max()) if all_lengths.size else 0,
        # Flattened [1, B*T] design: every real segment of every row needs a cu_seqlens slot.
        "min_safe_max_segs": int(segments_per_row.sum()),
        "min_safe_max_segs_per_row": int(segments_per_row.max()),
        "padding_fraction": 1.0 - real_tokens / float(rows * length),
        "loss_tokens": int(np.count_nonzero(np.asarray(batch["targets_segmentation"]))),
    }


def segment_bound(min_document_length: int, seq_length: int, rows: int) -> int:
    """Most segments any batch can hold: each row has one partial document to start, then one
    more per EOD among its first T - 1 tokens, EODs being >= min_document_length apart."""
    per_row = 1 + math.ceil((seq_length - 1) / max(1, min_document_length))
    return rows * min(seq_length, per_row)


def recommend_max_segs(observed_max: int, bound: int) -> tuple[int, bool]:
    """(max_segs, guaranteed): the worst-case bound when it costs at most 2x the observed maximum,
    else the observed maximum plus 25% headroom; rounded up to a multiple of 8."""
    def round_up(value: int) -> int:
        return max(8, -(-value // 8) * 8)

    if bound <= 2 * observed_max:
        return round_up(bound), True
    return round_up(math.ceil(1.25 * observed_max)), False


def dataset_report(cfg, *, num_batches: int | None = None, micro_batches: int = 1, max_segs: int | None = None) -> dict:
    """Walk the train batches of `cfg`, split each into `micro_batches`, and summarise packing; see `main`."""
    if cfg.global_batch_size % micro_batches:
        raise ConfigError(f"data.global_batch_size={cfg.global_batch_size} does not split into train.micro_batches="
                          f"{micro_batches}")
    dataset = make_dataset(cfg, split="train", process_index=0, process_count=1)
    rows = cfg.global_batch_size // micro_batches
    total = len(dataset) if num_batches is None else min(num_batches, len(dataset))
    flat, per_row = [], []
    for batch_number in range(total):
        batch = dataset[batch_number]
        for m in range(micro_batches):
            stats = batch_stats({k: np.asarray(v)[m * rows:(m + 1) * rows] for k, v in batch.items()})
            flat.append(stats["min_safe_max_segs"])
            per_row.append(stats["min_safe_max_segs_per_row"])
    documents = open_documents(cfg)[0]
    document_lengths = np.concatenate([np.asarray(d.sequence_lengths) for d in documents])
    flat_array = np.asarray(flat)
    bound = segment_bound(int(document_lengths.min()), cfg.seq_length, rows)
    recommended, guaranteed = recommend_max_segs(int(flat_array.max()), bound)
    overflow = {}
    if max_segs is not None:
        overflow = {"max_segs": max_segs, "micro_batches_over_max_segs": int(np.sum(flat_array > max_segs)),
                    "documents_dropped_at_max_segs": int(np.sum(np.maximum(flat_array - max_segs, 0)))}
    return {
        "batches_read": total,
        "global_batch_size": cfg.global_batch_size,
        "micro_batches": micro_batches,
        "seq_length": cfg.seq_length,
        "documents": int(document_lengths.size),
        "document_length_mean": float(document_lengths.mean()),
        "document_length_median": float(np.median(document_lengths)),
        "document_length_min": int(document_lengths.min()),
        "document_length_max": int(document_lengths.max()),
        "segments_per_batch_mean": float(flat_array.mean()),  # per micro-batch (the kernel's unit)
        "segments_per_batch_p99": float(np.percentile(flat_array, 99)),
        "segments_per_batch_max": int(flat_array.max()),
        "segments_per_row_max": int(max(per_row)),
        "segments_per_batch_bound": bound,
        "recommended_max_segs": recommended,
        "recommendation_is_guaranteed": guaranteed,
        **overflow,
    }
