"""Where `chunked` KDA's forward + backward time goes, stage by stage, on bench_kda.py's shape.

    python experiments/kda_stages.py [--repeats 5] [--out experiments/results/kda_stages.json]

B=1, T=4096, H=4, K=V=128, fp32, chunk 64, one document, gates in [-5, 0). Each stage is jitted alone
(forward, and forward + backward of the sum of squares of its outputs) on the inputs it sees inside the
kernel; process CPU time per call (median; the machine is shared, so wall time mostly measures the load)
and XLA's FLOP count (which leaves out the work inside loops: the inter-chunk scan's). Stages: the decay
products A_qk/A_kk (`safe_gate` and any gate), the unit-lower inverse, the whole intra-chunk part (both gates),
the inter-chunk scan + outputs (with the decay factors it forms in its loop), and the whole kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lingpack.kernels.kda import chunked as ch  # noqa: E402
from tests.kernels.kda_cases import make_inputs  # noqa: E402

B, T, H, K, V, C = 1, 4096, 4, 128, 128, 64


def cpu_seconds(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.process_time()
        jax.block_until_ready(fn(*args))
        times.append(time.process_time() - start)
    return statistics.median(times)


def measure(stage, args, repeats):
    fwd = jax.jit(stage)
    loss = lambda *a: sum(jnp.sum(o * o) for o in jax.tree.leaves(stage(*a)))
    bwd = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    gflop = lambda f: f.lower(*args).compile().cost_analysis()["flops"] / 1e9
    return {"fwd_cpu_s": cpu_seconds(fwd, args, repeats), "fwd_bwd_cpu_s": cpu_seconds(bwd, args, repeats),
            "fwd_gflop": gflop(fwd), "fwd_bwd_gflop": gflop(bwd)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "kda_stages.json"))
    args = parser.parse_args()
    q, k, v, g, beta = [jnp.asarray(x) for x in make_inputs(np.random.default_rng(0), B, T, H, K, V)]
    g = jnp.maximum(g, -5.0)
    N = T // C
    xs = ch._prepare(q, k, v, g, beta, jnp.ones((B, T), bool), K ** -0.5)
    qc, kc, vc, gc = [ch._to_chunks(x, N, C) for x in xs[:4]]
    bc = jnp.moveaxis(xs[4].reshape(B, N, C, H), 2, 3)
    seg = jnp.ones((B, N, 1, C), jnp.int32)
    G = jnp.cumsum(gc, axis=-2)
    pre = ch._intra_chunk(qc, kc, gc, bc, seg, sub=16, safe_gate=True)
    every = jnp.ones(bc.shape, bool)  # one document: every token continues the state, is in the last segment
    pre.update(q=qc, k=kc, v=vc, carry=every, last=every, keep=every[..., 0])
    major = {name: ch._lanes_major(pre[name]) for name in ch.SCAN_INPUTS}
    masks = [major.pop(name) for name in ("carry", "last", "keep")]

    def inter(*floats):  # the scan with the outputs, as in the kernel
        table = jnp.zeros((B + 1, H, K, V))
        idx = jnp.full((N, B), B, jnp.int32).at[0].set(jnp.arange(B))
        r = jnp.broadcast_to((jnp.arange(N) > 0)[:, None], (N, B)).astype(jnp.float32)
        return ch.chunk_scan(table, idx, r, *floats, *masks)[0]

    whole = lambda safe: lambda q, k, v, g, b: ch.chunked_segment_native(
        q, k, v, g, b, segment_ids_BT=jnp.ones((B, T), jnp.int32), scale=K ** -0.5,
        initial_state_BHKV=jnp.zeros((B, H, K, V)), safe_gate=safe)[0]
    stages = {
        "decay products, safe_gate": (lambda q, k, G: ch._decay_products(q, k, G, seg, sub=16, safe_gate=True), (qc, kc, G)),
        "decay products, any gate": (lambda q, k, G: ch._decay_products(q, k, G, seg, sub=16, safe_gate=False), (qc, kc, G)),
        "unit-lower inverse": (lambda a: ch.unit_lower_inverse(jnp.tril(a, -1)), (0.1 * pre["a_qk"],)),
        "intra-chunk, safe_gate": (lambda q, k, g, b: ch._intra_chunk(q, k, g, b, seg, sub=16, safe_gate=True),
                                   (qc, kc, gc, bc)),
        "intra-chunk, any gate": (lambda q, k, g, b: ch._intra_chunk(q, k, g, b, seg, sub=16, safe_gate=False),
                                  (qc, kc, gc, bc)),
        "inter-chunk scan + outputs (+ decay factors)": (inter, tuple(major.values())),
        "whole kernel, safe_gate": (whole(True), (q, k, v, g, beta)),
        "whole kernel, any gate": (whole(False), (q, k, v, g, beta)),
    }
    result = {}
    for name, (stage, stage_args) in stages.items():
        result[name] = row = measure(stage, stage_args, args.repeats)
        print(f"  {name:28s} fwd {row['fwd_cpu_s']:.3f} s {row['fwd_gflop']:6.2f} GFLOP | fwd+bwd"
              f" {row['fwd_bwd_cpu_s']:.3f} s {row['fwd_bwd_gflop']:6.2f} GFLOP (CPU time)", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
