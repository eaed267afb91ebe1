"""The real train step on the machine it runs on (TPU VM, GPU box; CPU only as a dry run): step time, tokens/s
and MFU, written beside the planner's estimate for the same config and mesh, so a first run on hardware
calibrates the plan.

    python -m experiments.hardware_step.bench [--steps 20] [--warmup 3] [--plan plan.json] [--out results.json] \\
        model=ling3_flagship kernel=pallas_segment data.seq_length=8192 data.global_batch_size=64 parallel.fsdp=8 ...
    python -m experiments.hardware_step.bench --dry-run model=ling3_tiny        # CPU plumbing check, seconds

The overrides are run.py's (the same Hydra config). The step is `TrainProgram` over every device of this
process (forward, backward, AdamW; the state donated as in training) on synthetic packed rows (random tokens,
one document per row), compiled once, run `--warmup` times, then `--steps` times, each call ended by
`block_until_ready`: the median is the step time. MFU = the model's analytic FLOPs (`train/flops.py`) over
(median step x the chip's peak (`lingpack.plan.chips`) x devices). The results JSON labels the platform it was
measured on; on CPU the peak is the matmul ceiling measured in this process and no figure is a TPU's or GPU's.
With `--plan`, the planner's JSON for this config is read and its estimate stored beside the measurement
(`planned`), with measured / planned ratios; without it `planned` is null.
"""

from __future__ import annotations

import argparse
import json
import platform as host_platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

PLAN_KEYS = ("compiler", "chip", "devices", "est_step_s", "per_device_bytes", "fits", "step_flops", "mfu",
             "planned_mfu", "mesh")


def planned(path: str | None) -> dict | None:
    """The planner's estimate (the keys it writes that a measurement can be set against), or None."""
    if not path:
        return None
    plan = json.loads(Path(path).read_text())
    return {k: plan[k] for k in PLAN_KEYS if k in plan} | {"path": str(path)}


def measure(overrides: list[str], steps: int, warmup: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lingpack import config as config_lib
    from lingpack.plan import chips
    from lingpack.train import flops as flops_lib, optim as optim_lib
    from lingpack.train.program import BATCH_KEYS, TrainProgram

    with tempfile.TemporaryDirectory() as run_dir:
        rc = config_lib.build(config_lib.compose(overrides, run_dir=run_dir), run_dir, open_data=False)
    rows, T = rc.data.global_batch_size, rc.data.seq_length
    optim = optim_lib.resolve(rc.optim, rc.train.steps)   # the schedule's length, as the loop resolves it
    program = TrainProgram.build(rc.model, rc.loss, optim, rc.parallel, rc.train, rows=rows, seq_length=T)
    start = time.perf_counter()
    compiled = program.lower().compile()
    compile_s = time.perf_counter() - start
    state = jax.jit(program.init, out_shardings=program.shardings)()
    tokens = np.random.default_rng(0).integers(0, rc.model.vocab_size, (rows, T), dtype=np.int32)
    host = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "inputs_segmentation": np.ones_like(tokens),
            "targets_segmentation": np.ones_like(tokens),
            "inputs_position": np.broadcast_to(np.arange(T, dtype=np.int32), (rows, T)).copy()}
    batch = {k: jax.device_put(jnp.asarray(host[k]), program.batch_sharding) for k in BATCH_KEYS}
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    device = jax.devices()[0]
    n = jax.device_count()
    median = statistics.median(times)
    step_flops = flops_lib.flops_per_token(rc.model, T) * rows * T
    remat = flops_lib.remat_flops(rc.model, seq_len=T) * rows * T
    chip = chips.from_device_kind(device.device_kind) if device.platform != "cpu" else None
    peak = chip.peak_flops if chip else flops_lib.peak_flops_per_device(device)
    mem = compiled.memory_analysis()
    per_device = None if mem is None else int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                               + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    return {
        "platform": device.platform, "device_kind": device.device_kind, "devices": n,
        "measured_on": (f"{device.platform.upper()} ({device.device_kind} x {n})" if device.platform != "cpu" else
                        f"CPU ({host_platform.processor() or host_platform.machine()}, {n} XLA:CPU devices): not a "
                        "TPU or GPU figure"),
        "config": {"overrides": overrides, "rows": rows, "seq_length": T, "mesh": dict(program.mesh.shape),
                   "remat": rc.model.remat, "remat_policy": rc.model.remat_policy},
        "measured": {"compile_s": compile_s, "warmup": warmup, "steps": steps, "step_s": times,
                     "median_step_s": median, "tokens_per_s": rows * T / median,
                     "per_device_bytes_compiled": per_device,
                     "mfu": step_flops / (median * peak * n) if peak else None},
        "analytic": {"step_flops": step_flops, "remat_flops": remat,
                     "peak_flops_per_device": peak,
                     "peak_source": chip.name if chip else "CPU: the matmul ceiling measured in this process",
                     "roofline_step_s": step_flops / (peak * n) if peak else None},
        "loss": float(jax.device_get(metrics["loss"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--plan", help="the planner's JSON for the same config and mesh (plan.output=...)")
    parser.add_argument("--out", default="hardware_step.json")
    parser.add_argument("--dry-run", action="store_true", help="2 steps after 1 warm-up, any platform: plumbing only")
    parser.add_argument("overrides", nargs="*", help="run.py overrides (model=..., parallel.fsdp=..., ...)")
    args = parser.parse_args(argv)
    steps, warmup = (2, 1) if args.dry_run else (args.steps, args.warmup)
    if steps < 1 or warmup < 0:
        print(f"error: --steps must be >= 1 and --warmup >= 0; got {steps}, {warmup}", file=sys.stderr)
        return 2
    result = measure(args.overrides, steps, warmup)
    result["dry_run"] = args.dry_run
    result["planned"] = planned(args.plan)
    plan = result["planned"] or {}
    if plan.get("est_step_s"):
        result["measured_over_planned"] = {"step_s": result["measured"]["median_step_s"] / plan["est_step_s"]}
        if plan.get("per_device_bytes") and result["measured"]["per_device_bytes_compiled"]:
            result["measured_over_planned"]["per_device_bytes"] = (result["measured"]["per_device_bytes_compiled"]
                                                                   / plan["per_device_bytes"])
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    m = result["measured"]
    mfu = f"{m['mfu']:.1%}" if m["mfu"] is not None else "n/a"
    print(f"{result['measured_on']}: median step {m['median_step_s']:.4f} s over {steps} steps, "
          f"{m['tokens_per_s']:.0f} tokens/s, MFU {mfu}; plan: {plan.get('est_step_s', 'none')}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
