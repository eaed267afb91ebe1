"""The flagship on 64-chip slices: `python -m lingpack.plan` for a few meshes per scenario, the cheapest that fits.

    python -m experiments.plan.flagship                 # plan what is missing, then write the tables
    python -m experiments.plan.flagship --rerun         # plan everything again (e.g. after the model changed)
    python -m experiments.plan.flagship --table-only    # re-render the docs blocks from results/flagship.json
    python -m experiments.plan.flagship --only t8k/configured   # plan some keys only (the rest stays as it is)

Scenarios (conf/model/ling3_flagship.yaml, kernel=pallas_segment, attention splash, 64 devices):
  t8k     T=8192, 64 rows (512K tokens a step); the configured mesh fsdp=8 x expert=8, then the planner's
          other candidates (`lingpack.plan.measure.candidate_meshes`)
  t128k   T=131072, 8 rows (1M tokens a step), context parallelism (ring, zigzag); configured expert=8 x
          context=8, then the candidates
  depth   t8k's configured mesh planned from 9 and 13 compiled layers (`plan.layers=9`), against the full
          24-layer compile: the per-layer extrapolation's error
Each (scenario, mesh) is one `python -m lingpack.plan ... plan.chip=v5p plan.output=...` process (its wall
and CPU time recorded); v6e is the same measurement judged on v6e's figures (`plan_measure.assess`: the
compiled program does not depend on the chip, both are TPUs). Results merge into results/flagship.json as
they arrive (an interrupted run keeps them); the recommended mesh per scenario and chip is the lowest
roofline step time among the plans that fit.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from experiments.provenance import commit

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments/plan/results"
ARTIFACT = OUT / "flagship.json"
DEVICES = 64
CHIPS = ("v5p", "v6e")
BASE = ["model=ling3_flagship", "kernel=pallas_segment", "parallel.data=1", "parallel.fsdp=1", "parallel.tensor=1",
        "parallel.expert=1", "parallel.context=1"]
SCENARIOS = {
    "t8k": BASE + ["data.seq_length=8192", "data.global_batch_size=64", "parallel.fsdp=8", "parallel.expert=8"],
    "t128k": BASE + ["data.seq_length=131072", "data.global_batch_size=8", "parallel.expert=8", "parallel.context=8"],
}
SEARCH = 4                      # meshes planned per scenario, the configured one first
DEPTH_LAYERS = 9


def mesh_overrides(parallel) -> list[str]:
    return [f"parallel.{k}={getattr(parallel, k)}" for k in ("data", "fsdp", "tensor", "expert", "context")]


def meshes(scenario: str) -> list[list[str]]:
    """Override lists of the meshes to plan for `scenario`: the configured one, then the planner's candidates."""
    from lingpack import plan
    from lingpack.plan import measure as plan_measure
    rc = plan.run_config(plan.compose(SCENARIOS[scenario], plan.find_conf_dir(str(ROOT / "conf"))))
    return [[]] + [mesh_overrides(p) for p in plan_measure.candidate_meshes(rc, DEVICES, SEARCH - 1)]


