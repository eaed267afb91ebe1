"""The ring's per-device memory against its one-device peer: compiled peaks (deterministic), nothing runs."""
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack.parallel.context import ContextParallel, context_attention
from lingpack.train.configs import ParallelConfig
from lingpack.train.sharding import make_mesh

B, T, H, K, V, BLOCK = 1, 32768, 1, 32, 16, 256    # 4K tokens per device: the T-proportional part dominates


def peak(cp: ContextParallel) -> int:
    """Per-device peak bytes of the attention's forward + backward (grads of q, k, v) under `cp`."""
    def loss(q, k, v, w, seg):
        return jnp.sum(context_attention(q, k, v, seg, cp=cp, scale=K ** -0.5, block=BLOCK) * w)

    row = NamedSharding(cp.mesh, P(None, "context"))
    x = lambda d: jax.ShapeDtypeStruct((B, T, H, d), jnp.float32, sharding=row)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=row)
    m = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x(K), x(K), x(V), x(V), seg).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def test_ring_peak_against_one_device():
    """At N=8 the ring holds its 1/8 share of the same tile kernel on one device (a one-device context mesh)
    plus the travelling K/V and dK/dV blocks: measured 1.66 x (one-device peak / 8), bound 1.8. Tiles over
    stacked [blocks, ...] copies of every operand and accumulator, and ring carries that start as copies of
    the local K/V or as zero-filled dK/dV, measured 2.12."""
    one = ContextParallel(make_mesh(ParallelConfig(data=1, context=1), devices=jax.devices()[:1]), load_balance=False)
    ring = ContextParallel(make_mesh(ParallelConfig(data=1, context=8)), strategy="ring")
    one_peak, ring_peak = peak(one), peak(ring)
    assert ring_peak <= 1.8 * one_peak / 8, (ring_peak / 2**20, one_peak / 2**20)
