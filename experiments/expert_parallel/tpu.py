"""Expert parallelism compiled by XLA:TPU from a CPU host (libtpu, no TPU attached): what it builds.

    python -m experiments.expert_parallel.tpu [--part grouped_matmul|layer|v5e] [--table-only]

Writes results/tpu.json (the parts it ran, merged into what is there) and results/tpu.md; `python -m
experiments.check_results --write` copies the table into the docs' `expert_parallel_tpu` blocks.

Part grouped_matmul (one v5p chip). The local experts of one flagship MoE layer at EP=8 (16 experts, D=1536,
width 512, bf16 in, fp32 accumulation) on one device's receive buffer (1.25 x the balanced 8192 x 8 rows,
81,920): forward and backward of the SwiGLU experts, once with `jax.lax.ragged_dot` and once with Megablox
(`jax.experimental.pallas.ops.tpu.megablox.gmm`, as `models.moe.megablox_grouped_matmul` calls it). Per program: `cost_analysis()` (FLOPs, bytes,
`optimal_seconds`), the sum of the `estimated_cycles` XLA:TPU writes into the compiled HLO's backend_config
(INT64_MAX entries, no estimate, left out; counted once per instruction), the Mosaic custom calls with the
cost estimate each declares. Group sizes are runtime values: a static compile cannot see whether empty rows
are skipped; what it shows is whether the program computes an active-tile count and passes it to the kernel.

Part layer (8 v5p chips, v5p:2x2x2). One flagship MoE layer (conf/model/ling3_flagship.yaml), forward +
backward of every parameter and the input, 8192 tokens per device, expert=8: the worst-case receive buffer
in 8 dispatch rounds (the flagship's previous setting; capacity 8.0 is the worst case at k = 8, EP = 8) against
one round with capacity 1.25. Per device: XLA:TPU's `memory_analysis()` and `cost_analysis()`.

Part v5e (32 v5e chips, v5e:4x8, expert=8 x data=4). The same layer with `expert_parallel_exchange=auto`
(dense on this slice) compiles; the ragged exchange forced on it is refused by XLA:TPU (its message kept).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")   # quiets libtpu's host probe
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on the host may hold libtpu

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P, SingleDeviceSharding  # noqa: E402

from lingpack import backend  # noqa: E402
from lingpack.plan import hlo  # noqa: E402
from lingpack.models.moe import MoE, megablox_grouped_matmul  # noqa: E402
from lingpack.parallel import expert  # noqa: E402
from lingpack.parallel.layout import Layout, activation_layout  # noqa: E402
from lingpack.train.configs import ParallelConfig  # noqa: E402
from lingpack.train.sharding import make_mesh  # noqa: E402

from experiments.expert_parallel.bench import flagship_moe  # noqa: E402
from experiments.xla_tpu import devices as tpu_devices  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments" / "expert_parallel" / "results"
TOKENS_PER_DEVICE = 8192
GIB = 2 ** 30


def _estimated_cycles(text: str) -> int:
    return sum(int(c) for c in re.findall(r'"estimated_cycles":"(\d+)"', text) if int(c) < 2 ** 62)


def _mosaic_calls(text: str) -> list[dict]:
    """Each Mosaic custom call of the compiled HLO: its name, declared cost estimate and tiling attribute."""
    calls = []
    for line in text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        name = re.search(r"%([\w.\-]+) = ", line)
        cost = re.search(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"', line)
        tiling = re.search(r'ragged_dot_tiling="([\d,]+)"', line)
        calls.append(dict(name=name.group(1) if name else "?",
                          flops=int(cost.group(1)) if cost else None, bytes=int(cost.group(2)) if cost else None,
                          tiling=tiling.group(1) if tiling else None))
    return calls


def _costs(compiled) -> dict:
    cost, text = compiled.cost_analysis(), compiled.as_text()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"),
                optimal_seconds=cost.get("optimal_seconds"), estimated_cycles=_estimated_cycles(text))


def grouped_matmul_part() -> list[dict]:
    moe, D, _, _ = flagship_moe()
    L, I = moe.num_experts // 8, moe.expert_dim
    rows = int(1.25 * TOKENS_PER_DEVICE * moe.top_k)
    dev = tpu_devices("v5p:1x1x1")[0]
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))
    impls = {"ragged_dot": lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32),
             "megablox gmm": lambda x, w, g: megablox_grouped_matmul(x, w, g, preferred_element_type=jnp.float32)}
    out = []
    for name, mm in impls.items():
        def loss(x, w_gate, w_up, w_out, sizes):
            h = (jax.nn.silu(mm(x, w_gate, sizes)) * mm(x, w_up, sizes)).astype(jnp.bfloat16)
            return jnp.sum(mm(h, w_out, sizes))
        start = time.process_time()
        with backend.target("tpu"):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(
                spec((rows, D), jnp.bfloat16), spec((L, D, I), jnp.bfloat16), spec((L, D, I), jnp.bfloat16),
                spec((L, I, D), jnp.bfloat16), spec((L,), jnp.int32)).compile()
        row = dict(impl=name, rows=rows, experts=L, D=D, I=I, compile_cpu_s=round(time.process_time() - start, 1),
                   **_costs(compiled), mosaic=_mosaic_calls(compiled.as_text()))
        print(row, flush=True)
        out.append(row)
    return out


def layer_compiled(cfg, D, dtype, param_dtype, axes: dict, devices):
    """Forward + backward of one MoE layer, compiled for `devices` (XLA:TPU) on the mesh `axes`."""
    parallel = ParallelConfig(**axes)
    layout = Layout(make_mesh(parallel, devices), parallel.rules)
    with backend.target("tpu"):
        moe = nnx.eval_shape(lambda: MoE(cfg, D, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(moe)
        specs = nnx.get_partition_spec(params)
        place = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=layout.sharding(tuple(s), a.shape))
        params = jax.tree.map(place, params, specs, is_leaf=lambda s: isinstance(s, P))
        B, T = layout.mesh.size, TOKENS_PER_DEVICE
        x = jax.ShapeDtypeStruct((B, T, D), dtype, sharding=layout.sharding(("batch", "length", None), (B, T, D)))

        def loss(params, x):
            with activation_layout(layout):
                y, aux = nnx.merge(graphdef, params)(x)
            return jnp.sum(y.astype(jnp.float32)) + aux["router_z_loss"]

        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()


def _layer_row(label: str, cfg, axes: dict, devices, **extra) -> dict:
    base, D, dtype, param_dtype = flagship_moe()
    start = time.process_time()
    compiled = layer_compiled(cfg, D, jnp.dtype(dtype), jnp.dtype(param_dtype), axes, devices)
    mem, text = compiled.memory_analysis(), compiled.as_text()
    kinds = hlo.collectives(text)["by_kind"]
    row = dict(variant=label, chips=len(devices), device_kind=devices[0].device_kind, mesh=axes,
               compile_cpu_s=round(time.process_time() - start, 1), argument_bytes=mem.argument_size_in_bytes,
               output_bytes=mem.output_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
               alias_bytes=mem.alias_size_in_bytes,
               peak_bytes=mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes, **_costs(compiled),
               collectives={k: dict(count=v["count"], bytes=v["bytes"]) for k, v in kinds.items()}, **extra)
    print(row, flush=True)
    return row


def layer_part() -> list[dict]:
    base = flagship_moe()[0]
    devices, axes = tpu_devices("v5p:2x2x2"), dict(data=1, expert=8)
    return [_layer_row(label, dataclasses.replace(base, **kw), axes, devices, settings=kw)
            for label, kw in list(LAYER_VARIANTS.items())[:2]]


LAYER_VARIANTS = {"worst-case buffers, 8 rounds": dict(expert_parallel_chunks=8, expert_parallel_capacity=8.0),
                  "capacity 1.25, one round": dict(expert_parallel_chunks=1, expert_parallel_capacity=1.25),
                  "worst-case buffers, one round": dict(expert_parallel_chunks=1, expert_parallel_capacity=8.0)}


def layer_one_round_part() -> list[dict]:
    """Worst-case buffers in one round: what forced the flagship's 8 rounds."""
    base = flagship_moe()[0]
    label = "worst-case buffers, one round"
    kw = LAYER_VARIANTS[label]
    return [_layer_row(label, dataclasses.replace(base, **kw), dict(data=1, expert=8), tpu_devices("v5p:2x2x2"),
                       settings=kw)]


