"""KDA kernel benchmark: speed against peers in the same process, and the phantom-segment overhead sweep.

    python -m experiments.bench_kda.bench [--quick] [--out experiments/bench_kda/results/bench_kda.json]

Writes the JSON; `table` renders the `bench_kda` results block of the docs from it
(`python -m experiments.check_results --write` copies it in).

Part 1, forward+backward at B=1, T=4096, H=4, K=V=128, fp32: lingpack `reference`, `chunked`
(segment-native), `chunked_aligned` (cu_seqlens), FLA's `naive_chunk_kda` and transformers'
`chunk_kimi_delta_attention` (both PyTorch CPU). GFLOP/s of `chunked` is set against a batched
64x128x64 matmul measured here (the practical ceiling for chunk-sized products).

Part 2, T=8192 packed with realistic document lengths, max_segs in {8..128}: time(packed) /
time(same tokens as one unpacked document) per design, next to the aligned design's predicted T_new/T.
Every number is a ratio within this run; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.provenance import commit
from lingpack.kernels.kda import api, segments
from lingpack.kernels.kda.inputs import random_inputs
from lingpack.parity.fla import fla_naive_kda

RESULTS = Path(__file__).resolve().parent / "results"


def timeit(fn, repeats):
    fn()  # warm-up (compilation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def jax_fwd_bwd(impl, inputs, seg=None, max_segs=None, safe_gate=False):
    def loss(q, k, v, g, beta):
        o, _ = api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, max_segs=max_segs, safe_gate=safe_gate)
        return jnp.sum(o * o)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    args = [jnp.asarray(x) for x in inputs]
    return lambda: jax.block_until_ready(grad(*args))


def torch_fwd_bwd(fn, inputs, heads_first=False):
    import torch
    tensors = [torch.tensor(x) for x in inputs]

    def run():
        leaves = [t.clone().requires_grad_(True) for t in tensors]
        o = fn(*leaves)
        o = o[0] if isinstance(o, tuple) else o
        (o * o).sum().backward()
    return run


def chunked_flops(T, H, K, V, C=64):
    """Algorithmic FLOPs of the chunked forward (x3 for forward+backward)."""
    per_chunk = 2 * C * C * K * 3 + C ** 3 + 2 * C * C * V * 2 + 2 * C * K * V * 3
    return 3 * per_chunk * (T // C) * H


def matmul_gflops(shape_a, shape_b, repeats):
    """GFLOP/s of one XLA matmul of these fp32 shapes (a batched one if they are 3-D), in this process."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal(shape_a), jnp.float32)
    b = jnp.asarray(np.random.default_rng(1).standard_normal(shape_b), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    seconds = timeit(lambda: jax.block_until_ready(f(a, b)), repeats)
    return 2 * np.prod(shape_a) * shape_b[-1] / seconds / 1e9


def part1(repeats):
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    B, T, H, K, V = 1, 4096, 4, 128, 128
    inputs = random_inputs(np.random.default_rng(0), B, T, H, K, V)
    inputs[3] = np.maximum(inputs[3], -5.0)  # the lower-bound gate regime, so `safe_gate` holds
    naive = fla_naive_kda()
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    runs = {
        "lingpack reference (scan over time)": jax_fwd_bwd("reference", inputs),
        "lingpack chunked (segment-native)": jax_fwd_bwd("chunked", inputs, safe_gate=True),
        "lingpack chunked, any gate (safe_gate=False)": jax_fwd_bwd("chunked", inputs),
        "lingpack chunked_aligned (cu_seqlens, max_segs=8)": jax_fwd_bwd("chunked_aligned", inputs, max_segs=8,
                                                                          safe_gate=True),
        "FLA naive_chunk_kda (torch)": torch_fwd_bwd(naive.naive_chunk_kda, inputs),
        "transformers chunk_kimi_delta_attention (torch)": torch_fwd_bwd(chunk_kimi_delta_attention, inputs),
    }
    times = {name: timeit(fn, repeats if "torch" not in name else 1) for name, fn in runs.items()}
    for name, s in times.items():
        print(f"  {name:55s} {s:8.3f} s", flush=True)
    chunked_s = times["lingpack chunked (segment-native)"]
    gflops = chunked_flops(T, H, K, V) / chunked_s / 1e9
    ceiling = matmul_gflops((2048, 64, 128), (2048, 128, 64), repeats)
    square = matmul_gflops((2048, 2048), (2048, 2048), repeats)
    return {"times_s": times, "square_matmul_2048_gflops": square,
            "speedup_vs_fla_naive_chunk": times["FLA naive_chunk_kda (torch)"] / chunked_s,
            "speedup_vs_transformers": times["transformers chunk_kimi_delta_attention (torch)"] / chunked_s,
            "chunked_gflops": gflops, "batched_matmul_64x128x64_gflops": ceiling,
            "fraction_of_ceiling": gflops / ceiling}


def realistic_lengths(rng, total, max_docs):
    """Log-normal document lengths (median ~900 tokens), at most `max_docs`, filling `total` exactly."""
    while True:
        lengths = np.maximum(1, rng.lognormal(np.log(900), 1.0, size=64).astype(int))
        cut = np.searchsorted(np.cumsum(lengths), total)
        if cut + 1 <= max_docs:
            lengths = list(lengths[:cut]) + [total - int(np.sum(lengths[:cut]))]
            return [n for n in lengths if n > 0]


def part2(repeats, max_segs_list):
    T, H, K, V = 8192, 2, 128, 128
    rng = np.random.default_rng(1)
    inputs = random_inputs(rng, 1, T, H, K, V)
    lengths = realistic_lengths(rng, T, min(max_segs_list))
    seg = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)[None]
    print(f"  documents: {len(lengths)}, lengths {sorted(lengths)}", flush=True)
    rows = []
    inputs[3] = np.maximum(inputs[3], -5.0)
    native_unpacked_fn = jax_fwd_bwd("chunked", inputs, safe_gate=True)
    native_packed_fn = jax_fwd_bwd("chunked", inputs, seg=jnp.asarray(seg), safe_gate=True)
    aligned_unpacked_fn = jax_fwd_bwd("chunked_aligned", inputs, max_segs=1, safe_gate=True)
    for max_segs in max_segs_list:  # each design's pair is timed back to back, so drift cancels in the ratio
        aligned_packed = timeit(jax_fwd_bwd("chunked_aligned", inputs, seg=jnp.asarray(seg), max_segs=max_segs,
                                            safe_gate=True), repeats)
        aligned_unpacked = timeit(aligned_unpacked_fn, repeats)
        native_packed, native_unpacked = timeit(native_packed_fn, repeats), timeit(native_unpacked_fn, repeats)
        row = {"max_segs": max_segs,
               "aligned_packed_over_unpacked": aligned_packed / aligned_unpacked,
               "aligned_predicted_t_new_over_t": segments.aligned_length(T, max_segs, 64) / T,
               "native_packed_over_unpacked": native_packed / native_unpacked}
        print("  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        rows.append(row)
    return {"documents": len(lengths), "rows": rows}


# table label of each timed implementation, in table order
LABELS = {"lingpack chunked (segment-native)": "lingpack `chunked` (segment-native, `safe_gate`)",
          "lingpack chunked, any gate (safe_gate=False)": "lingpack `chunked`, any gate (`safe_gate=False`)",
          "lingpack chunked_aligned (cu_seqlens, max_segs=8)": "lingpack `chunked_aligned` (max_segs=8)",
          "lingpack reference (scan over time)": "lingpack `reference` (scan over time)",
          "FLA naive_chunk_kda (torch)": "FLA `naive_chunk_kda` (PyTorch)",
          "transformers chunk_kimi_delta_attention (torch)": "transformers `chunk_kimi_delta_attention` (PyTorch)"}


def table(result: dict) -> str:
    """The `bench_kda` results block (part 1's table and summary line), from a result of this script (its JSON)."""
    p1 = result["part1"]
    times, base = p1["times_s"], p1["times_s"]["lingpack chunked (segment-native)"]
    seconds = lambda s: f"{s:.0f}" if s >= 100 else f"{s:#.3g}"
    lines = ["| implementation | seconds | time / lingpack `chunked` |", "|---|---:|---:|"]
    for key, label in LABELS.items():
        lines.append(f"| {label} | {seconds(times[key])} | {times[key] / base:.2f} |")
    lines += ["", f"lingpack at commit {result.get('commit', '-')}. `chunked`: {p1['speedup_vs_fla_naive_chunk']:.1f}x"
              " FLA's `naive_chunk_kda`,"
              f" {p1['speedup_vs_transformers']:.1f}x transformers; {p1['chunked_gflops']:.1f} GFLOP/s of algorithmic"
              f" FLOPs = {100 * p1['fraction_of_ceiling']:.0f}% of a batched 64x128x64 XLA matmul measured in the"
              f" same run ({p1['batched_matmul_64x128x64_gflops']:.1f} GFLOP/s),"
              f" {100 * p1['chunked_gflops'] / p1['square_matmul_2048_gflops']:.0f}%"
              f" of a 2048^2 matmul ({p1['square_matmul_2048_gflops']:.1f} GFLOP/s)."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat, fewer max_segs values")
    parser.add_argument("--out", default=str(RESULTS / "bench_kda.json"))
    args = parser.parse_args()
    repeats = 1 if args.quick else 5
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores")
    print("Part 1: forward+backward, B=1 T=4096 H=4 K=V=128 fp32")
    result = {"commit": commit(), "part1": part1(repeats)}
    p1 = result["part1"]
    print(f"  chunked is {p1['speedup_vs_fla_naive_chunk']:.1f}x FLA naive_chunk_kda,"
          f" {p1['speedup_vs_transformers']:.1f}x transformers; {p1['chunked_gflops']:.1f} GFLOP/s ="
          f" {100 * p1['fraction_of_ceiling']:.0f}% of a batched 64x128x64 matmul"
          f" ({p1['batched_matmul_64x128x64_gflops']:.1f}),"
          f" {100 * p1['chunked_gflops'] / p1['square_matmul_2048_gflops']:.0f}% of a 2048^2 matmul"
          f" ({p1['square_matmul_2048_gflops']:.1f})")
    print("Part 2: phantom overhead, T=8192 H=2 K=V=128, packed / unpacked at equal tokens")
    result["part2"] = part2(repeats, [8, 32, 128] if args.quick else [8, 16, 32, 64, 128])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
