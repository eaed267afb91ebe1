"""The flagship on 64-chip TPU slices: `python -m lingpack.plan`, compiled by XLA:TPU for each slice's topology.

    python -m experiments.plan.flagship                 # plan what is missing, then write the tables
    python -m experiments.plan.flagship --rerun         # plan everything again (e.g. after the model changed)
    python -m experiments.plan.flagship --table-only    # re-render the docs blocks from results/flagship.json
    python -m experiments.plan.flagship --only v5p/t8k/configured   # plan some keys only (the rest stays)

Scenarios (conf/model/ling3_flagship.yaml, kernel=pallas_segment, attention splash, 64 chips), each planned
per chip (v5p: topology 4x4x4, v6e and v5e: 8x8; `lingpack.plan.chips.TOPOLOGIES`), keys "<chip>/<scenario>/<mesh>":
  t8k     T=8192, 64 rows (512K tokens a step); the configured mesh fsdp=8 x expert=8, then (`--search`) the
          planner's other candidates (`lingpack.plan.measure.candidate_meshes`)
  t128k   T=131072, 8 rows (1M tokens a step), context parallelism (ring, zigzag); expert=8 x context=8, MLA
          keeping its attention's output for the backward (`model.remat_policy_mla=save_context`)
Each plan is one `python -m lingpack.plan ... plan.chip=<chip> plan.output=...` process (its wall and CPU
time recorded). results/flagship_xla_cpu.json holds the earlier plans of the XLA:CPU twin (64 fake CPU
devices), kept as a labelled comparison: its times came from XLA:CPU's fusions, not the TPU program.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from experiments.provenance import commit

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments/plan/results"
ARTIFACT = OUT / "flagship.json"
TWIN = OUT / "flagship_xla_cpu.json"   # the XLA:CPU twin's plans (comparison only)
DEVICES = 64
CHIPS = ("v5p", "v6e", "v5e")
PLANNED = {"v5p": ("t8k", "t128k"), "v6e": ("t8k",), "v5e": ("t8k",)}   # chip -> scenarios, in planning order
BASE = ["model=ling3_flagship", "kernel=pallas_segment", "parallel.data=1", "parallel.fsdp=1", "parallel.tensor=1",
        "parallel.expert=1", "parallel.context=1"]
SCENARIOS = {
    "t8k": BASE + ["data.seq_length=8192", "data.global_batch_size=64", "parallel.fsdp=8", "parallel.expert=8"],
    # at 128K MLA keeps its attention's output and logsumexp: the backward does not rerun the ring (docs/planning.md)
    "t128k": BASE + ["data.seq_length=131072", "data.global_batch_size=8", "parallel.expert=8", "parallel.context=8",
                     "model.remat_policy_mla=save_context"],
}
SEARCH = 4                      # meshes planned per scenario, the configured one first
# planned beside the configured ones: key -> (scenario, extra overrides, environment)
VARIANTS = {"v5p/t8k/remat-policies": ("t8k", ["plan.remat_policies=[minimal,save_moe_proj,save_moe_exchange]"],
                                       {"LIBTPU_INIT_ARGS": " "}),   # libtpu's own defaults, not the launch flags
            # v6e under the launch flags: its 32 GB hold what save_moe_exchange keeps, v5e's 16 GB do not
            "v6e/t8k/remat-policies": ("t8k", ["plan.remat_policies=[save_moe_exchange]"], None),
            # v6e's exposed expert exchange: two token slices side by side (one's exchange under the other's
            # experts), and the exchanged rows kept for the backward (no recomputed exchange)
            "v6e/t8k/slices-2-save-exchange": ("t8k", ["model.moe.expert_parallel_slices=2",
                                                       "model.remat_policy=save_moe_exchange"], None)}
DEPTH_LAYERS = 9
FLOPS_KEYS = ("v5p/t8k/configured", "v5p/t128k/configured")   # the plans whose compiled FLOPs are itemised


def mesh_overrides(parallel) -> list[str]:
    return [f"parallel.{k}={getattr(parallel, k)}" for k in ("data", "fsdp", "tensor", "expert", "context")]


def meshes(scenario: str) -> list[list[str]]:
    """Override lists of the meshes to plan for `scenario`: the configured one, then the planner's candidates."""
    from lingpack.plan import cli as plan
    from lingpack.plan import measure as plan_measure
    rc = plan.run_config(plan.compose(SCENARIOS[scenario], plan.find_conf_dir(str(ROOT / "conf"))))
    return [[]] + [mesh_overrides(p) for p in plan_measure.candidate_meshes(rc, DEVICES, SEARCH - 1)]


