"""Ring attention whose tiles run in the splash kernel: one Mosaic call per ring step, not XLA tile loops.

The ring of ring.py (same exchange, same order of transfers and compute, same custom VJP shape), with each
step's whole local-query x arriving-key tile handed to splash (`kernels/attention/splash.py` `tile_forward`,
`tile_backward`). Splash masks by segment ids and by a STATIC block mask, so a step's causal structure must
be known per step without reading token indices. The layouts of reorder.py give it: on a ring of all N
context devices (stride 1), device r at step t holds the key block of device s = (r - t) mod N, and

  t = 0 (s = r)       causal over the local row: its chunks are in original order (r before 2N-1-r);
  zigzag, s < r       every local query sees all of chunk s (the block's first half), none of 2N-1-s;
  zigzag, s > r       only the second local chunk (2N-1-r) sees keys: all of the block;
  contiguous, s < r   every query sees every key; s > r: nothing (the step is skipped).

Both zigzag cases are T_local x T_local / 2 tiles with no mask but the segments'; `lax.cond` picks one.

Forward: each step's normalised output and lse merge into the running (o, lse) in fp32. Backward: splash's
dq and dkv kernels run on each step's tile with the ROW's lse and sum(o * do) as residuals, so each returns
its exact share of the row's gradient; dq accumulates locally in fp32, dK / dV (fp32) travel with their K / V block
and are home after N hops, as in ring.py. Padding queries (segment 0) attend padding keys in splash;
context.py zeroes their outputs, so their cotangents are 0 and so are their gradients' contributions.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lingpack.kernels.attention import splash
from lingpack.kernels.attention.blockwise import name_residuals

# the named scope of each step's lax.cond (early / late key block): the planner weights its branches by it
STEP_SCOPE = "splash_ring_step"


class SplashRing(NamedTuple):
    axis: str           # the context mesh axis (inside shard_map); the ring is all of it, stride 1
    size: int           # N devices
    zigzag: bool        # reorder.py's load-balanced layout (else contiguous shards)
    scale: float
    block: int          # splash's tile; divides T_local / 2 (zigzag) or T_local
    interpret: bool
    residual_name: str | None = None   # the forward's (o, lse) named for a remat policy (blockwise.name_residuals)
    # the formulation (docs/parallelism.md#ring-attention-in-splash): steps as a Python loop, not a lax.scan,
    # and the kernels reading K seq-minor; the alternatives stay for experiments/plan/ops.py's comparison
    unroll: bool = True
    k_seq_minor: bool = True

    def perm(self) -> list[tuple[int, int]]:
        return [(c, (c + 1) % self.size) for c in range(self.size)]

    def tile(self, causal: bool):
        return dict(causal=causal, block=self.block, interpret=self.interpret, k_seq_minor=self.k_seq_minor)


def _send(ring: SplashRing, arrays: tuple) -> tuple:
    return tuple(jax.lax.ppermute(x, ring.axis, ring.perm()) for x in arrays)


def _steps(ring: SplashRing, body, carry, kv):
    """carry through body(carry, kv_t, t) for t = 1 .. N-1, kv_t the block arriving at step t (kv: step 1's),
    each next block's transfer issued before step t's compute. Unrolled, XLA:TPU neither copies the
    travelling blocks per step nor keeps a step's transfer from overlapping the next steps' kernels."""
    if ring.unroll:
        for t in range(1, ring.size):
            nxt = _send(ring, kv) if t < ring.size - 1 else None   # the last block goes no further
            carry, kv = body(carry, kv, t), nxt
        return carry

    def step(c, t):
        carry, kv = c
        nxt = _send(ring, kv)
        return (body(carry, kv, t), nxt), None

    (carry, kv), _ = jax.lax.scan(step, (carry, kv), jnp.arange(1, ring.size - 1))
    return body(carry, kv, ring.size - 1)


def _forward_tile(ring, causal, q, k, v, q_seg, kv_seg):
    """(o [B,H,Q,V] fp32, lse [B,H,Q] fp32) of one tile for every row."""
    o, lse = jax.vmap(partial(splash.tile_forward, **ring.tile(causal)))(q, k, v, q_seg, kv_seg)
    return o.astype(jnp.float32), lse


def _merge(o, lse, o_t, lse_t):
    """Two normalised partial softmaxes of the same queries -> their union (fp32)."""
    new = jnp.logaddexp(lse, lse_t)
    return o * jnp.exp(lse - new)[..., None] + o_t * jnp.exp(lse_t - new)[..., None], new


def _source(ring: SplashRing, t):
    """The device whose key block this device holds at step t, and whether it precedes this one."""
    r = jax.lax.axis_index(ring.axis)
    return (r - t) % ring.size < r


def _visit(ring, q, q_seg, state, kv, t):
    """`state` (o, lse) merged with step t's tile (t >= 1)."""
    k, v, kv_seg = kv
    h = q.shape[2] // 2
    if ring.zigzag:
        def early(o, lse):    # all queries x the block's first chunk
            return _merge(o, lse, *_forward_tile(ring, False, q, k[:, :, :h], v[:, :, :h], q_seg, kv_seg[:, :h]))

        def late(o, lse):     # the second local chunk x the whole block
            o2, lse2 = _merge(o[:, :, h:], lse[:, :, h:],
                              *_forward_tile(ring, False, q[:, :, h:], k, v, q_seg[:, h:], kv_seg))
            return o.at[:, :, h:].set(o2), lse.at[:, :, h:].set(lse2)
    else:
        early = lambda o, lse: _merge(o, lse, *_forward_tile(ring, False, q, k, v, q_seg, kv_seg))
        late = lambda o, lse: (o, lse)
    with jax.named_scope(STEP_SCOPE):
        return jax.lax.cond(_source(ring, t), early, late, *state)


def _ring_forward(q, k, v, seg, ring: SplashRing):
    kv = (k, v, seg)
    first = _send(ring, kv) if ring.size > 1 else None   # issued before the local step's compute
    state = _forward_tile(ring, True, q, k, v, seg, seg)   # the local step, causal
    if ring.size == 1:
        return state

    return _steps(ring, lambda state, kv, t: _visit(ring, q, seg, state, kv, t), state, first)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def splash_ring_attention(q_BHQK, k_BHSK, v_BHSV, seg_BQ, ring: SplashRing):
    """Local shards [B, H, T_local, *] (q unscaled) -> o [B, H, T_local, V] fp32; padding rows are not zeroed."""
    return _ring_forward(q_BHQK * jnp.asarray(ring.scale, q_BHQK.dtype), k_BHSK, v_BHSV, seg_BQ, ring)[0]


def _ring_fwd(q, k, v, seg, ring):
    q = q * jnp.asarray(ring.scale, q.dtype)   # splash does not scale q
    o, lse = name_residuals(ring.residual_name, *_ring_forward(q, k, v, seg, ring))
    return o, (q, k, v, seg, o, lse)


def _grads(ring, causal, q, k, v, q_seg, kv_seg, lse, do, di):
    dq, dk, dv = jax.vmap(partial(splash.tile_backward, **ring.tile(causal)))(q, k, v, q_seg, kv_seg, lse, do, di)
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def _step_grads(ring, q, seg, lse, do, di, dq, kv, t):
    """(dq with step t's share added, the block's dK, dV shares) (t >= 1)."""
    k, v, kv_seg = kv
    h = q.shape[2] // 2
    zeros = lambda x, n: jnp.zeros(x.shape[:2] + (n,) + x.shape[3:], jnp.float32)
    if ring.zigzag:
        def early(dq):        # all queries x the block's first chunk: dK / dV of its second chunk are 0
            dq_t, dk_t, dv_t = _grads(ring, False, q, k[:, :, :h], v[:, :, :h], seg, kv_seg[:, :h], lse, do, di)
            pad = lambda d, x: jnp.concatenate([d, zeros(x, h)], axis=2)
            return dq + dq_t, pad(dk_t, k), pad(dv_t, v)

        def late(dq):         # the second local chunk x the whole block
            dq_t, dk_t, dv_t = _grads(ring, False, q[:, :, h:], k, v, seg[:, h:], kv_seg, lse[:, :, h:],
                                      do[:, :, h:], di[:, :, h:])
            return dq.at[:, :, h:].add(dq_t), dk_t, dv_t
    else:
        def early(dq):
            dq_t, dk_t, dv_t = _grads(ring, False, q, k, v, seg, kv_seg, lse, do, di)
            return dq + dq_t, dk_t, dv_t

        late = lambda dq: (dq, zeros(k, k.shape[2]), zeros(v, v.shape[2]))
    with jax.named_scope(STEP_SCOPE):
        return jax.lax.cond(_source(ring, t), early, late, dq)


def _ring_bwd(ring, res, do):
    q, k, v, seg, o, lse = res
    do = do.astype(q.dtype)   # splash's kernels take do in q's dtype; di = sum(o * do) once for every step
    di = jnp.einsum("bhqv,bhqv->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
    kv = (k, v, seg)
    first = _send(ring, kv) if ring.size > 1 else None
    dq, dk, dv = _grads(ring, True, q, k, v, seg, seg, lse, do, di)   # the local step
    # q was pre-scaled: d/dq = scale x d/d(scale q)
    finish = lambda dq, dk, dv: ((dq * ring.scale).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None)
    if ring.size == 1:
        return finish(dq, dk, dv)

    def body(carry, kv, t):
        dq, dkv = carry
        dq, dk_t, dv_t = _step_grads(ring, q, seg, lse, do, di, dq, kv, t)   # fresh dK/dV: see ring.py
        return dq, _send(ring, (dkv[0] + dk_t, dkv[1] + dv_t))   # after step N-1 the hop brings them home

    dq, dkv = _steps(ring, body, (dq, _send(ring, (dk, dv))), first)
    return finish(dq, *dkv)


splash_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def computed_tiles(ring: SplashRing, length: int, rank):
    """block x block tiles (all rows and heads at once, as ring.py counts them) that device `rank`'s splash
    calls compute over the ring, for `length` local tokens: splash skips what the static masks exclude,
    never a tile by its segment ids."""
    n = length // ring.block
    local = n * (n + 1) // 2
    if ring.zigzag:
        return jnp.int32(local + (ring.size - 1) * n * n // 2)
    return jnp.int32(local) + jnp.int32(n * n) * rank   # contiguous: the r devices before this one
