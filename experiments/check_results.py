"""Every results block in the docs is what its benchmark's renderer makes of its committed JSON artifact,
and says so when the code it measured has changed since.

    python -m experiments.check_results [--write] [--rerun-cheap] [--fail-stale]   (`make check-results`)

The blocks, their artifacts, renderers and code paths are registered in `experiments/blocks.py`. The check
fails when a block differs from the rendering, when a block names no known artifact, when an artifact is
missing or appears in no block of docs/benchmarks.md, when an artifact contradicts itself (bench_kda's
speed-ups must be its own timings' ratios; every loss-parity row must match its run's summary.json and every
variant of run_parity.py must have a row), or when a block's "stale since <commit>" line does not match the
git history (a commit after the measured one changed its code). It lists every stale block. `--write`
rewrites every block (staleness lines included), `--rerun-cheap` first remeasures the stale blocks cheap
enough to rerun here (make_run; `make test-all` does), `--fail-stale` makes a stale block a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from experiments import blocks

ROOT = blocks.ROOT
BLOCK = blocks.BLOCK
INDEX = "docs/benchmarks.md"   # holds every block
_load = blocks.load


def renderers() -> dict:
    """Block name -> (artifact, the command that writes it, a function of nothing that renders its table)."""
    return {name: (b.artifact, b.rerun, lambda name=name: blocks.table(name)) for name, b in blocks.BLOCKS.items()}


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


read_pages = blocks.read_pages
write = blocks.write


def stale_report() -> dict:
    """Block name -> its Staleness (one git log per recorded commit)."""
    return {name: blocks.block_staleness(name) for name, b in blocks.BLOCKS.items() if (ROOT / b.artifact).exists()}


def problems(pages: dict[str, str], stale: dict | None = None) -> list[str]:
    """What fails the check. A stale block must say so (its staleness line); without a git history the line is
    not checked."""
    known, out, rendered = blocks.BLOCKS, [], {}
    stale = stale_report() if stale is None else stale
    for name, block in known.items():
        if not (ROOT / block.artifact).exists():
            out.append(f"{block.artifact} is missing: run {block.rerun}")
        else:
            rendered[name] = blocks.table(name)
    for page, text in pages.items():
        for m in BLOCK.finditer(text):
            name, body = m.group(2), m.group(3)
            if name not in known:
                out.append(f"{page} has a results block {name!r} that no artifact renders")
                continue
            if name not in rendered:
                continue
            table, line = blocks.MARK.sub("", body), blocks.MARK.match(body)
            if table != rendered[name]:
                out.append(f"{page}'s {name!r} block differs from what {known[name].renderer} renders of "
                           f"{known[name].artifact}; python -m experiments.check_results --write rewrites it")
            elif name in stale and stale[name].unknown is None and (line.group(0) if line else "") != blocks.mark(
                    name, stale[name]):
                out.append(f"{page}'s {name!r} block " + (f"is stale since {stale[name].since} and does not say so"
                                                          if stale[name].since else "says it is stale but is not")
                           + "; python -m experiments.check_results --write marks it")
    indexed = {m.group(2) for m in BLOCK.finditer(pages.get(INDEX, ""))}
    out += [f"{INDEX} lacks the block <!-- results: {name} --> ... <!-- /results -->"
            for name in known if name not in indexed and name != "pallas_cost_detail"]
    return out + _bench_kda_problems() + _loss_parity_problems()


def rerun_cheap(stale: dict) -> list[str]:
    """Remeasure every stale cheap block (its command, this interpreter); the names rerun."""
    import shlex
    import subprocess
    names = [n for n, s in stale.items() if s.since and blocks.BLOCKS[n].cheap]
    for name in names:
        cmd = shlex.split(blocks.BLOCKS[name].rerun)
        print(f"rerunning the stale block {name!r}: {' '.join(cmd)}", flush=True)
        subprocess.run([sys.executable, *cmd[1:]] if cmd[0] == "python" else cmd, cwd=ROOT, check=True)
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite every block from its artifact")
    parser.add_argument("--rerun-cheap", action="store_true",
                        help="first remeasure every stale block cheap enough (make_run), then rewrite its pages")
    parser.add_argument("--fail-stale", action="store_true", help="a stale block fails the check too")
    args = parser.parse_args()
    stale = stale_report()
    if args.rerun_cheap and rerun_cheap(stale):
        stale = stale_report()
        blocks.rewrite()
    if args.write:
        blocks.rewrite()
    found = problems(read_pages(), stale)
    for name, s in stale.items():
        if s.since:
            print(f"STALE: {name}: since {s.since} ({', '.join(s.changed)} changed after {', '.join(s.recorded)});"
                  f" rerun: {blocks.BLOCKS[name].rerun}")
            if args.fail_stale:
                found.append(f"{name} is stale since {s.since}")
        elif s.unknown:
            print(f"note: {name}: staleness unknown ({s.unknown})")
    for line in found:
        print("FAIL:", line)
    print("every results block matches its artifact" if not found else f"{len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
