"""The flagship's compiled train step per device: batch collectives, SPMD remat warnings, temporaries.

    python -m experiments.flagship_memory.flagship [--cases fsdp8 fsdp8-whole fsdp8-expert8 ...] [--attribute]

Model: conf/model/ling3_flagship.yaml (24 layers, V=157184, 128 experts, MTP), flash attention (the CPU
compile of `auto`), KDA `chunked`, its `vocab_chunk_size` unless a case says otherwise; one row of T=8192 per
device. Each case compiles in its own process (its fake device count set before JAX starts; XLA's C++ log
on fd 2 captured), abstractly (`TrainProgram.lower().compile()`, nothing runs), and reports:

* `batch_collectives`: all-gathers / all-reduces whose result carries the global rows x T leading dims, or the
  MoE's global token rows (rows * T, rows * T * top_k): activations of every row on every device;
* `remat_warnings`: XLA's "Involuntary full rematerialization" messages (the partitioner replicating a tensor);
* `memory_analysis()`: temporaries and arguments per device;
* with `--attribute`: the values live at the peak of XLA:CPU's buffer assignment (`lingpack.plan.hlo.peak_buffers`),
  grouped by the model part that made them (the named scopes: embed, layer<i>, stack, head, mtp<d>) and by op.

Writes results/flagship.json (one entry per case, merged into what is there). Each compile needs 10-30 GiB
of host memory: run it under `flock /tmp/lingpack-bigmem.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.provenance import commit

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "results"
T = 8192
WARNING = "Involuntary full rematerialization"
# name: (devices, parallel axes, model overrides, tokens per row)
CASES = {
    "fsdp8": (8, dict(data=1, fsdp=8), {}, T),
    "fsdp8-whole": (8, dict(data=1, fsdp=8), dict(vocab_chunk_size=0), T),
    "fsdp8-expert8": (64, dict(data=1, fsdp=8, expert=8), {}, T),
    "fsdp8-4layers": (8, dict(data=1, fsdp=8), dict(num_layers=4), T),
    "fsdp8-8layers": (8, dict(data=1, fsdp=8), dict(num_layers=8), T),
    "fsdp8-9layers": (8, dict(data=1, fsdp=8), dict(num_layers=9), T),   # 1 dense + 8 MoE: the fewest the scan stacks
    "one-2layers-T4096": (1, dict(data=1), dict(num_layers=2, vocab_chunk_size=16384), 4096),
    "one-2layers-T4096-whole": (1, dict(data=1), dict(num_layers=2, vocab_chunk_size=0), 4096),
}


# XLA:TPU mode: the same cases compiled by libtpu for v5p chips (megacore), TPU kernels (splash, KDA pallas_segment)
TPU_TOPOLOGY = {1: "v5p:1x1x1", 8: "v5p:2x2x2", 64: "v5p:4x4x4"}
TPU_MODEL = dict(attention_impl="auto", kda_impl="pallas_segment")


def model_config(overrides: dict, compiler: str = "cpu"):
    import yaml

    from lingpack.models.ling3 import config_from_dict
    d = yaml.safe_load((ROOT / "conf/model/ling3_flagship.yaml").read_text())
    d.update(**(TPU_MODEL if compiler == "tpu" else dict(attention_impl="flash")), **overrides)
    return config_from_dict(d)


def part(buffer) -> str:
    """The model part that produced a buffer: the first named scope of its op name (embed, layer3, stack, ...)."""
    found = re.search(r"/(embed|layer\d+|stack|head|mtp\d+)/", buffer.op_name or "")
    if found:
        return found.group(1)
    return "optimizer/other" if buffer.op_name else "unnamed"


def op_kind(buffer) -> str:
    """The op and the innermost lingpack frame that made a buffer, e.g. 'dot_general @ models/moe.py:123'."""
    op = (buffer.op_name or "?").rsplit("/", 1)[-1]
    frame = buffer.frame_under("lingpack")
    where = f" @ {frame[0].split('/lingpack/', 1)[-1]}:{frame[2]}" if frame else ""
    return op + where


def one(name: str, attribute: bool, compiler: str = "cpu") -> dict:
    """Compile one case in this process (its device count already set) and measure it."""
    import contextlib

    import jax

    from lingpack import backend
    from lingpack.plan import hlo
    from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
    from lingpack.train.program import TrainProgram

    devices, axes, overrides, tokens = CASES[name]
    model = model_config(overrides, compiler)
    if compiler == "tpu":
        from experiments import xla_tpu
        chips, where = xla_tpu.devices(TPU_TOPOLOGY[devices]), backend.target("tpu")
    else:
        chips, where = jax.devices()[:devices], contextlib.nullcontext()
    with where:
        program = TrainProgram.build(model, LossConfig(), OptimConfig(decay_steps=10), ParallelConfig(**axes),
                                     TrainConfig(), rows=devices, seq_length=tokens, devices=chips)
        lowered = program.lower()
    if compiler == "tpu":
        start = time.process_time()
        compiled = lowered.compile()
        return {"compiler": "xla_tpu", "topology": TPU_TOPOLOGY[devices], "devices": devices, "axes": axes,
                "rows": devices, "T": tokens, "model": dict(TPU_MODEL, **overrides), "num_layers": model.num_layers,
                "vocab_chunk_size": model.vocab_chunk_size, **xla_tpu.memory(compiled),
                "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                "argument_bytes": int(compiled.memory_analysis().argument_size_in_bytes),
                "compile_cpu_s": round(time.process_time() - start, 1)}
    start = time.process_time()
    with tempfile.TemporaryDirectory() as dump:
        if attribute:
            compiled, live_range = hlo.compile_with_buffer_dump(lowered, dump)
        else:
            compiled, live_range = lowered.compile(), None
    compile_s = time.process_time() - start
    text = compiled.as_text()
    m = compiled.memory_analysis()
    ops, _ = hlo.collective_ops(text)
    rows_T = {devices * tokens, devices * tokens * model.moe.top_k}
    batch = [f"{op.kind} {op.shape}" for op in ops if op.group_size != 1 and op.kind in ("all-gather", "all-reduce")
             and any(dims[:2] == (devices, tokens) or dims[:1] and dims[0] in rows_T for dims in op.dims)]
    out = {"devices": devices, "axes": axes, "rows": devices, "T": tokens, "model": overrides,
           "vocab_chunk_size": model.vocab_chunk_size, "num_layers": model.num_layers,
           "temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
           "output_bytes": int(m.output_size_in_bytes), "batch_collectives": len(batch),
           "batch_collective_shapes": sorted(set(batch)), "compile_cpu_s": round(compile_s, 1)}
    if live_range is not None:
        buffers = hlo.peak_buffers(live_range, text)
        total = sum(b.bytes for b in buffers)
        out["peak"] = {"bytes": total,
                       "by_part": hlo.group_bytes(buffers, part),
                       "by_op": dict(list(hlo.group_bytes(buffers, op_kind).items())[:25]),
                       "largest": [{"bytes": b.bytes, "name": b.name, "shape": b.shape, "part": part(b), "op": op_kind(b)}
                                   for b in buffers[:25]]}
    return out


def run_case(name: str, attribute: bool, compiler: str = "cpu") -> dict:
    """`one(name)` in a fresh process with its fake device count; XLA's warnings counted from its stderr."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={CASES[name][0]}", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])   # this checkout's code
    cmd = [sys.executable, "-m", "experiments.flagship_memory.flagship", "--one", name, "--compiler", compiler]
    cmd += ["--attribute"] if attribute else []
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"case {name} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["remat_warnings"] = proc.stderr.count(WARNING)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["fsdp8", "fsdp8-expert8"], choices=list(CASES))
    parser.add_argument("--attribute", action="store_true", help="group the peak's buffers by model part and op")
    parser.add_argument("--compiler", choices=["cpu", "tpu"], default="cpu",
                        help="tpu: compile with XLA:TPU (libtpu) for v5p chips; results keyed xla_tpu/<case>")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.attribute, args.compiler)))
        return
    path = OUT / "flagship.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for name in args.cases:
        result = run_case(name, args.attribute, args.compiler)
        where = "XLA:TPU (libtpu), compiled on" if args.compiler == "tpu" else "XLA:CPU, fake devices, on"
        result.update(commit=commit(), machine=f"{where} a shared 2-core CPU host")
        results[f"xla_tpu/{name}" if args.compiler == "tpu" else name] = result
        OUT.mkdir(exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{name}: temp {result['temp_bytes'] / 2**30:.1f} GiB, arguments {result['argument_bytes'] / 2**30:.1f} GiB, "
              f"batch collectives {result.get('batch_collectives')}, remat warnings {result['remat_warnings']}, "
              f"compile {result['compile_cpu_s']} s", flush=True)


