"""Loss-parity check of a lingpack run against a Megatron-LM baseline.

    python -m lingpack.tracking.compare --megatron-log megatron.log --run outputs/RUN [--tolerance 1e-4]
        [--out DIR] [--wandb-mode offline|disabled] [--seq-length 4096] [--step-offset 0]

Reads RUN/metrics.jsonl and the Megatron log (stdout text, or a W&B history export .csv/.json; the
format is sniffed), prints the parity table, writes DIR/parity.csv, DIR/parity.png and
DIR/parity_summary.json (DIR defaults to RUN/parity).
Validation losses are compared apart (same tolerance): lingpack's periodic `val_lm_loss` against Megatron's
"validation loss at iteration N" lines step by step, and the end-of-run validation and test evaluations
("... on validation set" / "... on test set") against the run's summary.json; written to
DIR/validation_parity.csv and the summary's "validation" entry.
Exit status: 0 parity holds, 1 some step (training or validation) exceeds the tolerance, 2 unusable input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lingpack.tracking.megatron_logs import load_baseline, series
from lingpack.tracking.metrics import read_metrics, write_csv
from lingpack.tracking.parity import compute_parity, write_parity_csv
from lingpack.tracking.table import summary_table

EXIT_OK, EXIT_PARITY_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lingpack.tracking.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-log", required=True, help="Megatron stdout log or W&B export")
    parser.add_argument("--run", required=True, help="lingpack run directory holding metrics.jsonl")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max relative difference")
    parser.add_argument("--out", default=None, help="output directory (default RUN/parity)")
    parser.add_argument("--metric", default="lm_loss", help="metric to compare (lm_loss, mtp_loss...)")
    parser.add_argument("--format", default="auto", choices=["auto", "text", "csv", "json"])
    parser.add_argument("--seq-length", type=int, default=None, help="tokens = consumed samples x this")
    parser.add_argument("--step-offset", type=int, default=0, help="lingpack step + offset = iteration")
    parser.add_argument("--mode", default="auto", choices=["auto", "pointwise"],
                        help="auto: average lingpack over Megatron's log interval when it can")
    parser.add_argument("--window", type=int, default=100, help="steps per max/mean window")
    parser.add_argument("--max-rows", type=int, default=40, help="parity rows printed (all in csv)")
    parser.add_argument("--wandb-mode", default="disabled", choices=["offline", "online", "disabled"],
                        help="log the baseline as a job_type=baseline W&B run (default: disabled)")
    parser.add_argument("--wandb-project", default="lingpack")
    parser.add_argument("--wandb-group", default=None, help="default: the run directory's name")
    parser.add_argument("--wandb-dir", default=None, help="default: the output directory")
    return parser


def _rows_to_print(rows: list, limit: int) -> list:
    """All rows if few; else the head, every failing row (up to the limit) and the tail."""
    if len(rows) <= limit:
        return rows
    edge = max(1, limit // 4)
    keep = set(range(edge)) | set(range(len(rows) - edge, len(rows)))
    for i, row in enumerate(rows):
        if row.exceeds and len(keep) < limit:
            keep.add(i)
    return [rows[i] for i in sorted(keep)]


def main(argv: list | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        baseline = load_baseline(args.megatron_log, seq_length=args.seq_length, fmt=args.format)
        records = read_metrics(args.run)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(baseline.report.describe())
    megatron = series(baseline.records, args.metric)
    lingpack = series(records, args.metric)
    if not megatron or not lingpack:
        side = "Megatron log" if not megatron else f"{args.run}/metrics.jsonl"
        print(f"error: the {side} has no {args.metric!r} values; check --metric.", file=sys.stderr)
        return EXIT_BAD_INPUT
    result = compute_parity(megatron, lingpack, tolerance=args.tolerance, metric=args.metric,
                            step_offset=args.step_offset, window=args.window, mode=args.mode)
    if not result.rows:
        print(f"error: no common steps: Megatron {min(megatron)}..{max(megatron)}, lingpack "
              f"{min(lingpack)}..{max(lingpack)} (+ offset {args.step_offset}). Use --step-offset.",
              file=sys.stderr)
        return EXIT_BAD_INPUT

    out = Path(args.out) if args.out else Path(args.run) / "parity"
    out.mkdir(parents=True, exist_ok=True)
    shown = _rows_to_print(result.rows, args.max_rows)
    table = [{"step": r.step, "megatron": r.megatron, "lingpack": r.lingpack, "abs": r.abs_diff,
              "rel": r.rel_diff, "n": r.lingpack_n, "": "FAIL" if r.exceeds else ""} for r in shown]
    print(summary_table(table, ["step", "megatron", "lingpack", "abs", "rel", "n", ""],
                        formats={"megatron": ".6f", "lingpack": ".6f", "abs": ".3e", "rel": ".3e"},
                        title=f"{args.metric} parity (n = lingpack steps averaged over Megatron's "
                              f"log interval {result.interval})"))
    if len(shown) < len(result.rows):
        print(f"({len(result.rows) - len(shown)} rows not shown; all {len(result.rows)} in parity.csv)")
    print(summary_table(result.windows, ["start", "end", "n", "max_abs", "mean_abs", "max_rel", "mean_rel"],
                        title=f"windows of {args.window} steps",
                        formats={k: ".3e" for k in ("max_abs", "mean_abs", "max_rel", "mean_rel")}))
    csv_path = write_parity_csv(result, out / "parity.csv")
    from lingpack.tracking.plots import plot_parity  # lazy: matplotlib import is slow

    png_path = plot_parity(result, out / "parity.png")
    summary = result.summary()
    summary.update(megatron_log=str(args.megatron_log), run=str(args.run),
                   megatron_report=baseline.report.describe())
    (out / "parity_summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n")
    print(f"wrote {csv_path}, {png_path}, {out / 'parity_summary.json'}")
    if result.only_megatron or result.only_lingpack:
        print(f"not compared: {len(result.only_megatron)} Megatron-only steps, "
              f"{len(result.only_lingpack)} lingpack-only steps")

    if args.wandb_mode != "disabled":
        from lingpack.tracking.megatron_logs import log_baseline_to_wandb

        log_baseline_to_wandb(baseline, group=args.wandb_group or Path(args.run).resolve().name,
                              project=args.wandb_project, mode=args.wandb_mode,
                              dir=args.wandb_dir or str(out), config={"parity": summary})

    validation = validation_parity(baseline, args.run, args.tolerance, args.step_offset)
    if validation.rows:
        report_validation(validation, out)
        summary["validation"] = validation.summary()
        (out / "parity_summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n")
    elif baseline.validation:
        print("validation: the Megatron log has validation lines but the run logged no val_lm_loss "
              "(set train.eval_every to Megatron's --eval-interval)")

    if result.passed and (validation.passed or not validation.rows):
        print(f"PARITY OK: all {len(result.rows)} aligned steps within rel tolerance "
              f"{args.tolerance:g} (max rel {result.max_rel:.3g}).")
        return EXIT_OK
    first = result.first_failure
    if first is None:
        return EXIT_PARITY_FAILED
    print(f"PARITY FAILED: {len(result.failures)} of {len(result.rows)} aligned steps exceed rel "
          f"tolerance {args.tolerance:g}; first at step {first.step} (megatron {first.megatron!r}, "
          f"lingpack {first.lingpack!r}, rel {first.rel_diff:.3g}).")
    return EXIT_PARITY_FAILED


def validation_parity(baseline, run_dir, tolerance: float, step_offset: int = 0):
    """Periodic and end-of-run validation (and test) lm loss of a Megatron log vs a lingpack run directory."""
    records = read_metrics(run_dir)
    ours = {int(r["step"]) + step_offset: float(r["val_lm_loss"]) for r in records if "val_lm_loss" in r}
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return compare_validation(baseline.validation, baseline.test, ours, summary, tolerance)


def compare_validation(megatron_validation: list, megatron_test: list, periodic: dict, final: dict,
                       tolerance: float):
    """Megatron's validation records (`MegatronRun.validation` / `.test` layout) vs lingpack's, pointwise.

    `periodic`: lingpack's {step: val_lm_loss}; `final`: its end-of-run `val_lm_loss` / `test_lm_loss`.
    Returns a ParityResult whose extra attribute `labels` names each row ("step N", "end valid", "end test").
    """
    pairs = [(f"step {r['step']}", r["val_lm_loss"], periodic.get(r["step"])) for r in megatron_validation
             if not r.get("final") and "val_lm_loss" in r]
    finals = [r for r in megatron_validation if r.get("final") and "val_lm_loss" in r]
    if finals and "val_lm_loss" in final:
        pairs.append(("end valid", finals[-1]["val_lm_loss"], final["val_lm_loss"]))
    tests = [r for r in megatron_test if "test_lm_loss" in r]
    if tests and "test_lm_loss" in final:
        pairs.append(("end test", tests[-1]["test_lm_loss"], final["test_lm_loss"]))
    pairs = [p for p in pairs if p[2] is not None]
    result = compute_parity({i: p[1] for i, p in enumerate(pairs, 1)}, {i: p[2] for i, p in enumerate(pairs, 1)},
                            tolerance=tolerance, metric="val_lm_loss", mode="pointwise", interval=1)
    result.labels = [p[0] for p in pairs]
    return result


def report_validation(validation, out: Path) -> None:
    """Print the validation parity table, write `out`/validation_parity.csv and say when it failed."""
    columns = ["where", "megatron", "lingpack", "abs_diff", "rel_diff", "exceeds"]
    rows = [dict(r.__dict__, where=w) for w, r in zip(validation.labels, validation.rows)]
    print(summary_table(rows, columns, title="validation lm loss parity",
                        formats={"megatron": ".6f", "lingpack": ".6f", "abs_diff": ".3e", "rel_diff": ".3e"}))
    write_csv(rows, out / "validation_parity.csv", columns=columns)
    if not validation.passed:
        print(f"VALIDATION PARITY FAILED: {len(validation.failures)} of {len(validation.rows)} evaluations "
              f"exceed rel tolerance {validation.tolerance:g} (max rel {validation.max_rel:.3g}).")


if __name__ == "__main__":
    sys.exit(main())
