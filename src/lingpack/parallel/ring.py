"""Ring attention: the local query shard stays, key/value shards travel around a ring of devices.

Runs inside `shard_map` on local shards laid out `[B, H, T_local, *]`. Each of the R steps issues the
`ppermute` of the key block it will need next BEFORE computing on the one it holds, so the transfer can
overlap the compute. Keys travel with their segment ids and their original token indices (where the
token sits in the unpermuted row), and the mask is built from those, never from block offsets: the same
code is right for contiguous and zigzag layouts and for any document lengths. Tiles proven fully masked
by index / segment ranges are skipped (`blockwise.tile_visible`) and counted.

Backward (custom VJP, from the saved fp32 lse): a second ring in which each key block travels with its
fp32 dK / dV accumulators; every device adds its contribution, and after R hops they are home.

USP reuses this with `stride` U: ring partners are the devices U apart on the `context` axis (the ones
holding the same head group after the Ulysses all-to-all, see ulysses.py).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lingpack.kernels.attention.blockwise import Tiling, backward_tiles, finalize, forward_tiles, init_softmax
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

    def step(carry, _):
        st, kv, count = carry
        nxt = _send(ring, kv)            # the next block's transfer is issued before this block's compute
        st, c = tiles(st, kv)
        return (st, nxt, count + c), None

    state = init_softmax(B, H, Q, v.shape[-1], at_least_fp32(q.dtype, k.dtype, v.dtype))
    carry = (state, (k, v, kv_seg, kv_index), jnp.int32(0))
    (st, kv, count), _ = jax.lax.scan(step, carry, None, length=ring.size - 1)
    st, c = tiles(st, kv)                # the last block needs no onward transfer
    o, lse = finalize(st)
    return o, lse, count + c


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def ring_attention(q_BHQK, k_BHSK, v_BHSV, q_seg, kv_seg, q_index, kv_index, ring: Ring):
    """Local shards -> (o [B,H,Q,V] fp32 or wider, tiles computed on this device over all R steps)."""
    o, _, count = _ring_forward(q_BHQK, k_BHSK, v_BHSV, q_seg, kv_seg, q_index, kv_index, ring)
    return o, count


def _ring_fwd(q, k, v, q_seg, kv_seg, q_index, kv_index, ring):
    o, lse, count = _ring_forward(q, k, v, q_seg, kv_seg, q_index, kv_index, ring)
    return (o, count), (q, k, v, q_seg, kv_seg, q_index, kv_index, o, lse)


def _ring_bwd(ring, res, cotangents):
    q, k, v, q_seg, kv_seg, q_index, kv_index, o, lse = res
    do, wide = cotangents[0].astype(o.dtype), o.dtype   # o's dtype: fp32 (float64 for float64 inputs)
    delta = jnp.sum(do * o, axis=-1)  # D_i = sum_v dO_iv O_iv, the softmax-Jacobian row term
    grads = lambda kv: backward_tiles(q, kv[0], kv[1], do, lse, delta, q_seg, kv[2], q_index, kv[3], ring.tiling)

    def step(carry, _):
        dq, kv, dkv = carry
        nxt = _send(ring, kv)            # issued before the compute, as in the forward
        dq_t, dk_t, dv_t = grads(kv)
        dkv = _send(ring, (dkv[0] + dk_t, dkv[1] + dv_t))  # fp32 dK/dV ride along with their K/V
        return (dq + dq_t, nxt, dkv), None

    dkv0 = (jnp.zeros(k.shape, wide), jnp.zeros(v.shape, wide))
    carry = (jnp.zeros(q.shape, wide), (k, v, kv_seg, kv_index), dkv0)
    (dq, kv, dkv), _ = jax.lax.scan(step, carry, None, length=ring.size - 1)
    dq_t, dk_t, dv_t = grads(kv)
    dk, dv = _send(ring, (dkv[0] + dk_t, dkv[1] + dv_t))  # the R-th hop brings them home
    return (dq + dq_t).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
