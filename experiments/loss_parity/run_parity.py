"""Regenerate the loss-parity table: lingpack vs the Megatron-semantics PyTorch reference.

    python -m experiments.loss_parity.run_parity [--steps 50] [--out experiments/loss_parity/results] [--reuse]

Runs `python run.py experiment=loss_parity` on the default Ling3 (lower-bound gate, RoPE MLA, MTP) and, as
KimiLinear alone expresses it (softplus gate, NoPE MLA, no MTP), in fp32 (routing free and routing-locked),
with dense FFNs and with bf16 compute (fp32 master weights), all against the fp32 reference, and writes
`results.json` (whose `table` is the `loss_parity` results block of the docs) and each run's directory. Each MoE
variant also traces routing on both sides: the first step where the two sides' expert selections differ,
its MoE layer and the decision margin of the flipped tokens (`<run>/parity/routing.json`). Both sides
evaluate the valid split every `train.eval_every` steps and, at the end, the valid and test splits on the same
samples (`<run>/parity/validation_parity.csv`): the validation column is the largest relative difference.
Every row records the commit its run measured; `--reuse` keeps the runs already in `--out`.
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
KIMI = ["model.mtp_num_layers=0", "model.kda.lower_bound=null", "model.mla.rope_type=none"]  # KimiLinear's model
VARIANTS = {  # name -> (overrides, relative tolerance); every variant runs against the fp32 reference
    "fp32": (KIMI + ["model.dtype=float32"], 1e-4),
    "fp32 routing locked": (KIMI + ["model.dtype=float32", "parity.lock_routing=true"], 1e-4),
    "fp32 dense FFN": (KIMI + ["model.dtype=float32", "model.first_dense_layers=4"], 1e-4),
    "bf16 compute": (KIMI + ["model.dtype=bfloat16"], 1e-2),
    "default Ling3 fp32": (["model.dtype=float32"], 1e-4),   # safe gate, RoPE MLA, MTP: the model users train
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "loss_parity" / "results"))
    parser.add_argument("--reuse", action="store_true", help="keep variants whose run directory has a summary")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, (overrides, tolerance) in VARIANTS.items():
        run_dir = run_dir_of(name, out)
        if not (args.reuse and (run_dir / "summary.json").exists()):
            shutil.rmtree(run_dir, ignore_errors=True)
            run_variant(run_dir, overrides, tolerance, args.steps)
        summary = json.loads((run_dir / "summary.json").read_text())
        rows.append({"variant": name, "commit": json.loads((run_dir / "commit.json").read_text())["commit"],
                     "steps": summary["parity_steps"],
                     "first_lm_loss": summary["first_lm_loss"],
                     "final_lm_loss": summary["final_lm_loss"], "max_rel_diff": summary["parity_max_rel"],
                     "mean_rel_diff": summary["parity_mean_rel"], "tolerance": tolerance,
                     "first_step_over": _first_over(run_dir, tolerance),
                     "passed": summary["parity_max_rel"] <= tolerance, **_routing(run_dir),
                     "val_max_rel_diff": summary.get("val_parity_max_rel"),
                     "val_evaluations": summary.get("val_parity_evaluations")})
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))


def table(rows: list[dict]) -> str:
    """The `loss_parity` results block, from results.json's rows."""
    lines = ["| variant | lingpack commit | steps | lm loss first -> last | max rel diff | mean rel diff | target "
             "| first step over target | first routing flip: step (layer), margin "
             "| rel diff before flip -> worst after | validation max rel diff (evaluations) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r.get('commit', '-')} | {r['steps']} | "
                     f"{r['first_lm_loss']:.4f} -> {r['final_lm_loss']:.4f} | {r['max_rel_diff']:.2e} | "
                     f"{r['mean_rel_diff']:.2e} | <= {r['tolerance']:g} | "
                     f"{r['first_step_over'] or 'none'} | {r['flip']} | {r['around_flip']} | {_validation(r)} |")
    if any(r.get("val_evaluations") is None for r in rows):
        lines.append("\nnot evaluated: that run's reference did not evaluate yet.")
    return "\n".join(lines) + "\n"


def run_dir_of(variant: str, out: Path) -> Path:
    return out / variant.replace(" ", "_")


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
    cmd = [sys.executable, str(ROOT / "run.py"), "experiment=loss_parity", f"train.steps={steps}",
           f"data.num_samples={steps * 8}", f"parity.tolerance={tolerance}", "logger=none",
           "train.progress_bar=false", f"hydra.run.dir={run_dir}", *overrides]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    (run_dir / "commit.json").write_text(json.dumps({"commit": commit()}) + "\n")


if __name__ == "__main__":
    main()
