"""`python run.py experiment=context_schedule` end to end, summarised: stages, losses, tokens/s, stage changes.

    python -m experiments.context_parallel.context_schedule                 # runs it (8 fake CPU devices)
    python -m experiments.context_parallel.context_schedule --run-dir DIR   # summarises a finished run

Writes results/context_schedule.json: the code's commit, the run's metrics records, its stages and the stage
lines of its run.log; `table` renders the `context_schedule` results block from it. Per step: the row length
the step trained on (its `tokens`; B=1), the stage's RoPE theta, losses, and tokens/s. The first step of
every stage includes that stage's compile, so its tokens/s is not a throughput; all timings are wall clock
on 2 CPU cores shared with other jobs (inflated, noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from experiments.provenance import commit

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments/context_parallel/results"
STAGE_LINES = ("context stage", "checkpoint: step", "resumed from step")


def run(run_dir: Path) -> None:
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    subprocess.run([sys.executable, str(ROOT / "run.py"), "experiment=context_schedule", "train.progress_bar=false",
                    f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, check=True)


def table(result: dict) -> str:
    """The `context_schedule` results block, from results/context_schedule.json."""
    records, stages, events = result["records"], result["stages"], result["events"]
    by_length = {s["seq_length"]: s for s in stages}
    lines = [f"`python run.py experiment=context_schedule` (lingpack at commit {result['commit']}): ling3_tiny, B=1, "
             "CP=8 zigzag on 8 fake CPU devices, "
             "stages " + " -> ".join(f"{s['seq_length'] // 1024}K x {s['steps']} (theta {s['rope_theta']:g})"
                                     for s in stages) + ". First step of a stage = its compile.", "",
             "| step | row length | rope theta | loss | lm loss | mtp loss | grad norm | lr | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    previous = None
    for r in records:
        length = int(r["tokens"])
        first = length != previous
        previous = length
        lines.append(f"| {r['step']} | {length} | {by_length[length]['rope_theta']:g} | {r['loss']:.4f} | "
                     f"{r['lm_loss']:.4f} | {r['mtp_loss']:.4f} | {r['grad_norm']:.3f} | {r['lr']:.2e} | "
                     + (f"({r['tokens_per_s']:.0f}, compile)" if first else f"{r['tokens_per_s']:.0f}") + " |")
    lines += ["", "Stage changes (run.log):", "", "```"] + events + ["```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, help="a finished run's directory (default: run one now)")
    args = parser.parse_args()
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = ROOT / "outputs/context_schedule_experiment"
        shutil.rmtree(run_dir, ignore_errors=True)   # a fresh run, not a resume of an older one
        run(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    stages = yaml.safe_load((run_dir / ".hydra/config.yaml").read_text())["schedule"]["stages"]
    log_lines = (run_dir / "run.log").read_text().splitlines()
    events = [line.split(" - ", 1)[-1].replace(f"{ROOT}/", "") for line in log_lines
              if any(s in line for s in STAGE_LINES)]
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"commit": commit(), "records": records, "stages": stages, "events": events}
    (OUT / "context_schedule.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
