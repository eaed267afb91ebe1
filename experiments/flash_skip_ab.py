"""Before/after of tile skipping in `flash` attention, one MLA mixer forward + backward, in one process.

    python experiments/flash_skip_ab.py [--T 4096] [--repeats 3] [--out experiments/results/flash_skip_ab.json]

"before" is `flash.py` as of commit 2373d98 (key blocks only, every query against every block, nothing
skipped), loaded from git; "after" is today's (query x key tiles, fully masked ones skipped); "dense" is
the masked [T, T] `dot_product`. ling3_small's MLA, [1, T] packed with log-normal documents (median T/16),
same weights for all three; calls interleaved; process CPU time (the machine is shared, so wall time
mostly measures the load) and wall time are both recorded, medians over repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import bench_train as bt  # noqa: E402
from lingpack.kernels.attention import api  # noqa: E402
from lingpack.models.block import DecoderLayer  # noqa: E402

BEFORE = "2373d98"


def old_flash():
    source = subprocess.run(["git", "show", f"{BEFORE}:src/lingpack/kernels/attention/flash.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("flash_before")
    exec(compile(source, f"flash.py@{BEFORE}", "exec"), module.__dict__)
    return module.flash_attention


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "flash_skip_ab.json"))
    args = parser.parse_args()
    cfg, _, _ = bt.model_config("small")
    batch = bt.packed_batch(1, args.T, cfg.vocab_size, median_doc=args.T // 16)
    seg, pos = batch["inputs_segmentation"], batch["inputs_position"]
    x = jax.random.normal(jax.random.key(1), (1, args.T, cfg.emb_dim), jnp.dtype(cfg.dtype))
    computed, total = bt.tile_counts(seg, block=cfg.attention_block_size)
    after = api.flash_attention
    fns, grads = {}, {}
    for name, impl, flash in (("dense", "dot_product", after), ("flash before", "flash", old_flash()),
                              ("flash after", "flash", after)):
        api.flash_attention = flash  # picked up when the function is traced, just below
        spec = dataclasses.replace(cfg.layer_spec("mla", "moe"), attention_impl=impl)
        layer = DecoderLayer(spec, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=nnx.Rngs(0))
        fn, params = bt._fwd_bwd(layer.self_attn, lambda m, x: m(x, seg, pos))
        grads[name] = jax.tree.leaves(jax.block_until_ready(fn(params, x)))
        fns[name] = lambda f=fn, p=params: jax.block_until_ready(f(p, x))
    api.flash_attention = after
    cpu, wall = {n: [] for n in fns}, {n: [] for n in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            c, w = time.process_time(), time.perf_counter()
            fn()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    med = lambda d: {n: float(np.median(t)) for n, t in d.items()}
    diff = {n: max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                   for a, b in zip(grads[n], grads["dense"])) for n in ("flash before", "flash after")}
    result = {"T": args.T, "documents": int(seg.max()), "dtype": cfg.dtype, "block": cfg.attention_block_size,
              "tiles_computed": computed, "tiles_total": total, "cpu_s": med(cpu), "wall_s": med(wall),
              "cpu_before_over_after": med(cpu)["flash before"] / med(cpu)["flash after"],
              "cpu_dense_over_after": med(cpu)["dense"] / med(cpu)["flash after"],
              "max_abs_grad_difference_vs_dense": diff}
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