def run_plan(overrides: list[str], timeout: int, chip: str = "v5p", env: dict | None = None) -> dict:
    """One `python -m lingpack.plan` process: its JSON plus wall and CPU seconds (the process and its children)."""
    out = OUT / "tmp_plan.json"
    cmd = [sys.executable, "-m", "lingpack.plan", *overrides, f"plan.devices={DEVICES}", f"plan.chip={chip}",
           f"plan.output={out}"]
    print(" ".join(cmd[1:]), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))
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


def gib(b: float) -> str:
    return f"{b / 2**30:.1f}"


def _twin(key: str) -> dict | None:
    """The XLA:CPU twin's plan of the same scenario and mesh (v5p's compile; judged on `chip` by its roofline)."""
    if not TWIN.exists():
        return None
    chip, rest = key.split("/", 1)
    twin = json.loads(TWIN.read_text()).get(rest)
    if not twin or "error" in twin:
        return None
    from lingpack.plan import chips
    from lingpack.plan import measure as plan_measure
    return plan_measure.assess(twin, chips.chip(chip))


def _settings(r: dict) -> str:
    """The model overrides a plan was made with (its scenario's and variant's, as recorded), as the table's mesh
    cell shows them after the mesh."""
    model = [o.split(".", 1)[1] for o in r.get("config", {}).get("overrides", []) if o.startswith("model.")]
    return "".join(f", {o}" for o in model)


def table(res: dict) -> str:
    """The docs block: every (chip, scenario, mesh) XLA:TPU planned, the XLA:CPU twin beside it as a comparison."""
    title = {"t8k": "T=8192, 64 rows", "t128k": "T=131072, 8 rows, CP ring"}
    lines = ["| chip | scenario | mesh | XLA:TPU flags | XLA:TPU per device (GiB) | HBM (GiB) | fits | est. step "
             "| MFU at est. | compiled / analytic+remat FLOPs | XLA:TPU compile wall | XLA:CPU twin (comparison): per "
             "device, est. step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in sorted(res.items()):
        chip, scenario, _ = (key.split("/") + ["", ""])[:3]
        if scenario not in SCENARIOS:
            continue
        if "error" in r:
            lines.append(f"| {chip} | {title[scenario]} | {key.split('/', 2)[2]} | | {r['error']} | | | | | | | |")
            continue
        f = r["step_flops"]
        twin = _twin(key)
        compare = (f"{gib(twin['per_device_bytes'])} GiB, {twin['est_step_s']:.1f} s" if twin else "-")
        wall = sum(r["breakdown"].get("compile_wall_s", [0]))
        flags = "launch scripts'" if r.get("libtpu_init_args") else "libtpu defaults"
        lines.append(f"| {DEVICES} x {chip} | {title[scenario]} | {r['mesh']}{_settings(r)} | {flags} | {gib(r['per_device_bytes'])} | "
                     f"{gib(r['hbm_bytes'])} | {'yes' if r['fits'] else 'no'} | {r['est_step_s'] * 1e3:.0f} ms | "
                     f"{r['mfu_at_est']:.1%} | {f['compiled'] / (f['analytic'] + f['remat']):.2f} | "
                     f"{wall / 60:.1f} min | {compare} |")
    for key, r in sorted(res.items()):
        if r.get("candidates"):
            lines += ["", f"Remat policies planned on {key}'s mesh ({DEVICES} x {key.split('/')[0]}, "
                      f"{title[key.split('/')[1]]}, XLA:TPU flags: "
                      f"{'the launch scripts' if r.get('libtpu_init_args') else 'libtpu defaults'}):", "",
                      "| remat policy | per device (GiB) | fits | est. step | MFU at est. |", "|---|---|---|---|---|"]
            lines += [f"| {c.get('remat_policy') or 'none'} | {gib(c['per_device_bytes'])} | "
                      f"{'yes' if c['fits'] else 'no'} | {c['est_step_s'] * 1e3:.0f} ms | {c['mfu_at_est']:.1%} |"
                      if "finding" not in c else f"| {c['mesh']} | - | no | {c['finding']} | - |"
                      for c in r["candidates"]]
    for key, r in sorted(res.items()):
        if "error" in r or "cost" not in r.get("breakdown", {}) or r.get("candidates"):
            continue
        parts = sorted(r["breakdown"]["cost"]["by_part"].items(), key=lambda kv: -kv[1])
        top = r["breakdown"].get("top", [])[:3]
        lines += ["", f"Where the step's time goes ({key}, XLA:TPU's program costed by `lingpack.plan.cost`): "
                  + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in parts if v >= 5e-4) + "; costliest instructions: "
                  + "; ".join(f"{t['op']} {t['seconds'] * 1e3:.0f} ms over {t['runs']:.0f} runs" for t in top) + "."]
        lines += [f"Note ({key}): {n}" for n in r.get("notes", []) if n.startswith("the XLA:TPU compile is of")]
    lines += flops_table(res)
    commits = sorted({r.get("commit", "?") for r in res.values() if isinstance(r, dict)})
    lines += ["", f"Measured at commit {', '.join(commits)}: XLA:TPU (libtpu 0.0.42.1) compiling for each slice's "
              "topology on a shared 2-core CPU host, no TPU attached; `python -m experiments.plan.flagship` "
              "regenerates this block."]
    return "\n".join(lines) + "\n"


