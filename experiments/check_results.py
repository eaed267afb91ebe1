"""Check that every results table in README.md and docs/ is the one its committed script wrote (`make check-results`).

    python experiments/check_results.py [--write]

A table sits in README.md (or, for PAGE_ARTIFACTS, in its docs page) between `<!-- results: NAME -->` and
`<!-- /results -->`; NAME's artifact below is a Markdown file written by the named script. The check fails when a block differs from its artifact,
when a block or artifact is missing, or when a Markdown artifact no longer renders from its JSON:
bench_kda.md from bench_kda.json (whose derived ratios must also follow from its own timings), the Pallas
cost reports from results.json, the loss-parity table from results.json, whose rows must match each run's
summary.json and cover every variant of run_parity.py. `--write` copies the artifacts into README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = {   # README block -> (artifact, the committed script that writes it)
    "bench_kda": ("experiments/results/bench_kda.md", "experiments/bench_kda.py"),
    "phantom_overhead": ("experiments/phantom_overhead/results/results.md", "experiments/phantom_overhead/sweep.py"),
    "make_run": ("experiments/make_run/results/results.md", "experiments/make_run/run_default.py"),
    "context_parallel": ("experiments/context_parallel/results/results.md", "experiments/context_parallel/bench.py"),
    "pallas_cost": ("experiments/pallas_cost/readme.md", "experiments/pallas_cost/cost_model.py"),
    "context_parallel_model": ("experiments/context_parallel/results/model_memory.md",
                               "experiments/context_parallel/model_memory.py"),
    "kda_cp_fold_vs_scan": ("experiments/context_parallel/results/fold_vs_scan.md",
                            "experiments/context_parallel/fold_vs_scan.py"),
    "context_schedule": ("experiments/context_parallel/results/context_schedule.md",
                         "experiments/context_parallel/context_schedule.py"),
}
PAGE_ARTIFACTS = {   # docs page block -> (page, artifact, the committed script that writes both)
    "loss_parity": ("docs/parity.md", "experiments/loss_parity/results/results.md",
                    "experiments/loss_parity/run_parity.py"),
    "expert_parallel": ("docs/parallelism.md", "experiments/expert_parallel/results/results.md",
                        "experiments/expert_parallel/bench.py"),
}
BLOCK = re.compile(r"(<!-- results: (\w+) -->\n)(.*?)(<!-- /results -->)", re.S)


def _bench_problems() -> list[str]:
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_kda import table
    result = json.loads((ROOT / "experiments/results/bench_kda.json").read_text())
    p1, problems = result["part1"], []
    chunked = p1["times_s"]["lingpack chunked (segment-native)"]
    for key, peer in (("speedup_vs_fla_naive_chunk", "FLA naive_chunk_kda (torch)"),
                      ("speedup_vs_transformers", "transformers chunk_kimi_delta_attention (torch)")):
        if not math.isclose(p1[key], p1["times_s"][peer] / chunked, rel_tol=1e-9):
            problems.append(f"bench_kda.json: {key} is not its own timings' ratio (mixed runs?)")
    if table(result) != (ROOT / ARTIFACTS["bench_kda"][0]).read_text():
        problems.append("bench_kda.md does not render from bench_kda.json: python experiments/bench_kda.py --table-only")
    return problems


def _pallas_problems() -> list[str]:
    """The Pallas cost reports (results.md, and readme.md for the README) must render from results.json."""
    sys.path.insert(0, str(ROOT / "experiments" / "pallas_cost"))
    from cost_model import markdown, readme_markdown
    folder = ROOT / "experiments" / "pallas_cost"
    results = json.loads((folder / "results.json").read_text())
    return [f"experiments/pallas_cost/{name} does not render from results.json: python "
            "experiments/pallas_cost/cost_model.py --report"
            for name, render in (("results.md", markdown), ("readme.md", readme_markdown))
            if render(results) != (folder / name).read_text()]


def _loss_parity_problems() -> list[str]:
    """results.md renders from results.json, whose rows are the runs' own records (`run_parity.row_of` of each run
    directory), one per variant of the script."""
    sys.path.insert(0, str(ROOT / "experiments" / "loss_parity"))
    from run_parity import VARIANTS, row_of, run_dir_of, table
    out = ROOT / "experiments" / "loss_parity" / "results"
    rows, problems = json.loads((out / "results.json").read_text()), []
    if table(rows) != (out / "results.md").read_text():
        problems.append("experiments/loss_parity/results/results.md does not render from results.json")
    named = {r["variant"].removesuffix(" (previous run)") for r in rows}
    problems += [f"loss parity: no row for the variant {v!r}: python experiments/loss_parity/run_parity.py --only {v!r}"
                 for v in VARIANTS if v not in named]
    for r in rows:
        name = r["variant"].removesuffix(" (previous run)")
        if name in VARIANTS and json.loads(json.dumps(row_of(name, VARIANTS[name][1], run_dir_of(name, out)))) != r:
            problems.append(f"loss parity row {r['variant']!r} differs from its run's files (summary.json, parity/)")
    return problems


def page_problems(pages: dict[str, str]) -> list[str]:
    """Each PAGE_ARTIFACTS block is in its docs page (`pages`: path -> text) and equal to its artifact."""
    out = []
    for name, (page, artifact, script) in PAGE_ARTIFACTS.items():
        found = {m.group(2): m.group(3) for m in BLOCK.finditer(pages.get(page, ""))}
        if name not in found:
            out.append(f"{page} lacks the block <!-- results: {name} --> ... <!-- /results --> for {artifact}")
        elif found[name] != (ROOT / artifact).read_text():
            out.append(f"{page}'s {name!r} block differs from {artifact} (written by {script}, which rewrites it)")
    return out


def read_pages() -> dict[str, str]:
    return {page: (ROOT / page).read_text() for page, _, _ in PAGE_ARTIFACTS.values() if (ROOT / page).exists()}


def problems(readme: str, pages: dict[str, str] | None = None) -> list[str]:
    """Every problem of README.md's blocks and of the docs pages' (`pages`: path -> text; None reads them)."""
    found = {m.group(2): m.group(3) for m in BLOCK.finditer(readme)}
    extra = set(found) - set(ARTIFACTS) - set(PAGE_ARTIFACTS)   # a README copy of a page's block is not its home
    out = [f"README.md has a results block {name!r} with no artifact" for name in sorted(extra)]
    for name, (artifact, script) in ARTIFACTS.items():
        path = ROOT / artifact
        if not path.exists():
            out.append(f"{artifact} is missing: run {script}")
        elif name not in found:
            out.append(f"README.md lacks the block <!-- results: {name} --> ... <!-- /results --> for {artifact}")
        elif found[name] != path.read_text():
            out.append(f"README.md's {name!r} block differs from {artifact} (written by {script});"
                       " python experiments/check_results.py --write copies it in")
    out += page_problems(read_pages() if pages is None else pages)
    return out + _bench_problems() + _pallas_problems() + _loss_parity_problems()


def write(readme: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + (ROOT / ARTIFACTS[m.group(2)][0]).read_text() + m.group(4)
                     if m.group(2) in ARTIFACTS else m.group(0), readme)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="copy every artifact into its README block")
    args = parser.parse_args()
    readme_path = ROOT / "README.md"
    if args.write:
        readme_path.write_text(write(readme_path.read_text()))
    found = problems(readme_path.read_text())
    for line in found:
        print("FAIL:", line)
    print("README results match their artifacts" if not found else f"{len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