if __name__ == "__main__":
    main()


def tpu_table(results: dict) -> str:
    """The `flagship_memory_tpu` block: each XLA:TPU case beside the XLA:CPU figure of the same case."""
    lines = ["Flagship train step per device at T=8192, one row per device, compiled by XLA:TPU (libtpu, v5p "
             "megacore; splash attention, KDA `pallas_segment`, every Pallas kernel compiled by Mosaic) and, "
             "labelled, by XLA:CPU (fake devices; flash attention, KDA `chunked`). GiB from `memory_analysis()`.", "",
             "| case | layers | compiler | topology | temporaries GiB | arguments GiB | peak GiB | commit |",
             "|---|---:|---|---|---:|---:|---:|---|"]
    for key, r in sorted(results.items()):
        if not key.startswith("xla_tpu/"):
            continue
        case = key.split("/", 1)[1]
        lines.append(f"| {case} | {r['num_layers']} | xla_tpu | `{r['topology']}` | {r['temp_bytes'] / 2**30:.1f} | "
                     f"{r['argument_bytes'] / 2**30:.1f} | {r['peak'] / 2**30:.1f} | {r['commit']} |")
        cpu = results.get(case)
        if cpu:
            lines.append(f"| {case} | {cpu['num_layers']} | xla_cpu | {cpu['devices']} fake devices | "
                         f"{cpu['temp_bytes'] / 2**30:.1f} | {cpu['argument_bytes'] / 2**30:.1f} | - | {cpu['commit']} |")
    return "\n".join(lines) + "\n"
