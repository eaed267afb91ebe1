"""Compiled per-device memory of a ling3_tiny train step vs T for context = 1, 2, 4, 8, and its collectives.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=src \
        python experiments/context_parallel/bench_memory.py --lengths 4096 8192 16384

Nothing runs: each step is lowered and compiled for fake CPU devices (one row, zigzag, ring MLA, KDA state
passing) and XLA's memory analysis of the per-device program is read (temp + arguments + outputs).
Collectives are counted in the compiled HLO (ops and bytes of their results) and divided by the number of
KDA layers where they come from KDA. Writes results.json / results.md / memory.png beside this file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from lingpack.models.ling3 import Ling3, config_from_dict  # noqa: E402
from lingpack.parallel.context import ContextParallel  # noqa: E402
from lingpack.train import sharding as shard_lib  # noqa: E402
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig  # noqa: E402
from lingpack.train.step import ModelDef, init_fn, make_train_step, state_shardings  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "pred": 1, "f64": 8, "s64": 8}


def model_config():
    import yaml
    return config_from_dict(yaml.safe_load((ROOT / "conf/model/ling3_tiny.yaml").read_text()))


def collectives(hlo: str) -> dict:
    """{op: [count, bytes of results]} over the HLO's collective instructions (async starts counted once)."""
    out = {op: [0, 0] for op in COLLECTIVES}
    for line in hlo.splitlines():
        m = re.search(r"= (\(?[a-z0-9\[\]{},\s:]*?\)?) (all-gather|all-reduce|collective-permute|all-to-all|"
                      r"reduce-scatter)(-start)?\(", line)
        if not m:
            continue
        nbytes = sum(DTYPE_BYTES.get(t, 4) * math.prod(int(x) for x in d.split(",") if x)
                     for t, d in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(1)))
        out[m.group(2)][0] += 1
        out[m.group(2)][1] += nbytes
    return out


def measure(model_cfg, T: int, context: int) -> dict:
    parallel = ParallelConfig(data=1, context=context)
    mesh = shard_lib.make_mesh(parallel)
    cp = ContextParallel.from_config(parallel, mesh)
    build = lambda: Ling3(model_cfg)
    model_def = ModelDef.from_constructor(build, model_cfg)
    init = init_fn(build, OptimConfig(), 0)
    abstract = jax.eval_shape(init)
    shardings = state_shardings(model_def, abstract, mesh, parallel.rules)
    step = make_train_step(model_def, LossConfig(), OptimConfig(decay_steps=10), micro_batches=1, mesh=mesh,
                           rules=parallel.rules, shardings=shardings, context=cp)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    batch_sharding = NamedSharding(mesh, shard_lib.batch_spec(mesh, parallel.rules))
    keys = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position")
    batch = {k: jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=batch_sharding) for k in keys}
    compiled = step.lower(state, batch).compile()
    mem = compiled.memory_analysis()
    total = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    return dict(T=T, context=context, bytes=int(total), temp_bytes=int(mem.temp_size_in_bytes),
                collectives=collectives(compiled.as_text()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    cfg = model_config()
    rows = []
    for T in args.lengths:
        for c in args.contexts:
            rows.append(measure(cfg, T, c))
            print(json.dumps({k: rows[-1][k] for k in ("T", "context", "bytes", "temp_bytes")}), flush=True)
    (HERE / "results.json").write_text(json.dumps(rows, indent=1))
    base = {r["T"]: r["bytes"] for r in rows if r["context"] == 1}
    lines = ["| T | context | per-device MiB | / context=1 | collectives (count: all-gather, all-reduce, "
             "collective-permute, all-to-all, reduce-scatter) |", "|---|---|---|---|---|"]
    for r in rows:
        counts = ", ".join(str(r["collectives"][op][0]) for op in COLLECTIVES)
        ratio = f"{r['bytes'] / base[r['T']]:.3f}" if r["T"] in base else "-"
        lines.append(f"| {r['T']} | {r['context']} | {r['bytes'] / 2**20:.1f} | {ratio} | {counts} |")
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in args.contexts:
        pts = [(r["T"], r["bytes"] / 2**20) for r in rows if r["context"] == c]
        ax.plot(*zip(*pts), marker="o", label=f"context={c}")
    ax.set(xscale="log", yscale="log", xlabel="T (tokens per row)", ylabel="compiled per-device MiB",
           title="ling3_tiny train step, zigzag CP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "memory.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
