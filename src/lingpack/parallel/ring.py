"""Ring attention: the local query shard stays, key/value shards travel around a ring of devices.

Runs inside `shard_map` on local shards laid out `[B, H, T_local, *]`. Each of the R steps issues the
`ppermute` of the key block it will need next BEFORE computing on the one it holds, so the transfer can
overlap the compute. Keys travel with their segment ids and their original token indices (where the
token sits in the unpermuted row), and the mask is built from those, never from block offsets: the same
code is right for contiguous and zigzag layouts and for any document lengths. Tiles proven fully masked
by index / segment ranges are skipped (`blockwise.tile_visible`) and counted.

Backward (custom VJP, from the saved fp32 lse): a second ring in which each key block travels with its
fp32 dK / dV accumulators; every device adds its contribution, and after R hops they are home.

Memory per device: the local q, k, v, o and lse, the key block being computed and the one in flight; in
the backward also dq, the arriving dK / dV and this step's own (a fresh buffer, so the compute never waits
for the arriving one). The local step runs outside the scans: no scan carry starts as a copy of the local
K/V or as zero-filled dK / dV. docs/parallelism.md#ring-attention-memory has the measured breakdown.

USP reuses this with `stride` U: ring partners are the devices U apart on the `context` axis (the ones
holding the same head group after the Ulysses all-to-all, see ulysses.py).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lingpack.kernels.attention.blockwise import (Tiling, backward_tiles, finalize, forward_tiles, init_softmax,
                                                  name_residuals)
from lingpack.precision import at_least_fp32


class Ring(NamedTuple):
    axis: str        # the mesh axis the ring runs over (inside shard_map)
    size: int        # R: devices in one ring
    stride: int      # distance between ring neighbours on `axis` (1; U for USP); axis size = size * stride
    tiling: Tiling

    def perm(self) -> list[tuple[int, int]]:
        """(source, destination) pairs: every device sends to the next member of its own ring."""
        n = self.size * self.stride
        return [(c, (c + self.stride) % n) for c in range(n)]


def _send(ring: Ring, arrays: tuple) -> tuple:
    return tuple(jax.lax.ppermute(x, ring.axis, ring.perm()) for x in arrays)


def _ring_forward(q, k, v, q_seg, kv_seg, q_index, kv_index, ring: Ring):
    B, H, Q, _ = q.shape
    tiles = lambda st, kv: forward_tiles(st, q, kv[0], kv[1], q_seg, kv[2], q_index, kv[3], ring.tiling)
    state = init_softmax(B, H, Q, v.shape[-1], at_least_fp32(q.dtype, k.dtype, v.dtype))
    kv = (k, v, kv_seg, kv_index)
    if ring.size == 1:
        st, count = tiles(state, kv)
        return (*finalize(st), count)

    def step(carry, _):
        st, kv, count = carry
        nxt = _send(ring, kv)            # the next block's transfer is issued before this block's compute
        st, c = tiles(st, kv)
        return (st, nxt, count + c), None

    # The local step runs outside the scan, so the scan's carry starts from the first received block
    # (a fresh buffer) instead of a copy of the local K/V, which the backward keeps anyway.
    (st, kv, count), _ = step((state, kv, jnp.int32(0)), None)
    (st, kv, count), _ = jax.lax.scan(step, (st, kv, count), None, length=ring.size - 2)
    st, c = tiles(st, kv)                # the last block needs no onward transfer
    return (*finalize(st), count + c)


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def ring_attention(q_BHQK, k_BHSK, v_BHSV, q_seg, kv_seg, q_index, kv_index, ring: Ring):
    """Local shards -> (o [B,H,Q,V] fp32 or wider, tiles computed on this device over all R steps)."""
    o, _, count = _ring_forward(q_BHQK, k_BHSK, v_BHSV, q_seg, kv_seg, q_index, kv_index, ring)
    return o, count


def _ring_fwd(q, k, v, q_seg, kv_seg, q_index, kv_index, ring):
    o, lse, count = _ring_forward(q, k, v, q_seg, kv_seg, q_index, kv_index, ring)
    o, lse = name_residuals(ring.tiling.residual_name, o, lse)
    return (o, count), (q, k, v, q_seg, kv_seg, q_index, kv_index, o, lse)


def _ring_bwd(ring, res, cotangents):
    q, k, v, q_seg, kv_seg, q_index, kv_index, o, lse = res
    do = cotangents[0].astype(o.dtype)   # o's dtype: fp32 (float64 for float64 inputs)
    delta = jnp.sum(do * o, axis=-1)  # D_i = sum_v dO_iv O_iv, the softmax-Jacobian row term
    grads = lambda kv, dq, fill=0.0: backward_tiles(q, kv[0], kv[1], do, lse, delta, q_seg, kv[2], q_index, kv[3],
                                                    ring.tiling, dq_BHQK=dq, fill=fill)  # dq accumulates in place
    kv = (k, v, kv_seg, kv_index)
    cast = lambda dq, dk, dv: (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None)
    if ring.size == 1:
        return cast(*grads(kv, None))

    def step(carry, _):
        dq, kv, dkv = carry
        nxt = _send(ring, kv)            # issued before the compute, as in the forward
        dq, dk_t, dv_t = grads(kv, dq)   # fresh dK/dV: adding into the arriving dkv would wait for its transfer
        dkv = _send(ring, (dk_t, dv_t) if dkv is None else (dkv[0] + dk_t, dkv[1] + dv_t))  # fp32, with their K/V
        return (dq, nxt, dkv), None

    # The local step runs outside the scan: it starts dq and the travelling dK/dV without zero-filled carries.
    (dq, kv, dkv), _ = step((None, kv, None), None)
    (dq, kv, dkv), _ = jax.lax.scan(step, (dq, kv, dkv), None, length=ring.size - 2)
    # -0.0: a fill XLA cannot merge with the local step's 0.0 one. Merged, the one buffer would be copied
    # before the local step writes into it, and that copy held through the whole backward ring.
    dq, dk_t, dv_t = grads(kv, dq, fill=-0.0)
    dk, dv = _send(ring, (dkv[0] + dk_t, dkv[1] + dv_t))  # the R-th hop brings them home
    return cast(dq, dk, dv)


ring_attention.defvjp(_ring_fwd, _ring_bwd)
