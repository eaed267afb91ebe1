"""Regenerate the loss-parity table: lingpack vs the Megatron-semantics PyTorch reference.

    python -m experiments.loss_parity.run_parity [--steps 50] [--only NAME ...] [--reuse] [--table-only]

Each variant is one `python run.py experiment=loss_parity[_fp64] ...` run (its directory under `results/`):
the default Ling3 (lower-bound gate, RoPE MLA, MTP) and the model as KimiLinear alone expresses it (softplus
gate, NoPE MLA, no MTP), in float64 on both sides (`experiment=loss_parity_fp64`), in fp32 (routing free and
routing-locked), with dense FFNs, and with bf16 compute against the fp32 reference. Every MoE variant traces
routing on both sides (`<run>/parity/routing.json`: the first step whose expert selections differ, its MoE
layer, the flipped tokens' decision margin); every variant compares the MTP and router z-loss terms per step
(`<run>/parity/terms.csv`) and the evaluations on the valid and test splits (`<run>/parity/validation_parity.csv`).
Writes `results.json` (one row per variant, from the runs' summaries; `table(rows)` is the `loss_parity`
results block of the docs, rewritten through `experiments.blocks`). Every run directory
records the commit it measured (`commit.json`, `experiments.provenance.commit`).
`--only` reruns the named variants and keeps the others' runs; `--reuse` keeps every variant whose run directory
has a summary. The table holds a row for every variant that has a run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from experiments.provenance import commit

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "loss_parity" / "results"
KIMI = ["model.mtp_num_layers=0", "model.kda.lower_bound=null", "model.mla.rope_type=none"]  # KimiLinear's model
FP32, BF16, FP64 = ["model.dtype=float32"], ["model.dtype=bfloat16"], ["experiment=loss_parity_fp64"]
LOCKED = ["parity.lock_routing=true"]
STALE = " (earlier harness)"   # marks a row whose run predates the per-step terms and dtype records
VARIANTS = {  # name -> (overrides, relative tolerance); fp64 rows run float64 on both sides, the others fp32
    "default Ling3 float64": (FP64, 1e-9),
    "KimiLinear float64": (FP64 + KIMI, 1e-9),
    "default Ling3 fp32": (FP32, 1e-4),
    "default Ling3 fp32 routing locked": (FP32 + LOCKED, 1e-4),
    "KimiLinear fp32": (FP32 + KIMI, 1e-4),
    "KimiLinear fp32 routing locked": (FP32 + KIMI + LOCKED, 1e-4),
    "KimiLinear fp32 dense FFN": (FP32 + KIMI + ["model.first_dense_layers=4"], 1e-4),
    "KimiLinear bf16 compute": (BF16 + KIMI, 1e-2),   # bf16 compute, fp32 master weights, fp32 reference
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--reuse", action="store_true", help="keep every variant whose run directory has a summary")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), help="run these variants, keep the others' runs")
    parser.add_argument("--table-only", action="store_true", help="run nothing: the table from the runs in --out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (overrides, tolerance) in VARIANTS.items():
        run_dir = run_dir_of(name, out)
        kept = args.reuse and (run_dir / "summary.json").exists()
        if args.table_only or (args.only and name not in args.only) or kept:
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        run_variant(run_dir, overrides, tolerance, args.steps)
    rows = [row_of(name, tolerance, run_dir_of(name, out)) for name, (_, tolerance) in VARIANTS.items()
            if (run_dir_of(name, out) / "summary.json").exists()]   # a variant not run yet has no row
    write(rows, out)
    print(table(rows))


def row_of(name: str, tolerance: float, run_dir: Path) -> dict:
    """results.json's row of one variant, from its run's summary and parity files."""
    summary = json.loads((run_dir / "summary.json").read_text())
    stale = "parity_reference_dtype" not in summary  # a run of an earlier harness (no terms, no dtype record)
    commit = run_dir / "commit.json"
    return {"variant": name + (STALE if stale else ""),
            "commit": json.loads(commit.read_text())["commit"] if commit.exists() else None,
            "steps": summary["parity_steps"],
            "dtypes": _dtypes(summary),
            "first_lm_loss": summary["first_lm_loss"], "final_lm_loss": summary["final_lm_loss"],
            "max_rel_diff": summary["parity_max_rel"], "mean_rel_diff": summary["parity_mean_rel"],
            "mtp_max_rel_diff": summary.get("mtp_parity_max_rel"),
            "moe_z_max_rel_diff": summary.get("moe_z_parity_max_rel"),
            "tolerance": tolerance, "first_step_over": _first_over(run_dir, tolerance),
            "passed": summary["parity_max_rel"] <= tolerance, **_routing(run_dir),
            "val_max_rel_diff": summary.get("val_parity_max_rel"),
            "val_evaluations": summary.get("val_parity_evaluations")}


def _dtypes(summary: dict) -> str:
    """'<lingpack compute> (<master> master) / <reference>' as the run recorded them (its arrays' dtypes)."""
    compute, master = summary.get("parity_lingpack_compute_dtype", "?"), summary.get("master_dtypes", "?")
    ours = compute if master == compute else f"{compute} ({master} master)"
    return f"{ours} / {summary.get('parity_reference_param_dtypes', '?')}"


def write(rows: list[dict], out: Path) -> None:
    """results.json, and every docs block of the table rewritten from it."""
    from experiments import blocks
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    blocks.rewrite({"loss_parity"})


def _cell(value, fmt: str = ".2e") -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict]) -> str:
    """The `loss_parity` results block, from results.json's rows."""
    lines = ["| variant | lingpack commit | steps | dtypes: lingpack / reference | lm loss first -> last "
             "| max rel diff | mean rel diff | MTP max rel diff | router z-loss max rel diff | target "
             "| first step over target "
             "| first routing flip: step (layer), margin | rel diff before flip -> worst after "
             "| validation max rel diff (evaluations) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r.get('commit') or '-'} | {r['steps']} | {r.get('dtypes', '?')} | "
                     f"{r['first_lm_loss']:.4f} -> {r['final_lm_loss']:.4f} | {r['max_rel_diff']:.2e} | "
                     f"{r['mean_rel_diff']:.2e} | "
                     f"{_cell(r.get('mtp_max_rel_diff'))} | {_cell(r.get('moe_z_max_rel_diff'))} | "
                     f"<= {r['tolerance']:g} | {r['first_step_over'] or 'none'} | {r['flip']} | {r['around_flip']} | "
                     f"{_validation(r)} |")
    if any(r.get("val_evaluations") is None for r in rows):
        lines.append("\nnot evaluated: the run predates the reference's evaluation (rerun the variant to fill it).")
    if any(r["variant"].endswith(STALE) for r in rows):
        lines.append(f"\n{STALE.strip()}: kept by --reuse from a run of an earlier version of this script and reference.")
    return "\n".join(lines) + "\n"


