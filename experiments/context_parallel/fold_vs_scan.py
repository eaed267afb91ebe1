"""KDA CP state composition: all-gather + local fold (what kda_cp.py does) vs a log2(N) ppermute scan.

    python experiments/context_parallel/fold_vs_scan.py [--repeats 30]

Each of N=8 fake CPU devices holds one contiguous block's affine summary S_out = M S_in + S0 (M [B, H, K, K],
S0 [B, H, K, V], fp32; M already zeroed where the block starts a new document). Both programs return the
state entering every block:
* fold: all_gather the [S0 | M] summaries (one collective), then each device folds the N maps in order;
* scan: Hillis-Steele inclusive scan of the maps, log2(N) rounds of ppermute by 2^j and composition
  (M2, S2) o (M1, S1) = (M2 M1, M2 S1 + S2), then one more ppermute by 1 for the exclusive prefix.
Reported: collectives in the compiled HLO (count, result bytes per device), the matmuls each device chains
(counted from the code: N for the fold, 2 log2(N) - 1 for the scan), and the median wall
time ratio scan / fold, timed alternately in the same process (fake devices share the CPU: memcpy
collectives and a loaded machine, so the ratio says little about a real interconnect's latency). The two
programs' outputs are checked equal first.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_memory import OUT, collectives  # noqa: E402

N, AXIS = 8, "context"
HIGHEST = jax.lax.Precision.HIGHEST


def fold(S0, M):
    """[1, B, H, K, V], [1, B, H, K, K] per device -> the state entering this device's block."""
    V = S0.shape[-1]
    maps = jax.lax.all_gather(jnp.concatenate([S0, M], axis=-1), AXIS)[:, 0]   # [N, B, H, K, V+K]

    def step(state, m):
        return jnp.einsum("bhij,bhjv->bhiv", m[..., V:], state, precision=HIGHEST) + m[..., :V], state

    _, entering = jax.lax.scan(step, jnp.zeros_like(S0[0]), maps)
    return entering[jax.lax.axis_index(AXIS)][None]


def scan(S0, M):
    rank, S, Mc = jax.lax.axis_index(AXIS), S0[0], M[0]
    shift = 1
    while shift < N:   # after round j, device r holds the composition of blocks max(0, r-2^(j+1)+1) .. r
        perm = [(i, i + shift) for i in range(N - shift)]
        S_prev, M_prev = jax.lax.ppermute((S, Mc), AXIS, perm)
        has = rank >= shift
        S = jnp.where(has, jnp.einsum("bhij,bhjv->bhiv", Mc, S_prev, precision=HIGHEST) + S, S)
        Mc = jnp.where(has, jnp.einsum("bhij,bhjk->bhik", Mc, M_prev, precision=HIGHEST), Mc)
        shift *= 2
    return jax.lax.ppermute(S, AXIS, [(i, i + 1) for i in range(N - 1)])[None]   # device 0 receives zeros


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--K", type=int, default=128)
    args = parser.parse_args()
    B, H, K = args.B, args.H, args.K
    mesh = jax.make_mesh((N,), (AXIS,))
    spec = NamedSharding(mesh, P(AXIS))
    rng = np.random.default_rng(0)
    S0 = jax.device_put(rng.standard_normal((N, B, H, K, K), np.float32), spec)
    M = jax.device_put(0.1 * rng.standard_normal((N, B, H, K, K), np.float32), spec)   # contracting maps
    fns = {name: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS)))
           for name, f in (("fold", fold), ("scan", scan))}
    compiled = {name: fn.lower(S0, M).compile() for name, fn in fns.items()}
    out = {name: np.asarray(c(S0, M)) for name, c in compiled.items()}
    err = float(np.abs(out["fold"] - out["scan"]).max() / np.abs(out["fold"]).max())
    assert err < 1e-5, f"fold and scan disagree: rel {err}"
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, c in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(S0, M))
            times[name].append(time.perf_counter() - start)
    result = {"N": N, "B": B, "H": H, "K": K, "rel_diff": err, "repeats": args.repeats}
    # [H, K, K] x [H, K, K|V] products each device computes, one after another (by construction of the code)
    chained = {"fold": N, "scan": 2 * (N.bit_length() - 1) - 1}
    for name, c in compiled.items():
        result[name] = {"collectives": collectives(c.as_text())["by_kind"], "chained_matmuls": chained[name],
                        "median_s": statistics.median(times[name])}
    result["scan_over_fold_time"] = result["scan"]["median_s"] / result["fold"]["median_s"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fold_vs_scan.json").write_text(json.dumps(result, indent=1) + "\n")
    (OUT / "fold_vs_scan.md").write_text(table(result))
    print(table(result))
    return 0


def table(r: dict) -> str:
    lines = [f"Composing N={r['N']} KDA block summaries (B={r['B']}, H={r['H']}, K=V={r['K']}, fp32) on 8 fake CPU "
             f"devices; outputs equal (rel {r['rel_diff']:.1e}). Wall-time ratio from {r['repeats']} alternating "
             "calls in one process.", "",
             "| composition | collectives (count x kind, KiB per device) | chained matmuls per device | time / fold |",
             "|---|---|---|---|"]
    for name, label in (("fold", "all-gather + local fold"), ("scan", "log2(N) ppermute scan")):
        coll = ", ".join(f"{v['count']} x {k} ({v['bytes'] / 1024:.0f})" for k, v in r[name]["collectives"].items())
        lines.append(f"| {label} | {coll} | {r[name]['chained_matmuls']} | "
                     f"{r[name]['median_s'] / r['fold']['median_s']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
