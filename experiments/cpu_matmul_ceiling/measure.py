"""How much does the CPU matmul ceiling behind `mfu` on CPU vary between processes?

    python experiments/cpu_matmul_ceiling/measure.py [--processes 8] [--out experiments/cpu_matmul_ceiling/results]

Starts fresh Python processes, alternating two ways of measuring, each once per process as a run does:
`lingpack.train.flops.measured_matmul_flops()` (a 1024^2 fp32 matmul, best of 5: what the run uses) and a
longer variant (2048^2, best of 10). Records each figure, the spread (max / min) per method and the machine
load, in results/ceiling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = {"run (1024, best of 5)": dict(size=1024, repeats=5), "long (2048, best of 10)": dict(size=2048, repeats=10)}
CHILD = ("import json, sys; from lingpack.train.flops import measured_matmul_flops; "
         "print(json.dumps(measured_matmul_flops(**json.loads(sys.argv[1]))))")


def measure_once(kwargs: dict) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kwargs)], check=True, capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=8, help="processes per method")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    figures = {name: [] for name in METHODS}
    loads = []
    for _ in range(args.processes):
        for name, kwargs in METHODS.items():  # interleaved: both methods see the same machine load
            loads.append(os.getloadavg()[0])
            figures[name].append(measure_once(kwargs))
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, shared with other jobs",
              "load_average_1min": {"min": min(loads), "max": max(loads)}, "time": time.strftime("%Y-%m-%d %H:%M"),
              "methods": {}}
    for name, values in figures.items():
        gflops = [v / 1e9 for v in values]
        result["methods"][name] = {"gflop_per_s": gflops, "min": min(gflops), "median": statistics.median(gflops),
                                   "max": max(gflops), "max_over_min": max(gflops) / min(gflops)}
        print(f"{name:>24}: median {statistics.median(gflops):6.1f} GFLOP/s, min {min(gflops):6.1f}, "
              f"max {max(gflops):6.1f}, max/min {max(gflops) / min(gflops):.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ceiling.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
