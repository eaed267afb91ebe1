"""A/B of the `chunked` KDA kernel against an earlier revision of itself and FLA's `naive_chunk_kda`.

    python experiments/kda_ab.py [--baseline 8407a96] [--repeats 9] [--out experiments/results/kda_ab.json]

bench_kda.py's part-1 shape (B=1, T=4096, H=4, K=V=128, fp32, gates in [-5, 0), one document), forward +
backward of sum(o^2). The baseline is `src/lingpack/kernels/kda/chunked.py` at git revision `--baseline`
(default: the kernel before the third pass of issue 15), loaded from `git show` as a module of its own;
the current one is the working tree's. The two are timed interleaved, call by call, each call in process CPU
time (load-robust: the machine is shared) and wall time; FLA's naive kernel (PyTorch) is timed in the same
process. Also writes the kernel's GFLOP/s as bench_kda.py computes it (algorithmic FLOPs / wall seconds), the
largest gradient difference between the two revisions, each one's compile CPU time and XLA temp buffer size,
and the minor page faults and system CPU time per call (XLA:CPU maps its temp buffer afresh on every call).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench_kda import chunked_flops, torch_fwd_bwd  # noqa: E402  (experiments/ is the script's directory)
from lingpack.kernels.kda import chunked  # noqa: E402
from tests.kernels.kda_cases import fla_naive_module, make_inputs  # noqa: E402

B, T, H, K, V = 1, 4096, 4, 128, 128
KERNEL = "src/lingpack/kernels/kda/chunked.py"


def module_at(rev: str):
    """chunked.py as it was at git revision `rev`, imported under its own name."""
    source = subprocess.run(["git", "show", f"{rev}:{KERNEL}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"chunked_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"chunked_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grad_fn(module, args, safe_gate):
    def loss(q, k, v, g, beta):
        o, _ = module.chunked_segment_native(q, k, v, g, beta, segment_ids_BT=jnp.ones((B, T), jnp.int32),
                                             scale=K ** -0.5, initial_state_BHKV=jnp.zeros((B, H, K, V)),
                                             safe_gate=safe_gate)
        return jnp.sum(o * o)
    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    start = time.process_time()
    compiled = f.lower(*args).compile()
    info = {"compile_cpu_s": time.process_time() - start,
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2 ** 20}
    jax.block_until_ready(compiled(*args))
    return (lambda: jax.block_until_ready(compiled(*args))), info


def timed(fn):
    """fn's result, process CPU seconds, wall seconds, and the minor page faults and system CPU seconds it cost."""
    usage, cpu, wall = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    out = fn()
    cpu, wall, after = time.process_time() - cpu, time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    return out, cpu, wall, after.ru_minflt - usage.ru_minflt, after.ru_stime - usage.ru_stime


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="8407a96")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--fla-repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "kda_ab.json"))
    args = parser.parse_args()
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    inputs = make_inputs(np.random.default_rng(0), B, T, H, K, V)
    inputs[3] = np.maximum(inputs[3], -5.0)  # the lower-bound gate regime, so `safe_gate` holds
    jax_args = [jnp.asarray(x) for x in inputs]
    modules = {"baseline": module_at(args.baseline), "current": chunked}
    result = {"baseline_rev": args.baseline, "jax": jax.__version__, "cores": os.cpu_count(),
              "load_average_start": os.getloadavg()}
    fla = torch_fwd_bwd(fla_naive_module().naive_chunk_kda, inputs)
    fla()  # warm-up
    fla_cpu, fla_wall = zip(*[timed(fla)[1:3] for _ in range(args.fla_repeats)])
    result["fla_naive_chunk_kda"] = {"cpu_s": statistics.median(fla_cpu), "wall_s": statistics.median(fla_wall)}
    for gate, safe in (("safe_gate", True), ("any_gate", False)):
        built = {name: grad_fn(m, jax_args, safe) for name, m in modules.items()}
        fns = {name: fn for name, (fn, _) in built.items()}
        grads = {name: fn() for name, fn in fns.items()}
        diff = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
                   for a, b in zip(grads["baseline"], grads["current"]))
        samples = {name: [] for name in fns}
        for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits both alike
            for name, fn in fns.items():
                samples[name].append(timed(fn)[1:])
        row = {"max_grad_rel_diff": diff}
        for name, s in samples.items():
            cpu, wall = statistics.median(x[0] for x in s), statistics.median(x[1] for x in s)
            row[name] = {"cpu_s": cpu, "wall_s": wall, **built[name][1],
                         "minor_page_faults": statistics.median(x[2] for x in s),
                         "system_cpu_s": statistics.median(x[3] for x in s),
                         "fla_over_this_cpu": result["fla_naive_chunk_kda"]["cpu_s"] / cpu,
                         "fla_over_this_wall": result["fla_naive_chunk_kda"]["wall_s"] / wall,
                         "gflops_wall": chunked_flops(T, H, K, V) / wall / 1e9}
        row["baseline_over_current_cpu"] = row["baseline"]["cpu_s"] / row["current"]["cpu_s"]
        result[gate] = row
        print(f"{gate}: baseline {row['baseline']['cpu_s']:.3f} s CPU ({row['baseline']['wall_s']:.3f} wall), current"
              f" {row['current']['cpu_s']:.3f} s CPU ({row['current']['wall_s']:.3f} wall): "
              f"{row['baseline_over_current_cpu']:.2f}x; FLA naive / current:"
              f" {row['current']['fla_over_this_cpu']:.1f}x"
              f" CPU, {row['current']['fla_over_this_wall']:.1f}x wall; {row['current']['gflops_wall']:.1f} GFLOP/s;"
              f" max grad rel diff {diff:.1e}; compile {row['baseline']['compile_cpu_s']:.1f} -> "
              f"{row['current']['compile_cpu_s']:.1f} s CPU, temp {row['baseline']['temp_mib']:.0f} -> "
              f"{row['current']['temp_mib']:.0f} MiB, page faults/call {row['baseline']['minor_page_faults']:.0f} -> "
              f"{row['current']['minor_page_faults']:.0f}, system CPU {row['baseline']['system_cpu_s']:.3f} -> "
              f"{row['current']['system_cpu_s']:.3f} s", flush=True)
    result["load_average_end"] = os.getloadavg()
    print(f"FLA naive_chunk_kda: {result['fla_naive_chunk_kda']['cpu_s']:.2f} s CPU,"
          f" {result['fla_naive_chunk_kda']['wall_s']:.2f} s wall; load {result['load_average_start']}"
          f" -> {result['load_average_end']}")
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
