"""Packing statistics per batch, and a CLI that recommends `kernel.max_segs` for a dataset.

    python -m lingpack.data.stats PREFIX [--seq-length 256] [--global-batch-size 8] [--micro-batches 1] ...
    python -m lingpack.data.stats PREFIX data.seq_length=8192 data.global_batch_size=64 train.micro_batches=4 \
        kernel.max_segs=64                                   # the same overrides as the run

A segment is a maximal run of equal non-zero `inputs_segmentation` ids in a row. The flattened
cu_seqlens design packs a whole `[B/M, T]` micro-batch (what one kernel call sees; M = micro-batches)
into one sequence, so the smallest `max_segs` that never overflows is the number of real segments in
the micro-batch (all its rows together); a per-row kernel needs the per-row maximum instead. With
`kernel.max_segs` the report also counts the micro-batches and documents a run would drop.
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


def dataset_report(cfg, *, num_batches: int | None = None, micro_batches: int = 1, max_segs: int | None = None) -> dict:
    """Walk the train batches of `cfg`, split each into `micro_batches`, and summarise packing; see `main`."""
    from lingpack.data.pipeline import make_dataset
    from lingpack.data.sampling import open_documents

    dataset = make_dataset(cfg, split="train", process_index=0, process_count=1)
    if cfg.global_batch_size % micro_batches:
        raise ValueError(f"global_batch_size={cfg.global_batch_size} does not split into micro_batches={micro_batches}")
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


# run.py overrides the CLI understands -> argparse destinations
RUN_OVERRIDES = {"data.seq_length": "seq_length", "data.global_batch_size": "global_batch_size",
                 "train.micro_batches": "micro_batches", "kernel.max_segs": "max_segs", "data.seed": "seed",
                 "data.eod_id": "eod_id", "data.num_samples": "num_samples", "data.split": "split"}


def _apply_run_overrides(args, parser) -> list[str]:
    """`key=value` words (run.py's spelling) set the matching options; returns the remaining words."""
    words = []
    for word in args.prefix:
        key, sep, value = word.partition("=")
        if not sep:
            words.append(word)
        elif key in RUN_OVERRIDES:
            setattr(args, RUN_OVERRIDES[key], value if key == "data.split" else int(value))
        else:
            parser.error(f"unknown override {word!r}; this tool reads {sorted(RUN_OVERRIDES)}")
    if not words:
        parser.error("give a dataset prefix (or Megatron blend words)")
    return words


def main(argv: list[str] | None = None) -> int:
    from lingpack.data.config import DataConfig

    parser = argparse.ArgumentParser(
        prog="python -m lingpack.data.stats",
        description="Packing statistics of a Megatron .bin/.idx dataset and a kernel.max_segs "
        "recommendation (flattened [1, B*T] cu_seqlens design).",
    )
    parser.add_argument("prefix", nargs="+", help="dataset prefix (or Megatron blend words), and run.py overrides "
                        "such as data.seq_length=8192 data.global_batch_size=64 train.micro_batches=4 kernel.max_segs=64")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=1, help="train.micro_batches: the kernel sees one at a time")
    parser.add_argument("--max-segs", type=int, default=None, help="kernel.max_segs: count what it would drop")
    parser.add_argument("--eod-id", type=int, default=None,
                        help="default: from the tokenizer record beside the prefix (written by preprocess)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="check token ids against it (default: no check)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--split", default="1,0,0")
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--num-batches", type=int, default=None, help="default: every batch")
    parser.add_argument("--no-reset-attention-mask", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    words = [w[:-4] if w.endswith((".bin", ".idx")) else w for w in _apply_run_overrides(args, parser)]
    if args.eod_id is None:
        args.eod_id = _recorded_eod_id(words, parser)
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
    report = dataset_report(cfg, num_batches=args.num_batches, micro_batches=args.micro_batches,
                            max_segs=args.max_segs)
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
            f"{report['segments_per_batch_max']} segments in a [{cfg.global_batch_size // args.micro_batches}, "
            f"{cfg.seq_length}] micro-batch, worst case {report['segments_per_batch_bound']})"
        )
        if args.max_segs is not None:
            print(f"kernel.max_segs={args.max_segs}: {report['micro_batches_over_max_segs']} micro-batches would "
                  f"drop {report['documents_dropped_at_max_segs']} documents in all")
    return 0


def _recorded_eod_id(words: list[str], parser) -> int:
    from lingpack.data.indices import parse_blend
    from lingpack.data.preprocess import read_tokenizer_record
    records = [read_tokenizer_record(prefix) for prefix in parse_blend(words)[0]]
    if any(r is None for r in records):
        parser.error("no tokenizer record beside the dataset (written by lingpack.data.preprocess): give --eod-id "
                     "(or data.eod_id=...)")
    return int(records[0]["eod_id"])


if __name__ == "__main__":
    sys.exit(main())
