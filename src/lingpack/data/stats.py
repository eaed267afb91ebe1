"""`python -m lingpack.data.stats`: packing statistics of a run's training data and a `kernel.max_segs`
recommendation, for the data config the run would use.

    python -m lingpack.data.stats                                    # the default run: the bundled corpus
    python -m lingpack.data.stats kernel=chunked_aligned kernel.max_segs=16    # what that run would drop
    python -m lingpack.data.stats data=megatron 'data.paths=[data/shakespeare]' data.seq_length=1024 \
        data.global_batch_size=16 train.micro_batches=2
    python -m lingpack.data.stats data/shakespeare --seq-length 1024 # a prefix: data=megatron data.paths=[it]

Words with `=` are run.py's overrides (any key, in any order with the options); other words are dataset
prefixes or Megatron blend words (`0.3 a 0.7 b`). The report covers the train batches the run reads
(`train.steps` of them unless --num-batches), split into `train.micro_batches` (what one kernel call sees);
see data/segment_stats.py for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import sys

from lingpack.errors import ConfigError

# Options kept as shorthands for run overrides.
OPTION_KEYS = {"seq_length": "data.seq_length", "global_batch_size": "data.global_batch_size",
               "micro_batches": "train.micro_batches", "max_segs": "kernel.max_segs", "eod_id": "data.eod_id",
               "vocab_size": "data.vocab_size", "seed": "data.seed", "split": "data.split",
               "num_samples": "data.num_samples"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lingpack.data.stats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("words", nargs="*", help="run.py overrides (key=value) and/or dataset prefixes")
    parser.add_argument("--seq-length", type=int, help="= data.seq_length")
    parser.add_argument("--global-batch-size", type=int, help="= data.global_batch_size")
    parser.add_argument("--micro-batches", type=int, help="= train.micro_batches: the kernel sees one at a time")
    parser.add_argument("--max-segs", type=int, help="= kernel.max_segs: count what it would drop")
    parser.add_argument("--eod-id", type=int, help="= data.eod_id (default: the tokenizer record's)")
    parser.add_argument("--vocab-size", type=int, help="= data.vocab_size (default: the tokenizer record's)")
    parser.add_argument("--seed", type=int, help="= data.seed")
    parser.add_argument("--split", help="= data.split")
    parser.add_argument("--num-samples", type=int, help="= data.num_samples")
    parser.add_argument("--num-batches", type=int, default=None, help="default: the train.steps batches the run reads")
    parser.add_argument("--no-reset-attention-mask", action="store_true", help="= data.reset_attention_mask=false")
    parser.add_argument("--config-dir", default=None, help="the run's conf/ (default ./conf, else the checkout's)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def run_overrides(args) -> list[str]:
    """The run.py overrides the command line stands for (prefixes become data=megatron data.paths=[...])."""
    overrides = [w for w in args.words if "=" in w]
    prefixes = [w[:-4] if w.endswith((".bin", ".idx")) else w for w in args.words if "=" not in w]
    if prefixes:
        overrides = ["data=megatron", f"data.paths=[{','.join(prefixes)}]", *overrides]
    overrides += [f"{key}={getattr(args, name)}" for name, key in OPTION_KEYS.items()
                  if getattr(args, name) is not None]
    if args.no_reset_attention_mask:
        overrides.append("data.reset_attention_mask=false")
    return overrides


def report_for(overrides: list[str], *, num_batches: int | None = None, config_dir: str | None = None) -> dict:
    """`segment_stats.dataset_report` of the train data `python run.py OVERRIDES` would read."""
    from lingpack import config as config_lib
    from lingpack.data.segment_stats import dataset_report
    rc = config_lib.build(config_lib.compose(overrides, run_dir=".", config_dir=config_dir), ".")
    batches = rc.train.steps if num_batches is None else num_batches
    return dataset_report(rc.data, num_batches=batches, micro_batches=rc.train.micro_batches,
                          max_segs=rc.kernel.max_segs)


def _print(report: dict) -> None:
    for key, value in report.items():
        print(f"{key:>28}: {value}")
    kind = ("covers the worst case for these document lengths" if report["recommendation_is_guaranteed"]
            else "empirical: other seeds may overflow, which the kernel must count or reject")
    rows = report["global_batch_size"] // report["micro_batches"]
    print(f"\nrecommend kernel.max_segs={report['recommended_max_segs']} ({kind}; observed max "
          f"{report['segments_per_batch_max']} segments in a [{rows}, {report['seq_length']}] micro-batch, worst case "
          f"{report['segments_per_batch_bound']})")
    if "max_segs" in report:
        print(f"kernel.max_segs={report['max_segs']}: {report['micro_batches_over_max_segs']} of "
              f"{report['batches_read'] * report['micro_batches']} micro-batches would drop "
              f"{report['documents_dropped_at_max_segs']} documents in all")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    try:
        report = report_for(run_overrides(args), num_batches=args.num_batches, config_dir=args.config_dir)
    except ConfigError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
