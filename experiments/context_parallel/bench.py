"""Context-parallel attention: per-device memory vs T, and causal work balance plain vs zigzag.

    python -m experiments.context_parallel.bench [--quick] [--out experiments/context_parallel/results]
    python -m experiments.context_parallel.bench --memory-only [--T 4096 ...]   # part 1 only, printed

Part 1 (memory). An MLA layer's forward+backward (loss 0.5 * sum(y^2); grads of params and input) is
compiled for 8 fake CPU devices and its per-device peak read from `.compile().memory_analysis()`
(arguments + outputs + temporaries - aliased), for T = 4K..64K: one device (`flash` and `dot_product`
attention), and the row split over context=8 with all_gather, ring and ulysses (zigzag layout). Nothing
runs: these are XLA's buffer-assignment numbers of the compiled per-device program. XLA:CPU's default
scheduler orders for thread concurrency: it runs every operand-free instruction (the backward's zero
fills) first, so they are held through the forward. `blockwise` and `ring` are compiled a second time
under its memory-optimized scheduler (`--xla_cpu_enable_concurrency_optimized_scheduler=false`, in a
subprocess: XLA reads the flag once per process), which places each fill where it is used but also
delays each ring transfer to after the compute it should overlap. The second table sets the ring's
constant parts apart: its two travelling K/V blocks (computed on, in flight) and one tile.

Part 2 (balance). For a causal row over N=8 devices, the useful (unmasked) query-key pairs each device
computes at each ring step, plain (contiguous) vs zigzag, for one document filling the row and for a
packed row; "max/mean" is the step's slowest device over the average one. Then the real ring kernel's
computed tiles per device (the kernel's own skip count) for the same rows.

Writes results/results.json, whose `table` is the `context_parallel` results block, and the plot.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from experiments.provenance import commit  # noqa: E402
from lingpack.plan import hlo  # noqa: E402
from lingpack.models.mla import MLA, MLAConfig  # noqa: E402
from lingpack.parallel.context import ContextParallel, context_attention, context_parallel  # noqa: E402
from lingpack.parallel.reorder import zigzag_permutation  # noqa: E402
from lingpack.train.configs import ParallelConfig  # noqa: E402
from lingpack.train.sharding import make_mesh  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N = 8
EMB = 256
MLA_CFG = MLAConfig(num_heads=8, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
BLOCK = 512


def peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


SCHEDULED = ("blockwise", "ring")   # the modes also compiled under the memory-optimized scheduler


def mla_lowered(T: int, mode: str):
    """The lowered MLA fwd+bwd at B=1, T tokens (grads of params and input).

    mode: flash | dot_product (one device, the model's kernels), blockwise (one device, the CP tile kernel:
    a ring of one, so ring / blockwise isolates the effect of splitting the row), or a CP strategy.
    """
    single = mode in ("flash", "dot_product", "blockwise")
    mla = MLA(MLA_CFG, EMB, attention_impl="flash" if mode == "blockwise" else mode if single else "flash",
              attention_block=BLOCK, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(mla)
    mesh = make_mesh(ParallelConfig(data=1, context=1 if single else N), devices=jax.devices()[:1 if single else N])
    cp = None if single else ContextParallel(mesh, strategy=mode)
    # `current()` is None on a one-device context axis by design; the blockwise baseline forces the CP path.
    force = mock.patch("lingpack.models.mla.current", lambda: ContextParallel(mesh, load_balance=False))

    def loss(params, x, seg, pos):
        with context_parallel(cp), (force if mode == "blockwise" else contextlib.nullcontext()):
            y = nnx.merge(graphdef, params)(x, seg, pos)
            # A loss whose cotangent depends on the forward, as in training (a plain sum has a constant one, which
            # XLA computes from the weights alone and may hold through the whole forward).
            return 0.5 * jnp.sum(y * y)

    row, rep = NamedSharding(mesh, P(None, "context")), NamedSharding(mesh, P())
    shapes = (jax.ShapeDtypeStruct((1, T, EMB), jnp.float32, sharding=row),
              jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=row),
              jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=row))
    params_abs = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=rep), params)
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params_abs, *shapes)


def mla_peak(T: int, mode: str) -> int:
    """Per-device peak bytes of `mla_lowered(T, mode)`, compiled under this process's XLA flags."""
    return peak_bytes(mla_lowered(T, mode).compile())


