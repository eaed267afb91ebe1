"""What the ling3_tiny train step holds at its memory peak under context parallelism, by part of the model.

    python -m experiments.context_parallel.attribution [--T 65536] [--cp 1 8] [--scheduler default memory]
    python -m experiments.context_parallel.attribution --table-only

One train step (the model_memory.py configuration: ling3_tiny, B=1, fp32, ring MLA, zigzag; `TrainProgram`)
is compiled per (T, CP) for CP devices on `context`, with XLA's buffer dump; every value live at the peak
of the buffer assignment (`lingpack.plan.hlo.peak_buffers`) is attributed to the named scope that produced it
(`embed`, `layer<i>/<mixer or ffn>`, `head`, `mtp<d>`; the optimizer update and the entry parameters
outside them). The table gives each part's bytes at CP=1 and at each CP, and its share of the CP=1 bytes
(the goal is 1/CP for whatever grows with T). Each compile runs in its own subprocess; nothing runs.

Two XLA:CPU schedulers: `default` (concurrency-optimized) runs every operand-free instruction first, so the
zero fills of the backward's scan outputs and scatter accumulators are held from the step's start (they
show as "loop carries": copies of zero broadcasts that seed while loops); `memory`
(`--xla_cpu_enable_concurrency_optimized_scheduler=false`) places each where it is used.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()   # LLVM -O0: buffer assignment unchanged

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from experiments.provenance import commit  # noqa: E402
from lingpack.plan import hlo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments/context_parallel/results"
MIB = 2 ** 20


def part_of(buffer) -> str:
    """The model part whose named scope produced `buffer` (layer scopes keep their mixer / ffn name); values
    with no name stack go by the lingpack file that traced them."""
    name = buffer.op_name
    layer = re.search(r"\b(layer\d+|stack)\b.*?\b(kda|mla|moe|mlp)\b", name)
    if layer:
        return f"{layer.group(1)} {layer.group(2)}"
    mtp = re.search(r"\b(mtp\d+)\b", name)
    if mtp:
        return mtp.group(1)
    for scope in ("head_xent", "head", "embed"):
        if re.search(rf"\b{scope}\b", name):
            return "head" if scope == "head_xent" else scope
    if any("optax" in f[0] or "train/optim.py" in f[0] for f in buffer.frames):
        return "optimizer"
    frame = buffer.frame_under("lingpack")
    if frame is not None:
        return f"{Path(frame[0]).stem}.py (no scope)"
    return "loop carries, parameters (no producer named)" if not name else "other"


def measure(T: int, cp: int, scheduler: str = "default") -> dict:
    import jax

    from experiments.context_parallel.model_memory import model_config
    from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
    from lingpack.train.program import TrainProgram

    parallel = ParallelConfig(data=1, context=cp, context_strategy="ring", load_balance=True)
    program = TrainProgram.build(model_config(), LossConfig(), OptimConfig(decay_steps=1000), parallel, TrainConfig(),
                                 rows=1, seq_length=T, devices=jax.devices()[:cp])
    with tempfile.TemporaryDirectory() as directory:
        compiled, live = hlo.compile_with_buffer_dump(program.lower(), directory)
    buffers = hlo.peak_buffers(live, compiled.as_text())
    return dict(T=T, cp=cp, scheduler=scheduler, commit=commit(), peak_bytes=sum(b.bytes for b in buffers),
                parts=hlo.group_bytes(buffers, part_of),
                largest=[dict(bytes=b.bytes, shape=b.shape, part=part_of(b), op=b.op_name[-160:])
                         for b in buffers[:15]])


def table(results: dict) -> str:
    by_run = {}
    for r in results.values():
        by_run.setdefault((r.get("scheduler", "default"), r["T"]), {})[r["cp"]] = r
    lines = []
    for (scheduler, T), runs in sorted(by_run.items(), key=lambda kv: (kv[0][0] != "default", kv[0][1])):
        cps = sorted(runs)
        base = runs.get(1)
        lines += [f"ling3_tiny train step at T={T // 1024}K, XLA:CPU's {scheduler} scheduler: values live at the "
                  "buffer-assignment peak (MiB per device), by the scope that produced them; in brackets: / the CP=1 "
                  "bytes.", "",
                  "| part | " + " | ".join(f"CP={c}" for c in cps) + " |", "|---|" + "---|" * len(cps)]
        parts = sorted({p for r in runs.values() for p in r["parts"]},
                       key=lambda p: (-max(r["parts"].get(p, 0) for r in runs.values()), p))
        parts = [p for p in parts if max(r["parts"].get(p, 0) for r in runs.values()) >= MIB / 20]  # >= 0.05 MiB
        for part in parts + ["total"]:
            cells = []
            for c in cps:
                value = runs[c]["peak_bytes"] if part == "total" else runs[c]["parts"].get(part, 0)
                ref = (base["peak_bytes"] if part == "total" else base["parts"].get(part, 0)) if base else 0
                cells.append(f"{value / MIB:.1f}" + (f" ({value / ref:.3f})" if ref and c != 1 else ""))
            lines.append(f"| {part} | " + " | ".join(cells) + " |")
        lines.append("")
    commits = sorted({r["commit"] for r in results.values()})
    lines.append(f"Compiled for 8 fake CPU devices (shared 2-core host) at commit {', '.join(commits)}.")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, nargs="+", default=[65536])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--scheduler", nargs="+", choices=sorted(hlo.CPU_SCHEDULERS), default=["default"])
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)   # worker: T cp scheduler -> JSON on stdout
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), int(args.one[1]), args.one[2])))
        return
    path = OUT / "attribution.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if not args.table_only:
        for scheduler in args.scheduler:
            env = hlo.scheduler_env(scheduler, os.environ)   # each compile in its own process, with its flags
            for T in args.T:
                for cp in args.cp:
                    command = [sys.executable, "-m", "experiments.context_parallel.attribution", "--one", str(T),
                               str(cp), scheduler]
                    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
                    if run.returncode:
                        print(run.stderr[-3000:], file=sys.stderr)
                        continue
                    key = f"{T}/{cp}" + ("" if scheduler == "default" else f"/{scheduler}")
                    results[key] = json.loads(run.stdout.strip().splitlines()[-1])
                    path.write_text(json.dumps(results, indent=2) + "\n")
                    print(scheduler, T, cp, round(results[key]["peak_bytes"] / MIB, 1), flush=True)
    (OUT / "attribution.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
