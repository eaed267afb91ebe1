"""Every results block in the docs is what its benchmark's renderer makes of its committed JSON artifact.

    python -m experiments.check_results [--write]          (`make check-results`)

A block sits in README.md, docs/*.md or experiments/*/README.md between `<!-- results: NAME -->` and
`<!-- /results -->`. Each NAME has one artifact and one renderer (a function of the script that writes the
artifact); the check fails when a block differs from the rendering, when a block names no known artifact,
when an artifact is missing or appears in no block of docs/benchmarks.md, or when an artifact contradicts
itself (bench_kda's speed-ups must be its own timings' ratios; every loss-parity row must match its run's
summary.json and every variant of run_parity.py must have a row). `--write` rewrites every block.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- results: (\w+) -->\n)(.*?)(<!-- /results -->)", re.S)
PAGES = ["README.md", "docs/*.md", "experiments/*/README.md"]
INDEX = "docs/benchmarks.md"   # holds every block


def _load(path: str):
    return json.loads((ROOT / path).read_text())


def renderers() -> dict:
    """Block name -> (artifact, the script that writes it, a function of nothing that renders the block)."""
    from experiments.bench_kda import bench as bench_kda
    from experiments.bench_train import bench as bench_train
    from experiments.context_parallel import attribution as cp_attribution, bench as cp_bench, context_schedule
    from experiments.context_parallel import model_memory, ring_memory
    from experiments.expert_parallel import bench as ep_bench
    from experiments.flagship_memory import flagship as flagship_memory
    from experiments.loss_parity import run_parity
    from experiments.make_run import run_default
    from experiments.pallas_cost import cost_model
    from experiments.phantom_overhead import sweep
    from experiments.plan import flagship as plan_flagship
    from experiments.tpu_flags import measure as tpu_flags
    from experiments.whole_document_packing import fill as packing_fill

    def cp_table():
        result = _load("experiments/context_parallel/results/results.json")
        return cp_bench.table(result["memory"], result["balance"], result.get("commit", "-"))
    pallas = "experiments/pallas_cost/results/results.json"
    memory = "experiments/context_parallel/results/model_memory.json"
    schedule = "experiments/context_parallel/results/context_schedule.json"
    plans = "experiments/plan/results/flagship.json"
    attribution = "experiments/context_parallel/results/attribution.json"
    ring_kinds = "experiments/context_parallel/results/ring_memory.json"
    expert = "experiments/expert_parallel/results/results.json"
    fill = "experiments/whole_document_packing/results/fill.json"
    flags = "experiments/tpu_flags/results/flags.json"
    flagship_mem = "experiments/flagship_memory/results/flagship.json"
    return {
        "make_run": ("experiments/make_run/results/summary.json", run_default,
                     lambda: run_default.table(_load("experiments/make_run/results/summary.json"))),
        "bench_kda": ("experiments/bench_kda/results/bench_kda.json", bench_kda,
                      lambda: bench_kda.table(_load("experiments/bench_kda/results/bench_kda.json"))),
        "bench_train": ("experiments/bench_train/results/bench_train.json", bench_train,
                        lambda: bench_train.table(_load("experiments/bench_train/results/bench_train.json"))),
        "pallas_cost": (pallas, cost_model, lambda: cost_model.summary(_load(pallas))),
        "pallas_cost_detail": (pallas, cost_model, lambda: cost_model.markdown(_load(pallas))),
        "phantom_overhead": ("experiments/phantom_overhead/results/results.json", sweep,
                             lambda: sweep.table(_load("experiments/phantom_overhead/results/results.json"))),
        "loss_parity": ("experiments/loss_parity/results/results.json", run_parity,
                        lambda: run_parity.table(_load("experiments/loss_parity/results/results.json"))),
        "context_parallel": ("experiments/context_parallel/results/results.json", cp_bench, cp_table),
        "context_parallel_model": (memory, model_memory, lambda: model_memory.table(_load(memory))),
        "context_schedule": (schedule, context_schedule, lambda: context_schedule.table(_load(schedule))),
        "plan_flagship": (plans, plan_flagship, lambda: plan_flagship.table(_load(plans))),
        "cp_attribution": (attribution, cp_attribution, lambda: cp_attribution.table(_load(attribution))),
        "ring_memory": (ring_kinds, ring_memory, lambda: ring_memory.table(_load(ring_kinds))),
        "expert_parallel": (expert, ep_bench, lambda: ep_bench.table(_load(expert))),
        "whole_document_packing": (fill, packing_fill, lambda: packing_fill.table(_load(fill))),
        "tpu_flags": (flags, tpu_flags, lambda: tpu_flags.table(_load(flags))),
        "flagship_memory_tpu": (flagship_mem, flagship_memory, lambda: flagship_memory.tpu_table(_load(flagship_mem))),
    }


def _bench_kda_problems() -> list[str]:
    p1 = _load("experiments/bench_kda/results/bench_kda.json")["part1"]
    chunked = p1["times_s"]["lingpack chunked (segment-native)"]
    return [f"bench_kda.json: {key} is not its own timings' ratio (mixed runs?)"
            for key, peer in (("speedup_vs_fla_naive_chunk", "FLA naive_chunk_kda (torch)"),
                              ("speedup_vs_transformers", "transformers chunk_kimi_delta_attention (torch)"))
            if not math.isclose(p1[key], p1["times_s"][peer] / chunked, rel_tol=1e-9)]


def _loss_parity_problems() -> list[str]:
    """results.json's rows are the runs' own records (`run_parity.row_of` of each run directory), one per
    variant of the script."""
    from experiments.loss_parity.run_parity import STALE, VARIANTS, row_of, run_dir_of
    out = ROOT / "experiments" / "loss_parity" / "results"
    rows = json.loads((out / "results.json").read_text())
    named = {r["variant"].removesuffix(STALE) for r in rows}
    problems = [f"loss parity: no row for the variant {v!r}: python -m experiments.loss_parity.run_parity --only {v!r}"
                for v in VARIANTS if v not in named]
    for r in rows:
        name = r["variant"].removesuffix(STALE)
        if name in VARIANTS and json.loads(json.dumps(row_of(name, VARIANTS[name][1], run_dir_of(name, out)))) != r:
            problems.append(f"loss parity row {r['variant']!r} differs from its run's files (summary.json, parity/)")
    return problems


def read_pages() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for pattern in PAGES for p in sorted(ROOT.glob(pattern))}


def problems(pages: dict[str, str]) -> list[str]:
    known, out, rendered = renderers(), [], {}
    for name, (artifact, script, render) in known.items():
        if not (ROOT / artifact).exists():
            out.append(f"{artifact} is missing: run python -m {script.__name__}")
        else:
            rendered[name] = render()
    for page, text in pages.items():
        for m in BLOCK.finditer(text):
            name, body = m.group(2), m.group(3)
            if name not in known:
                out.append(f"{page} has a results block {name!r} that no artifact renders")
            elif name in rendered and body != rendered[name]:
                artifact, script, _ = known[name]
                out.append(f"{page}'s {name!r} block differs from what {script.__name__} renders of {artifact};"
                           " python -m experiments.check_results --write rewrites it")
    indexed = {m.group(2) for m in BLOCK.finditer(pages.get(INDEX, ""))}
    out += [f"{INDEX} lacks the block <!-- results: {name} --> ... <!-- /results -->"
            for name in known if name not in indexed and name != "pallas_cost_detail"]
    return out + _bench_kda_problems() + _loss_parity_problems()


def write(text: str) -> str:
    present = {name: r for name, r in renderers().items() if (ROOT / r[0]).exists()}
    return BLOCK.sub(lambda m: m.group(1) + present[m.group(2)][2]() + m.group(4)
                     if m.group(2) in present else m.group(0), text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite every block from its artifact")
    args = parser.parse_args()
    if args.write:
        for page, text in read_pages().items():
            if BLOCK.search(text):
                (ROOT / page).write_text(write(text))
    found = problems(read_pages())
    for line in found:
        print("FAIL:", line)
    print("every results block matches its artifact" if not found else f"{len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