def run_plan(overrides: list[str], timeout: int) -> dict:
    """One `python -m lingpack.plan` process: its JSON plus wall and CPU seconds (the process and its children)."""
    out = OUT / "tmp_plan.json"
    cmd = [sys.executable, "-m", "lingpack.plan", *overrides, f"plan.devices={DEVICES}", "plan.chip=v5p",
           f"plan.output={out}"]
    print(" ".join(cmd[1:]), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    result = json.loads(out.read_text())
    out.unlink()
    result["timing"] = {"wall_s": time.time() - start, "cpu_s": (after.ru_utime + after.ru_stime)
                        - (before.ru_utime + before.ru_stime), "max_rss_kb": after.ru_maxrss}
    result["commit"] = commit()
    print(f"  {result['timing']['wall_s']:.0f} s wall, {result['timing']['cpu_s']:.0f} s CPU: "
          f"{result['per_device_bytes'] / 2**30:.1f} GiB, est. {result['est_step_s'] * 1e3:.0f} ms", flush=True)
    return result


def judged(result: dict, chip: str) -> dict:
    from lingpack.plan import chips
    from lingpack.plan import measure as plan_measure
    return plan_measure.assess(result, chips.chip(chip))


def recommended(res: dict, scenario: str, chip: str) -> dict | None:
    plans = [judged(r, chip) for k, r in res.items() if k.startswith(f"{scenario}/") and "error" not in r]
    return min((p for p in plans if p["fits"]), key=lambda p: p["est_step_s"], default=None)


def gib(b: float) -> str:
    return f"{b / 2**30:.1f}"


def table(res: dict) -> str:
    """The docs block: the recommended mesh per scenario and chip, every mesh planned, the depth extrapolation."""
    title = {"t8k": "T=8192, 64 rows", "t128k": "T=131072 (128K), 8 rows, context parallel (ring)"}
    lines = ["| scenario | chip | recommended mesh | per device (GiB) | HBM (GiB) | est. step | MFU at est. |",
             "|---|---|---|---|---|---|---|"]
    for scenario in SCENARIOS:
        for chip in CHIPS:
            best = recommended(res, scenario, chip)
            if best is None:
                plans = [judged(r, chip) for k, r in res.items() if k.startswith(f"{scenario}/") and "error" not in r]
                least = min(plans, key=lambda p: p["per_device_bytes"], default=None)
                if least is None:
                    continue
                lines.append(f"| {title[scenario]} | {DEVICES} x {chip} | none fits (least memory: {least['mesh']}) | "
                             f"{gib(least['per_device_bytes'])} | {gib(least['hbm_bytes'])} | - | - |")
                continue
            lines.append(f"| {title[scenario]} | {DEVICES} x {chip} | {best['mesh']} | {gib(best['per_device_bytes'])} "
                         f"| {gib(best['hbm_bytes'])} | {best['est_step_s'] * 1e3:.0f} ms | {best['mfu_at_est']:.1%} |")
    lines += ["", "Every mesh planned (per device; roofline on v5p; state = parameters + optimizer + model state, "
              "exact; temporaries: XLA:CPU):", "",
              "| scenario | mesh | state (GiB) | temporaries (GiB) | total (GiB) | fits v5p / v6e | collectives (GiB) "
              "| est. step v5p / v6e | planner wall / CPU |", "|---|---|---|---|---|---|---|---|---|"]
    for key, r in sorted(res.items()):
        scenario = key.split("/")[0]
        if scenario not in SCENARIOS:
            continue
        if "error" in r:
            lines.append(f"| {scenario} | {key.split('/', 1)[1]} | {r['error']} | | | | | | |")
            continue
        b = r["breakdown"]
        state = sum(b["state_bytes"].values())
        v5p, v6e = judged(r, "v5p"), judged(r, "v6e")
        lines.append(f"| {scenario} | {r['mesh']} | {gib(state)} | {gib(b['compiled']['temp'])} | "
                     f"{gib(r['per_device_bytes'])} | {'yes' if v5p['fits'] else 'no'} / {'yes' if v6e['fits'] else 'no'} "
                     f"| {gib(sum(r['collective_bytes'].values()))} | {v5p['est_step_s'] * 1e3:.0f} / "
                     f"{v6e['est_step_s'] * 1e3:.0f} ms | {r['timing']['wall_s'] / 60:.1f} / {r['timing']['cpu_s'] / 60:.1f} min |")
    full, part = res.get("t8k/configured"), res.get("depth/configured")
    if full and part and "error" not in full and "error" not in part:
        rel = lambda f: f(part) / f(full) - 1
        checks = {"temporaries": lambda r: r["breakdown"]["compiled"]["temp"],
                  "per-device total": lambda r: r["per_device_bytes"], "HLO matmul FLOPs": lambda r: r["step_flops"]["hlo_dots"],
                  "collective bytes": lambda r: sum(r["collective_bytes"].values()),
                  "HBM traffic": lambda r: r["breakdown"]["hbm_traffic_bytes"]}
        lines += ["", f"Per-layer extrapolation (t8k, {full['mesh']}): compiled at {DEPTH_LAYERS} and "
                  f"{DEPTH_LAYERS + 4} layers and scaled to 24, against the 24-layer compile: "
                  + ", ".join(f"{name} {rel(f):+.1%}" for name, f in checks.items()) + "."]
    commits = sorted({r.get("commit", "?") for r in res.values() if isinstance(r, dict)})
    lines += ["", f"Measured at commit {', '.join(commits)}: 64 fake CPU devices on a shared 2-core host; "
              "`python -m experiments.plan.flagship` regenerates this block."]
    return "\n".join(lines) + "\n"


def write(res: dict) -> None:
    """The JSON artifact, and every docs block of the table rewritten from it."""
    from experiments import check_results
    OUT.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    for page, text in check_results.read_pages().items():
        if "<!-- results: plan_flagship -->" in text:
            (ROOT / page).write_text(check_results.write(text))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rerun", action="store_true", help="plan every mesh again")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per planner process")
    parser.add_argument("--only", nargs="+", metavar="KEY", help="plan only these keys (e.g. t8k/configured)")
    args = parser.parse_args()
    res = {} if args.rerun or not ARTIFACT.exists() else json.loads(ARTIFACT.read_text())
    if not args.table_only:
        todo = []
        for scenario in SCENARIOS:
            for extra in meshes(scenario):
                key = f"{scenario}/" + ("configured" if not extra else " ".join(e.split(".", 1)[1] for e in extra))
                todo.append((key, SCENARIOS[scenario] + extra))
        todo.append(("depth/configured", SCENARIOS["t8k"] + [f"plan.layers={DEPTH_LAYERS}"]))
        for key, overrides in todo:
            if (key in res and "error" not in res[key]) or (args.only and key not in args.only):
                continue
            res[key] = run_plan(overrides, args.timeout)
            write(res)
    write(res)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