def flops_table(res: dict) -> list[str]:
    """The compiled programs' FLOPs per device by model part, and the Mosaic kernels' declared share, against the
    analytic count (`train/flops.py`) plus the recompute of the remat policy and the chunked heads (FLOPS_KEYS)."""
    plans = {k: res[k] for k in FLOPS_KEYS if k in res and "flops_by_part" in res[k]["breakdown"].get("cost", {})}
    if not plans:
        return []
    tf = lambda v: f"{v / 1e12:.1f}"
    rows = {"analytic (`train/flops.py`)": [p["step_flops"]["analytic"] for p in plans.values()],
            "recompute (remat policy, chunked heads)": [p["step_flops"]["remat"] for p in plans.values()],
            "compiled": [p["step_flops"]["compiled"] for p in plans.values()]}
    names = {n for p in plans.values() for n in p["breakdown"]["cost"]["flops_by_part"]}
    parts = {f"compiled: {n}": [p["breakdown"]["cost"]["flops_by_part"].get(n, 0.0) for p in plans.values()]
             for n in names}
    kinds = {k for p in plans.values() for k in p["breakdown"]["cost"]["flops_by_kind"] if k.startswith("kernel ")}
    kernels = {f"of which Mosaic `{k.removeprefix('kernel ')}`": [p["breakdown"]["cost"]["flops_by_kind"].get(k, 0.0)
                                                                  for p in plans.values()] for k in kinds}
    lines = ["", "Compiled FLOPs per device (TFLOP, loop trip counts in; the Mosaic kernels by their CostEstimates, "
             "Megablox's at the rows it runs) against the analytic count and its recompute:", "",
             "| | " + " | ".join(plans) + " |", "|---|" + "---:|" * len(plans)]
    for table in (rows, dict(sorted(parts.items(), key=lambda kv: (-kv[1][0], kv[0]))),   # ties by name: the
                  dict(sorted(kernels.items(), key=lambda kv: (-kv[1][0], kv[0])))):     # same text every render
        lines += [f"| {name} | " + " | ".join(tf(v) for v in values) + " |" for name, values in table.items()]
    ratio = [p["step_flops"]["compiled"] / (p["step_flops"]["analytic"] + p["step_flops"]["remat"])
             for p in plans.values()]
    return lines + ["| compiled / (analytic + recompute) | " + " | ".join(f"{x:.2f}" for x in ratio) + " |"]


def write(res: dict) -> None:
    """The JSON artifact, and every docs block of the table rewritten from it."""
    from experiments import blocks as pages  # the blocks' registry: no import of the check back
    OUT.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    for page, text in pages.read_pages().items():
        if "<!-- results: plan_flagship -->" in text:
            (ROOT / page).write_text(pages.write(text))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rerun", action="store_true", help="plan every key again")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--search", action="store_true", help="also plan the planner's candidate meshes")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per planner process")
    parser.add_argument("--only", nargs="+", metavar="KEY", help="plan only these keys (e.g. v5p/t8k/configured)")
    parser.add_argument("--ingest", nargs=2, metavar=("KEY", "PLAN_JSON"),
                        help="record the plan.output of a `python -m lingpack.plan` run made by hand under KEY")
    args = parser.parse_args()
    res = {} if args.rerun or not ARTIFACT.exists() else json.loads(ARTIFACT.read_text())
    if args.ingest:
        key, path = args.ingest
        res[key] = dict(json.loads(Path(path).read_text()), commit=commit())
        args.table_only = True
    if not args.table_only:
        todo = []
        for chip, scenarios in PLANNED.items():
            for scenario in scenarios:
                for extra in (meshes(scenario) if args.search else [[]]):
                    mesh = "configured" if not extra else " ".join(e.split(".", 1)[1] for e in extra)
                    todo.append((f"{chip}/{scenario}/{mesh}", SCENARIOS[scenario] + extra, chip))
        todo += [(key, SCENARIOS[scenario] + extra, key.split("/")[0], env)
                 for key, (scenario, extra, env) in VARIANTS.items()]
        for key, overrides, chip, *env in todo:
            if (key in res and "error" not in res[key]) or (args.only and key not in args.only):
                continue
            res[key] = run_plan(overrides, args.timeout, chip, *env)
            write(res)
    write(res)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
