"""Record what `make run` (= `python run.py`, the default config) does: the `make_run` results block.

    python -m experiments.make_run.run_default [--out experiments/make_run/results]

Runs `run.py` with the default config (W&B off, run directory in a temporary folder), times the whole
process (compilation included), and writes `summary.json` (the run's summary plus `wall_seconds`),
`metrics.csv` and `loss.png` under `--out`; `table(summary)` renders the results block.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.provenance import commit

ROOT = Path(__file__).resolve().parents[2]


def _cell(value) -> str:
    return "-" if value is None else f"{value:.1e}"   # "-": recorded before the run reported it


def table(summary: dict) -> str:
    """The `make_run` results block, from summary.json."""
    return "\n".join([
        "| lingpack commit | steps | lm loss first -> last | tokens/s | wall time (compilation included) "
        "| packing parity (rel) | worst token (nats) | phantom overhead |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
        f"| {summary.get('commit', '-')} | {summary['steps']} | "
        f"{summary['first_lm_loss']:.2f} -> {summary['final_lm_loss']:.2f} | "
        f"{summary['tokens_per_s']:,.0f} | {summary['wall_seconds']:.0f} s | {summary['packing_parity_rel']:.1e} | "
        f"{_cell(summary.get('packing_parity_token_max_abs'))} | "
        f"{summary['phantom_overhead']:.2f} |"]
        + ([f"\n2 CPU cores; load average {summary['load_average_at_start']:.1f} when the run started (1.0 = one"
            " core busy with other jobs)."] if "load_average_at_start" in summary else [])) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "make_run" / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "run.py"), "logger=none", "train.progress_bar=false",
               f"hydra.run.dir={tmp}/run"]
        print("$", " ".join(cmd), flush=True)
        load, start = os.getloadavg()[0], time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True)
        wall = time.perf_counter() - start
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        for name in ("metrics.csv", "loss.png"):
            shutil.copy(Path(tmp) / "run" / name, out / name)
    summary.update(wall_seconds=wall, commit=commit(), load_average_at_start=load)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary))


if __name__ == "__main__":
    main()
