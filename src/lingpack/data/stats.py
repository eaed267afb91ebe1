"""Packing statistics per batch, and a CLI that recommends `kernel.max_segs` for a dataset.

    python -m lingpack.data.stats PREFIX [--seq-length 256] [--global-batch-size 8] ...

A segment is a maximal run of equal non-zero `inputs_segmentation` ids in a row. The flattened
cu_seqlens design packs a whole `[B, T]` batch into one sequence, so the smallest `max_segs` that
never overflows is the number of real segments in the batch (all rows together); a per-row kernel
needs the per-row maximum instead.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np


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


def dataset_report(cfg, *, num_batches: int | None = None) -> dict:
    """Walk the train batches of `cfg` and summarise packing; see `main`."""
    from lingpack.data.pipeline import make_dataset
    from lingpack.data.sampling import open_documents

    dataset = make_dataset(cfg, split="train", process_index=0, process_count=1)
    total = len(dataset) if num_batches is None else min(num_batches, len(dataset))
    flat, per_row, lengths = [], [], []
    for batch_number in range(total):
        stats = batch_stats(dataset[batch_number])
        flat.append(stats["min_safe_max_segs"])
        per_row.append(stats["min_safe_max_segs_per_row"])
        lengths.append(stats["doc_length_mean"])
    documents = open_documents(cfg)[0]
    document_lengths = np.concatenate([np.asarray(d.sequence_lengths) for d in documents])
    flat_array = np.asarray(flat)
    bound = segment_bound(int(document_lengths.min()), cfg.seq_length, cfg.global_batch_size)
    recommended, guaranteed = recommend_max_segs(int(flat_array.max()), bound)
    return {
        "batches_read": total,
        "global_batch_size": cfg.global_batch_size,
        "seq_length": cfg.seq_length,
        "documents": int(document_lengths.size),
        "document_length_mean": float(document_lengths.mean()),
        "document_length_median": float(np.median(document_lengths)),
        "document_length_min": int(document_lengths.min()),
        "document_length_max": int(document_lengths.max()),
        "segments_per_batch_mean": float(flat_array.mean()),
        "segments_per_batch_p99": float(np.percentile(flat_array, 99)),
        "segments_per_batch_max": int(flat_array.max()),
        "segments_per_row_max": int(max(per_row)),
        "segments_per_batch_bound": bound,
        "recommended_max_segs": recommended,
        "recommendation_is_guaranteed": guaranteed,
    }


def main(argv: list[str] | None = None) -> int:
    from lingpack.data.config import DataConfig

    parser = argparse.ArgumentParser(
        prog="python -m lingpack.data.stats",
        description="Packing statistics of a Megatron .bin/.idx dataset and a kernel.max_segs "
        "recommendation (flattened [1, B*T] cu_seqlens design).",
    )
    parser.add_argument("prefix", nargs="+", help="dataset prefix (or Megatron blend words)")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--eod-id", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="check token ids against it (default: no check)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--split", default="1,0,0")
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--num-batches", type=int, default=None, help="default: every batch")
    parser.add_argument("--no-reset-attention-mask", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    words = [w[:-4] if w.endswith((".bin", ".idx")) else w for w in args.prefix]
    cfg = DataConfig(
        source="megatron",
        paths=tuple(words),
        split=args.split,
        seq_length=args.seq_length,
        global_batch_size=args.global_batch_size,
        seed=args.seed,
        eod_id=args.eod_id,
        vocab_size=args.vocab_size or (2**31 - 1),
        check_token_range=args.vocab_size is not None,
        num_samples=args.num_samples,
        reset_attention_mask=not args.no_reset_attention_mask,
    )
    report = dataset_report(cfg, num_batches=args.num_batches)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:>28}: {value}")
        kind = (
            "covers the worst case for these document lengths"
            if report["recommendation_is_guaranteed"]
            else "empirical: other seeds may overflow, which the kernel must count or reject"
        )
        print(
            f"\nrecommend kernel.max_segs={report['recommended_max_segs']} ({kind}; observed max "
            f"{report['segments_per_batch_max']} segments in a [{cfg.global_batch_size}, "
            f"{cfg.seq_length}] batch, worst case {report['segments_per_batch_bound']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
