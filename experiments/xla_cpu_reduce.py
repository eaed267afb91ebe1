"""XLA:CPU quirk behind a KDA kernel choice: a multiply + reduce over the last axis vs the same einsum.

    python experiments/xla_cpu_reduce.py [--out experiments/results/xla_cpu_reduce.json]

sum(a * b, -1) on [64, 1, 4, 128, 128] fp32 (the shape of the inter-chunk state gradient) against
einsum("...kv,...kv->...k"); process CPU time, median of 7 calls, both in one process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kda_stages import cpu_seconds  # experiments/ is the script's directory


def cpu_ms(fn, *args, repeats=7):
    return 1e3 * cpu_seconds(fn, args, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "xla_cpu_reduce.json"))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    a, b = [jnp.asarray(rng.standard_normal((64, 1, 4, 128, 128)), jnp.float32) for _ in range(2)]
    result = {"jax": jax.__version__,
              "multiply_reduce_ms": cpu_ms(jax.jit(lambda a, b: jnp.sum(a * b, axis=-1)), a, b),
              "einsum_ms": cpu_ms(jax.jit(lambda a, b: jnp.einsum("...kv,...kv->...k", a, b)), a, b)}
    print(result)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
