"""Phantom-segment overhead: the aligned cu_seqlens kernel vs the segment-native kernel, by max_segs.

    python -m experiments.phantom_overhead.sweep [--quick] [--out experiments/phantom_overhead/results]

Forward+backward time of a T=8192 packed row (log-normal document lengths) over the same tokens as one
unpacked document, per design, measured in one process (`bench_kda.bench.part2`), next to the aligned design's
predicted buffer growth T_new/T (docs/design.md#aligned-cu_seqlens-layout). Writes results.json (whose `table`
is the `phantom_overhead` results block of the docs) and overhead.png.
The training-level view of the same question:
`python run.py -m experiment=phantom_sweep kernel.max_segs=8,16,32,64,128`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.bench_kda.bench import part2
from experiments.provenance import commit
from lingpack.tracking.plots import plot_phantom_overhead

RESULTS = Path(__file__).resolve().parent / "results"


def table(result: dict) -> str:
    """The `phantom_overhead` results block, from results.json."""
    lines = [f"Packed / unpacked forward+backward time at T=8192 ({result['documents']} documents), same run,"
             f" lingpack at commit {result.get('commit', '-')}:", "",
             "| max_segs | aligned (cu_seqlens) | aligned predicted T_new/T | segment-native |", "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['max_segs']} | {r['aligned_packed_over_unpacked']:.2f} | "
                     f"{r['aligned_predicted_t_new_over_t']:.2f} | {r['native_packed_over_unpacked']:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"commit": commit(), **part2(1 if args.quick else 3, [8, 32, 128] if args.quick else [8, 16, 32, 64, 128])}
    rows = result["rows"]
    (out / "results.json").write_text(json.dumps(result, indent=2))
    plot_rows = [{"max_segs": r["max_segs"], "design": design, "ratio": r[key]} for r in rows for design, key in
                 [("aligned (measured)", "aligned_packed_over_unpacked"),
                  ("aligned (predicted T_new/T)", "aligned_predicted_t_new_over_t"),
                  ("segment-native (measured)", "native_packed_over_unpacked")]]
    plot_phantom_overhead(plot_rows, out / "overhead.png", title="packed / unpacked time vs max_segs (T=8192)")
    print(table(result))


if __name__ == "__main__":
    main()