def receive_rows(row: dict, experts: int = 128, top_k: int = 8) -> int:
    """Rows of one round's receive buffer for a layer row (its mesh and settings; the flagship's experts)."""
    R, kw = row["mesh"]["expert"], row["settings"]
    M = expert.padded_rows(TOKENS_PER_DEVICE * top_k // kw["expert_parallel_chunks"], experts, expert.UNIT)
    units = expert.buffer_rows(M, R, experts // R, top_k, kw["expert_parallel_capacity"], "ragged", expert.UNIT)[1]
    return units * expert.UNIT


def v5e_part() -> list[dict]:
    base = flagship_moe()[0]
    devices, axes = tpu_devices("v5e:4x8"), dict(data=4, expert=8)
    rows = [_layer_row("auto exchange", dataclasses.replace(base, expert_parallel_chunks=1), axes, devices,
                       exchange=backend_choice(devices))]
    try:
        _layer_row("ragged forced", dataclasses.replace(base, expert_parallel_chunks=1,
                                                         expert_parallel_exchange="ragged"), axes, devices)
        rows.append(dict(variant="ragged forced", compiled=True))
    except Exception as err:   # the refusal is the finding
        rows.append(dict(variant="ragged forced", compiled=False, error=str(err).splitlines()[0][:300]))
    return rows


def backend_choice(devices) -> str:
    with backend.target("tpu"):
        return backend.expert_exchange(devices)


def table(result: dict) -> str:
    lines = []
    if "grouped_matmul" in result:
        r0 = result["grouped_matmul"][0]
        lines += [f"Local experts of a flagship MoE layer at EP=8 ({r0['experts']} experts, D={r0['D']}, width "
                  f"{r0['I']}, bf16), forward + backward on a {r0['rows']:,}-row receive buffer, one v5p chip "
                  "(XLA:TPU, compiled from a CPU host):", "",
                  "| grouped matmul | FLOPs (G) | Mosaic calls | their declared FLOPs (G) | FLOPs outside them (G) "
                  "| bytes accessed (GB) | optimal_seconds (ms) | estimated cycles outside kernels (M) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["grouped_matmul"]:
            declared = sum(c["flops"] or 0 for c in r["mosaic"])
            best = f"{r['optimal_seconds'] * 1e3:.2f}" if r["optimal_seconds"] and r["optimal_seconds"] > 0 else "none"
            lines.append(f"| {r['impl']} | {r['flops'] / 1e9:.1f} | {len(r['mosaic'])} | {declared / 1e9:.1f} | "
                         f"{(r['flops'] - declared) / 1e9:.1f} | {r['bytes_accessed'] / 1e9:.2f} | {best} | "
                         f"{r['estimated_cycles'] / 1e6:.3f} |")
        lines.append("")
    if "layer" in result:
        lines += ["One flagship MoE layer, forward + backward, 8192 tokens per device, 8 v5p chips, expert=8, per "
                  "device (XLA:TPU `memory_analysis()`; `cost_analysis()` counts a loop body once, so the 8 "
                  "rounds' FLOPs are one round's):", "",
                  "| receive buffers | rows per receive buffer | temporaries (GiB) | peak (GiB) | "
                  "FLOPs, cost_analysis (T) |", "|---|---|---|---|---|"]
        for r in result["layer"] + result.get("layer_one_round", []):
            lines.append(f"| {r['variant']} | {receive_rows(r):,} | {r['temp_bytes'] / GIB:.2f} | "
                         f"{r['peak_bytes'] / GIB:.2f} | {r['flops'] / 1e12:.2f} |")
        lines.append("")
    if "v5e" in result:
        auto, forced = result["v5e"]
        lines.append(f"32 v5e chips (v5e:4x8, expert=8 x data=4), the same layer: `expert_parallel_exchange=auto` "
                     f"picks `{auto['exchange']}` and compiles (temporaries {auto['temp_bytes'] / GIB:.2f} GiB, "
                     f"peak {auto['peak_bytes'] / GIB:.2f} GiB per device); `ragged` forced: "
                     + ("compiles." if forced["compiled"] else f"refused (`{forced['error'][:160]}`)."))
        lines.append("")
    commits = ", ".join(f"{part} at {commit}" for part, commit in result.get("commits", {}).items())
    lines.append(f"Commits: {commits}; libtpu {result.get('libtpu', '-')}; {result.get('machine', '-')}.")
    return "\n".join(lines) + "\n"


PARTS = ("grouped_matmul", "layer", "layer_one_round", "v5e")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", action="append", choices=PARTS)
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    path = OUT / "tpu.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    if not args.table_only:
        from importlib.metadata import version
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        result.update(libtpu=version("libtpu"),
                      machine=f"compiled on {platform.machine()} CPU, {os.cpu_count()} cores, shared")
        parts = {"grouped_matmul": grouped_matmul_part, "layer": layer_part, "layer_one_round": layer_one_round_part,
                 "v5e": v5e_part}
        for name in args.part or PARTS:
            result[name] = parts[name]()
            result.setdefault("commits", {})[name] = git.stdout.strip()
        OUT.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    text = table(result)
    (OUT / "tpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