def run_dir_of(variant: str, out: Path) -> Path:
    return out / variant.removesuffix(STALE).replace(" ", "_")


def _validation(row: dict) -> str:
    if row.get("val_evaluations") is None:
        return "not evaluated"
    return f"{row['val_max_rel_diff']:.2e} ({row['val_evaluations']})"


def _routing(run_dir: Path) -> dict:
    """The routing trace's first flip, as table cells (and the raw numbers)."""
    path = run_dir / "parity" / "routing.json"
    if not path.exists():
        summary = json.loads((run_dir / "summary.json").read_text())
        return {"flip": "not traced" if "parity_lock_routing" not in summary else "no MoE", "around_flip": "",
                "first_flip": None}
    trace = json.loads(path.read_text())
    first, around = trace["first_flip"], trace.get("loss_rel_diff")
    if first is None:
        return {"flip": f"none in {trace['steps']} steps", "around_flip": "", "first_flip": None}
    cells = {"flip": f"{first['step']} ({first['layer']}), {first['tokens']} tok,"
                     f" margin <= {first['lingpack_margin_max']:.1e}",
             "around_flip": "", "first_flip": first}
    if around and around["max_before"] is not None:
        after = around["max_after"] if around["max_after"] is not None else around["at"]
        cells["around_flip"] = f"{around['max_before']:.1e} -> {after:.1e}"
    return cells


def _first_over(run_dir: Path, tolerance: float):
    import csv
    with open(run_dir / "parity" / "parity.csv") as f:
        return next((int(r["step"]) for r in csv.DictReader(f) if float(r["rel_diff"]) > tolerance), None)


def run_variant(run_dir: Path, overrides: list, tolerance: float, steps: int) -> None:
    experiment = [o for o in overrides if o.startswith("experiment=")] or ["experiment=loss_parity"]
    cmd = [sys.executable, str(ROOT / "run.py"), *experiment, f"train.steps={steps}",
           f"data.num_samples={steps * 8}", f"parity.tolerance={tolerance}", "logger=none",
           "train.progress_bar=false", f"hydra.run.dir={run_dir}",
           *(o for o in overrides if not o.startswith("experiment="))]
    measured = commit()   # the code as the run starts (a commit made while it runs is not what it measured)
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    (run_dir / "commit.json").write_text(json.dumps({"commit": measured}) + "\n")


if __name__ == "__main__":
    main()