def memory_scheduled(lengths, modes=SCHEDULED) -> dict:
    """{(T, mode): peak bytes} compiled under XLA:CPU's memory-optimized scheduler (a subprocess)."""
    env = hlo.scheduler_env("memory", os.environ)
    args = [sys.executable, "-m", "experiments.context_parallel.bench", "--peaks", *map(str, lengths), "--modes", *modes]
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return {(r["T"], r["mode"]): r["peak"] for r in json.loads(out.strip().splitlines()[-1])}


def travelling_bytes(T: int) -> int:
    """The ring's two K/V blocks (the one computed on, the one in flight): 2 x T/N tokens x H x (K + V), fp32."""
    return 2 * (T // N) * MLA_CFG.num_heads * (MLA_CFG.qk_head_dim + MLA_CFG.v_head_dim) * 4


def tile_bytes(T: int) -> int:
    """One tile's logits and probabilities, [B, H, block, block] fp32 each, at the block the ring uses
    (`model.attention_block_size`, capped at one zigzag chunk of T / 2N)."""
    block = min(BLOCK, T // (2 * N))
    return 2 * MLA_CFG.num_heads * block * block * 4


def part1(lengths) -> list[dict]:
    rows = []
    for T in lengths:
        row = {"T": T}
        for mode in ("dot_product", "flash", "blockwise", "all_gather", "ring", "ulysses"):
            row[mode] = mla_peak(T, mode)
            print(f"T={T:6d} {mode:12s} {row[mode] / 2**20:10.1f} MiB", flush=True)
        rows.append(row)
    scheduled = memory_scheduled(lengths)
    for row in rows:
        for mode in SCHEDULED:
            row[f"{mode}_memory_scheduler"] = scheduled[(row["T"], mode)]
            print(f"T={row['T']:6d} {mode:12s} {scheduled[(row['T'], mode)] / 2**20:10.1f} MiB (memory-optimized "
                  "scheduler)", flush=True)
        row["ring_travelling"] = travelling_bytes(row["T"])
    return rows


def documents_row(T: int, median: int, seed: int = 0) -> np.ndarray:
    """Segment ids of a packed row: log-normal document lengths around `median`, a 64-token padding tail."""
    rng = np.random.default_rng(seed)
    seg, start, doc = np.zeros(T, np.int32), 0, 1
    while start < T - 64:
        n = int(min(T - 64 - start, max(1, rng.lognormal(np.log(median), 1.0))))
        seg[start:start + n], start, doc = doc, start + n, doc + 1
    return seg


def useful_pairs(seg: np.ndarray, load_balance: bool) -> np.ndarray:
    """[step, device] unmasked causal (query, key) pairs device r computes at ring step j (keys of r - j)."""
    T = seg.size
    shards = (zigzag_permutation(T, N) if load_balance else np.arange(T)).reshape(N, T // N)
    out = np.zeros((N, N), np.int64)
    for r in range(N):
        q = shards[r]
        for j in range(N):
            k = shards[(r - j) % N]
            ok = (seg[q][:, None] == seg[k][None, :]) & (seg[q][:, None] > 0) & (k[None, :] <= q[:, None])
            out[j, r] = ok.sum()
    return out


def balance_stats(pairs: np.ndarray) -> dict:
    """Ring steps synchronise all devices: a step lasts as long as its busiest device (sum of maxima)."""
    mean, mx, total = pairs.mean(axis=1), pairs.max(axis=1), pairs.sum(axis=0)
    return {"per_step_max_over_mean": [float(a / b) if b else 1.0 for a, b in zip(mx, mean)],
            "overall_max_over_mean": float(mx.sum() / mean.sum()),
            "device_total_max_over_mean": float(total.max() / total.mean()),
            "per_device_total": total.tolist()}


def kernel_tiles(seg: np.ndarray, load_balance: bool, block: int) -> list[int]:
    """Tiles the real ring kernel computed per device (its skip count), H=1, K=V=8."""
    T = seg.size
    cp = ContextParallel(make_mesh(ParallelConfig(data=1, context=N)), load_balance=load_balance)
    perm = cp.token_index(T)
    x = jnp.zeros((1, T, 1, 8), jnp.float32)
    _, counts = jax.jit(lambda x, s: context_attention(x, x, x, s, cp=cp, scale=1.0, block=block, return_stats=True))(
        x, jnp.asarray(seg[perm][None]))
    return np.asarray(counts).tolist()


def part2(T: int, block: int) -> dict:
    result = {"T": T, "N": N, "block": block}
    rows = {"one_document": np.ones(T, np.int32), f"packed_median_{T // 4}": documents_row(T, T // 4),
            f"packed_median_{T // 16}": documents_row(T, T // 16)}
    for name, seg in rows.items():
        for lb, layout in ((False, "plain"), (True, "zigzag")):
            stats = balance_stats(useful_pairs(seg, lb))
            stats["kernel_tiles_per_device"] = kernel_tiles(seg, lb, block)
            result[f"{name}/{layout}"] = stats
            print(f"{name:18s} {layout:6s} useful max/mean per step {stats['overall_max_over_mean']:.3f}, per device "
                  f"{stats['device_total_max_over_mean']:.3f}; tiles {stats['kernel_tiles_per_device']}", flush=True)
    return result


def plot(memory: list[dict], balance: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    Ts = [r["T"] for r in memory]
    for mode, style in (("dot_product", "k:"), ("flash", "k-"), ("blockwise", "k--"), ("all_gather", "C1-o"),
                        ("ring", "C0-o"), ("ulysses", "C2-s")):
        a.plot(Ts, [r[mode] / 2**20 for r in memory], style, label=f"{mode} (context={N})" if mode in
               ("all_gather", "ring", "ulysses") else f"{mode} (1 device)")
    a.set(xscale="log", yscale="log", xlabel="T (tokens per row)", ylabel="per-device peak (MiB)",
          title="MLA fwd+bwd, compiled per-device peak")
    a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    a.set_xticks(Ts, [f"{t // 1024}K" for t in Ts])
    a.legend(fontsize=8)
    x = np.arange(N)
    for i, layout in enumerate(("plain", "zigzag")):
        tot = np.asarray(balance[f"one_document/{layout}"]["per_device_total"], float)
        b.bar(x + (i - 0.5) * 0.4, tot / tot.mean(), 0.4, label=f"{layout} (max/mean per step "
              f"{balance[f'one_document/{layout}']['overall_max_over_mean']:.2f})")
    b.axhline(1.0, color="k", lw=0.5)
    b.set(xlabel="device", ylabel="useful causal work / mean", title=f"ring, one document, T={balance['T']}, N={N}")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(memory: list[dict], balance: dict, code: str = "-") -> str:
    """The `context_parallel` results block, from results.json's `memory`, `balance` and `commit`."""
    lines = [f"Per-device peak of MLA fwd+bwd (MiB; B=1, {MLA_CFG.num_heads} heads, emb {EMB}, block {BLOCK}, fp32; "
             f"lingpack at commit {code}). "
             f"The first three run on one device, the last three split the row over context={N} (zigzag).", "",
             "| T | dot_product | flash | blockwise | all_gather | ring | ulysses | blockwise/ring | flash/ring |",
             "|---|---|---|---|---|---|---|---|---|"]
    mib = lambda b: f"{b / 2**20:.0f}"
    mib1 = lambda b: f"{b / 2**20:.1f}"
    for r in memory:
        lines.append(f"| {r['T'] // 1024}K | {mib(r['dot_product'])} | {mib(r['flash'])} | {mib(r['blockwise'])} | "
                     f"{mib(r['all_gather'])} | {mib(r['ring'])} | {mib(r['ulysses'])} | "
                     f"{r['blockwise'] / r['ring']:.1f}x | {r['flash'] / r['ring']:.1f}x |")
    lines += ["", f"The ring against {N} x its one-device peer (the same tile kernel on the whole row), with its "
              "constant parts set apart: the two travelling K/V blocks (the one computed on and the one in flight, "
              f"2 x T/{N} x {MLA_CFG.num_heads} heads x (K+V) x 4 B) and one tile's logits and probabilities "
              f"(2 x {MLA_CFG.num_heads} heads x block^2 x 4 B). Per scheduler of XLA:CPU: default (concurrency-"
              "optimized, every operand-free fill first) and memory (memory-optimized). Goal: ring <= "
              f"blockwise / {N}.", "",
              "| T | scheduler | blockwise / 8 | ring | blockwise/ring | two K/V blocks | tile | ring - both | "
              "(ring - both) / (blockwise / 8) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in memory:
        if "ring_memory_scheduler" not in r:
            continue
        tile = tile_bytes(r["T"])
        for name, bw, ring in (("default", r["blockwise"], r["ring"]),
                               ("memory", r["blockwise_memory_scheduler"], r["ring_memory_scheduler"])):
            rest = ring - r["ring_travelling"] - tile
            lines.append(f"| {r['T'] // 1024}K | {name} | {mib1(bw / N)} | {mib1(ring)} | {bw / ring:.1f}x | "
                         f"{mib1(r['ring_travelling'])} | {mib1(tile)} | {mib1(rest)} | {rest / (bw / N):.2f} |")
    lines += ["", f"Causal work balance, ring over N={N}, T={balance['T']}. Per step: the busiest device's useful "
              "(unmasked) query-key pairs over the mean, summed over steps (a ring step lasts as long as its busiest "
              "device; 1.00 = perfect). Per device: total useful pairs, max over mean. Tiles: what the ring kernel "
              f"computed per device after skipping fully masked tiles (block {balance['block']}).", "",
              "| row | layout | per-step max/mean | per-device max/mean | kernel tiles per device |",
              "|---|---|---|---|---|"]
    for key, stats in balance.items():
        if "/" in key:
            name, layout = key.split("/")
            lines.append(f"| {name} | {layout} | {stats['overall_max_over_mean']:.2f} | "
                         f"{stats['device_total_max_over_mean']:.2f} | {stats['kernel_tiles_per_device']} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "context_parallel" / "results"))
    parser.add_argument("--memory-only", action="store_true", help="part 1 only, printed, nothing written")
    parser.add_argument("--T", type=int, nargs="+", help="lengths for --memory-only (default 4K..64K)")
    parser.add_argument("--peaks", type=int, nargs="+", help=argparse.SUPPRESS)  # worker: T... -> JSON peaks
    parser.add_argument("--modes", nargs="+", default=list(SCHEDULED), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peaks:
        print(json.dumps([{"T": T, "mode": m, "peak": mla_peak(T, m)} for T in args.peaks for m in args.modes]))
        return
    if args.memory_only:
        part1(args.T or [4096, 8192, 16384, 32768, 65536])
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [4096, 8192] if args.quick else [4096, 8192, 16384, 32768, 65536]
    balance = part2(4096, 64)
    memory = part1(lengths)
    code = commit()
    (out / "results.json").write_text(json.dumps({"commit": code, "memory": memory, "balance": balance}, indent=2))
    plot(memory, balance, out / "context_parallel.png")
    print(table(memory, balance, code))


if __name__ == "__main__":
    main()
