"""Phantom-segment overhead: the RFC's aligned cu_seqlens kernel vs the segment-native kernel, by max_segs.

    python experiments/phantom_overhead/sweep.py [--quick] [--out experiments/phantom_overhead/results]

Forward+backward time of a T=8192 packed row (log-normal document lengths) over the same tokens as one
unpacked document, per design, measured in one process (bench_kda.part2), next to the aligned design's
predicted buffer growth T_new/T. Writes results.md (the README's table), results.json and overhead.png.
The training-level view of the same question: `python run.py -m experiment=phantom_sweep kernel.max_segs=8,16,32,64,128`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
from bench_kda import part2  # noqa: E402

from lingpack.tracking.plots import plot_phantom_overhead  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "phantom_overhead" / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = part2(1 if args.quick else 3, [8, 32, 128] if args.quick else [8, 16, 32, 64, 128])
    rows = result["rows"]
    lines = [f"Packed / unpacked forward+backward time at T=8192 ({result['documents']} documents), same run:", "",
             "| max_segs | aligned (cu_seqlens) | aligned predicted T_new/T | segment-native |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['max_segs']} | {r['aligned_packed_over_unpacked']:.2f} | "
                     f"{r['aligned_predicted_t_new_over_t']:.2f} | {r['native_packed_over_unpacked']:.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(result, indent=2))
    plot_rows = [{"max_segs": r["max_segs"], "design": design, "ratio": r[key]} for r in rows for design, key in
                 [("aligned (measured)", "aligned_packed_over_unpacked"),
                  ("aligned (predicted T_new/T)", "aligned_predicted_t_new_over_t"),
                  ("segment-native (measured)", "native_packed_over_unpacked")]]
    plot_phantom_overhead(plot_rows, out / "overhead.png", title="packed / unpacked time vs max_segs (T=8192)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
