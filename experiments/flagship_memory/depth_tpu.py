"""Stacked against unrolled layers at one depth, compiled by XLA:TPU: does an unrolled flagship layer cost more?

    python -m experiments.flagship_memory.depth_tpu [--layers 9] [--table-only]

The flagship (conf/model/ling3_flagship.yaml, TPU kernels: splash, KDA `pallas_segment`) cut to `--layers` layers
(9 = one dense and 8 MoE layers, the fewest the layer scan stacks: two cycles of the MLA interval), `fsdp=8`,
one row of T=8192 per device, compiled by libtpu for 8 v5p chips (`v5p:2x2x2`, megacore) twice: with
`scan_layers` (the MoE layers in one scan) and without (each layer its own code). Each compile runs in its own
process. Writes results/depth_tpu.json (`memory_analysis()` per device, merged per case); `table()` renders the
`flagship_depth_tpu` results block.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments.provenance import commit

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "results" / "depth_tpu.json"
TOPOLOGY, DEVICES, T = "v5p:2x2x2", 8, 8192


def one(layers: int, scan: bool) -> dict:
    """Compile the cut flagship's train step for 8 v5p chips in this process and read its memory."""
    from experiments import xla_tpu

    from experiments.flagship_memory.flagship import TPU_MODEL, model_config
    from lingpack import backend
    from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
    from lingpack.train.program import TrainProgram

    model = model_config(dict(num_layers=layers, scan_layers=scan), "tpu")
    with backend.target("tpu"):
        program = TrainProgram.build(model, LossConfig(), OptimConfig(decay_steps=10), ParallelConfig(data=1, fsdp=8),
                                     TrainConfig(), rows=DEVICES, seq_length=T, devices=xla_tpu.devices(TOPOLOGY))
        lowered = program.lower()
    start = time.process_time()
    compiled = lowered.compile()
    return {"compiler": "xla_tpu", "topology": TOPOLOGY, "layers": layers, "scan_layers": scan, "T": T,
            "rows": DEVICES, "model": TPU_MODEL, **xla_tpu.memory(compiled),
            "compile_cpu_s": round(time.process_time() - start, 1)}


def table(results: dict) -> str:
    """The `flagship_depth_tpu` block: the stacked and the unrolled step of each depth, side by side."""
    lines = ["The flagship cut to L layers, `fsdp=8`, one row of T=8192 per device, compiled by XLA:TPU (libtpu) for "
             "8 v5p chips (`v5p:2x2x2`, megacore; splash, KDA `pallas_segment`), with the MoE layers in one scan "
             "(`scan_layers`) and each layer unrolled. GiB per device from `memory_analysis()`.", "",
             "| layers | layout | temporaries GiB | arguments GiB | peak GiB | unrolled / stacked temporaries | "
             "compile CPU s | commit |", "|---:|---|---:|---:|---:|---:|---:|---|"]
    for key in sorted(results, key=lambda k: (results[k]["layers"], not results[k]["scan_layers"])):
        r = results[key]
        stacked = results.get(f"{r['layers']}/stacked")
        ratio = f"{r['temp'] / stacked['temp']:.2f}" if stacked and not r["scan_layers"] else "-"
        lines.append(f"| {r['layers']} | {'stacked' if r['scan_layers'] else 'unrolled'} | {r['temp'] / 2**30:.1f} | "
                     f"{r['argument'] / 2**30:.1f} | {r['peak'] / 2**30:.1f} | {ratio} | {r['compile_cpu_s']:.0f} | "
                     f"{r['commit']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)   # worker: layers stacked|unrolled -> JSON on stdout
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1] == "stacked")))
        return 0
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    for layout in ([] if args.table_only else ["stacked", "unrolled"]):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-m", "experiments.flagship_memory.depth_tpu", "--one", str(args.layers),
                               layout], env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            print(f"{args.layers} layers, {layout}: compile failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        result = dict(json.loads(proc.stdout.strip().splitlines()[-1]), commit=commit(),
                      machine="XLA:TPU (libtpu), compiled on a shared 2-core CPU host")
        results[f"{args.layers}/{layout}"] = result
        OUT.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(f"{args.layers} layers {layout}: temp {result['temp'] / 2**30:.1f} GiB, peak {result['peak'] / 2**30:.1f} GiB, "
              f"compile {result['compile_cpu_s']} s", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
