"""Expert parallelism: tokens to the experts (all_to_all) against experts to the tokens (gather).

    python -m experiments.expert_parallel.bench               # both parts, writes results/
    python -m experiments.expert_parallel.bench --table-only  # re-renders results.md from results.json

Both write results/results.json (unless --table-only) and results/results.md; `python -m experiments.check_results
--write` copies the table into the docs' `expert_parallel` blocks.

Part 1 (flagship dims, compile only). One MoE layer of conf/model/ling3_flagship.yaml (128 experts, top-8,
D=1536, expert width 512, bf16 compute, fp32 parameters), forward + backward (gradients of every parameter
and of the input), compiled for 8 fake CPU devices with 8192 tokens per device on the meshes expert=8 and
expert=4 x data=2: `moe.expert_parallel=gather`, `all_to_all`, and `all_to_all` in 8 rounds
(`moe.expert_parallel_chunks=8`). Per device: the executed collectives of the compiled HLO by kind
(`lingpack.plan.hlo.collectives`, the planner's count: result bytes x executions) and XLA's buffer assignment
(`memory_analysis()`). The CPU program exchanges worst-case-sized dense buffers (XLA:CPU has no ragged
all-to-all); the TPU/GPU program's ragged all-to-all moves only the routed rows: the "ragged" column is the
CPU program's row exchanges scaled to the rows routed off the device under balanced routing.

Part 2 (CPU A/B). A small Ling3 train step (8 experts, expert=4 x data=2, 8 fake CPU devices), both modes
compiled, then timed interleaved (process CPU time per step, median of the rounds): ratios only.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from lingpack.plan import hlo  # noqa: E402
from lingpack.models.kda import KDAConfig  # noqa: E402
from lingpack.models.ling3 import Ling3Config, config_from_dict  # noqa: E402
from lingpack.models.mla import MLAConfig  # noqa: E402
from lingpack.models.moe import MoE, MoEConfig  # noqa: E402
from lingpack.parallel.layout import Layout, activation_layout  # noqa: E402
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig  # noqa: E402
from lingpack.train.program import TrainProgram  # noqa: E402
from lingpack.train.sharding import make_mesh  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments" / "expert_parallel" / "results"
MODES = ("gather", "all_to_all")
VARIANTS = (("gather", 1), ("all_to_all", 1), ("all_to_all", 8))   # (moe.expert_parallel, its rounds)
MESHES = {"expert=8": dict(data=1, expert=8), "expert=4 x data=2": dict(data=2, expert=4)}
TOKENS_PER_DEVICE = 8192
GIB = 2 ** 30


def flagship_moe() -> tuple[MoEConfig, int, str, str]:
    cfg = config_from_dict(yaml.safe_load((ROOT / "conf/model/ling3_flagship.yaml").read_text()))
    return cfg.moe, cfg.emb_dim, cfg.dtype, cfg.param_dtype


def layer_program(cfg: MoEConfig, D: int, dtype, param_dtype, axes: dict):
    """The lowered forward + backward of one MoE layer on the mesh `axes` (abstract: nothing allocated)."""
    parallel = ParallelConfig(**axes)
    layout = Layout(make_mesh(parallel), parallel.rules)
    moe = nnx.eval_shape(lambda: MoE(cfg, D, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(moe)
    specs = nnx.get_partition_spec(params)
    place = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=layout.sharding(tuple(s), a.shape))
    params = jax.tree.map(place, params, specs, is_leaf=lambda s: isinstance(s, P))
    B, T = layout.mesh.size, TOKENS_PER_DEVICE   # one row of 8192 tokens per device
    x = jax.ShapeDtypeStruct((B, T, D), dtype, sharding=layout.sharding(("batch", "length", None), (B, T, D)))

    def loss(params, x):
        with activation_layout(layout):
            y, aux = nnx.merge(graphdef, params)(x)
        return jnp.sum(y.astype(jnp.float32)) + aux["router_z_loss"]

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x)


def part1() -> list[dict]:
    base, D, dtype, param_dtype = flagship_moe()
    dtype, param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
    rows = []
    for mesh_name, axes in MESHES.items():
        R = axes["expert"]
        # the ragged all-to-all carries the routed rows only: k of every R * min(k, E / R) buffer rows
        # per token, (R - 1) / R of them to other devices when routing is balanced
        routed = base.top_k / (R * min(base.top_k, base.num_experts // R)) * (R - 1) / R
        for mode, rounds in VARIANTS:
            cfg = dataclasses.replace(base, expert_parallel=mode, expert_parallel_chunks=rounds)
            start = time.process_time()
            compiled = layer_program(cfg, D, dtype, param_dtype, axes).compile()
            ops, _ = hlo.collective_ops(compiled.as_text())
            kinds = hlo.collectives(compiled.as_text())["by_kind"]
            rows_moved = [op for op in ops if op.kind == "all-to-all" and op.dims[0][-1:] == (D,)]
            mem = compiled.memory_analysis()
            rows.append(dict(mesh=mesh_name, mode=mode, rounds=rounds,
                             compile_cpu_s=round(time.process_time() - start, 1),
                             collective_bytes={k: v["bytes"] for k, v in kinds.items()},
                             collective_count={k: v["count"] for k, v in kinds.items()},
                             ragged_bytes_balanced=round(sum(op.bytes * op.times for op in rows_moved) * routed),
                             argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
                             temp_bytes=mem.temp_size_in_bytes, alias_bytes=mem.alias_size_in_bytes))
            print(rows[-1], flush=True)
    return rows


SMALL = Ling3Config(vocab_size=256, emb_dim=64, num_layers=2, inhomogeneous_layer_cycle_interval=2, mlp_dim=128,
                    kda=KDAConfig(num_heads=2, head_dim=32), kda_chunk_size=16, attention_block_size=32,
                    mla=MLAConfig(num_heads=2, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                  v_head_dim=32),
                    moe=MoEConfig(num_experts=8, top_k=2, expert_dim=64, n_groups=2, topk_groups=1), mtp_num_layers=0)


def part2(rounds: int = 7, steps: int = 3) -> dict:
    rows, T = 8, 256
    rng = np.random.default_rng(0)
    batch = dict(inputs=rng.integers(0, 256, (rows, T)), targets=rng.integers(0, 256, (rows, T)),
                 inputs_segmentation=np.ones((rows, T)), targets_segmentation=np.ones((rows, T)),
                 inputs_position=np.tile(np.arange(T), (rows, 1)))
    batch = {k: v.astype(np.int32) for k, v in batch.items()}
    runs = {}
    for mode in MODES:
        model = dataclasses.replace(SMALL, moe=dataclasses.replace(SMALL.moe, expert_parallel=mode))
        program = TrainProgram.build(model, LossConfig(), OptimConfig(decay_steps=100),
                                     ParallelConfig(**MESHES["expert=4 x data=2"]), TrainConfig(), rows=rows,
                                     seq_length=T, donate=False)
        state = jax.jit(program.init, out_shardings=program.shardings)()
        placed = jax.device_put(batch, program.batch_sharding)
        jax.block_until_ready(program.step(state, placed))   # compile and warm up
        runs[mode] = (program, state, placed)
    times = {mode: [] for mode in MODES}
    for _ in range(rounds):   # interleaved: both modes see the same machine load
        for mode, (program, state, placed) in runs.items():
            start = time.process_time()
            for _ in range(steps):
                out = program.step(state, placed)
            jax.block_until_ready(out)
            times[mode].append((time.process_time() - start) / steps)
    median = {mode: statistics.median(t) for mode, t in times.items()}
    return dict(model="SMALL (2 layers, emb 64, 8 experts top-2), 8 rows x 256 tokens", mesh="expert=4 x data=2",
                rounds=rounds, steps_per_round=steps, cpu_s_per_step=times,
                all_to_all_over_gather=median["all_to_all"] / median["gather"])


def table(result: dict) -> str:
    lines = ["Flagship MoE layer (128 experts, top-8, D=1536, width 512, bf16), forward + backward, 8192 tokens per "
             "device, per device (8 fake CPU devices, compiled HLO):", "",
             "| mesh | mode | all-gather (GiB) | all-reduce (GiB) | reduce-scatter (GiB) | all-to-all (GiB) | "
             "ragged, TPU/GPU (GiB) | temporaries (GiB) |", "|---|---|---|---|---|---|---|---|"]
    for row in result["part1"]:
        b, mode = row["collective_bytes"], row["mode"] + (f", {row['rounds']} rounds" if row["rounds"] > 1 else "")
        cell = lambda kind: f"{b.get(kind, 0) / GIB:.2f}"
        ragged = f"{row['ragged_bytes_balanced'] / GIB:.2f}" if row["mode"] == "all_to_all" else "-"
        lines.append(f"| {row['mesh']} | {mode} | {cell('all-gather')} | {cell('all-reduce')} | "
                     f"{cell('reduce-scatter')} | {cell('all-to-all')} | {ragged} | {row['temp_bytes'] / GIB:.2f} |")
    ab = result["part2"]
    lines += ["", f"CPU A/B, {ab['model']}, {ab['mesh']}: all_to_all / gather = "
                  f"{ab['all_to_all_over_gather']:.2f} (process CPU time per train step, median of {ab['rounds']} "
                  f"interleaved rounds; {result['machine']})."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    path = OUT / "results.json"
    if not args.table_only:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        commit = git.stdout.strip()
        result = dict(commit=commit, machine=f"{platform.machine()} CPU, {os.cpu_count()} cores, shared",
                      part1=part1(), part2=part2())
        OUT.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    result = json.loads(path.read_text())
    text = table(result)
    (OUT / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
