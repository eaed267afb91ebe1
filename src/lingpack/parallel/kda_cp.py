"""KDA context parallelism: exact state passing over the `context` mesh axis (docs/design.md#context-parallelism).

Every device holds one block of each row (two under zigzag: global chunks r and 2N-1-r, see reorder.py).
The KDA update is affine in the incoming state, so a block is summarised by
    S_out = M S_in + S0        M [H, K, K]: the transition the incoming state goes through
                               S0 [H, K, V]: the block's final state from a zero incoming state
and a token of the block's first document reads o_t = o0_t + S_in^T P_t with P_t = scale * M_t^T q_t
(M_t: the transition up to t). One kernel call per block yields all four: run `chunk_kda` on values
augmented with K zero columns, [v | 0], from the initial state [0 | I]; by linearity of the recurrence
in (state, v) its output is [o0 | P] and its final state [S0 | M] (the [0 | I] columns carry the
chunked kernel's WY transition). The kernel resets the state at every document start, so past the
block's first document M = 0 and P = 0 exactly: the incoming state reaches only that document.

Composition: the summaries [S0 | M] and each block's first / last segment id are all-gathered over
`context` (one fp32 all-gather of B x H x K x (V+K) per block, the LASP-2 pattern, and one of 2 int32
ids) and every device folds them in sequence order, S <- M_b (S if block b continues the previous
block's last document else 0) + S0_b, so a document boundary at a block boundary cuts the dependence too.
An all-gather rather than a log2(N) ppermute scan: one collective instead of log2(N) + 1 dependent ones.
The scan moves fewer bytes and chains fewer matmuls (0.2x the fold's time on fake CPU devices, where
collectives are memcpys: docs/parallelism.md#the-whole-model-under-cp-memory-and-collectives): worth
measuring on real hardware.
Gradients (q, k, v, g, beta, the gate parameters, the initial state) come from autodiff through the
kernel, the fold and the all-gather (whose transpose is a reduce-scatter): exact, tested against one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lingpack.kernels.kda.api import chunk_kda
from lingpack.parallel import reorder
from lingpack.parallel.context import dividing_axes
from lingpack.precision import at_least_fp32

HIGHEST = jax.lax.Precision.HIGHEST  # the fold chains N state products: keep them fp32-exact on TPU too
ARRAY_KWARGS = ("A_log", "dt_bias")  # kernel keyword arguments that are arrays (replicated parameters)


def _blocks(x, nb):
    """[B, Tl, ...] -> [nb * B, Tl / nb, ...], block-major (this device's blocks stacked as rows)."""
    B, Tl = x.shape[:2]
    return jnp.moveaxis(x.reshape(B, nb, Tl // nb, *x.shape[2:]), 1, 0).reshape(nb * B, Tl // nb, *x.shape[2:])


def _unblocks(x, nb):
    B = x.shape[0] // nb
    return jnp.moveaxis(x.reshape(nb, B, *x.shape[1:]), 0, 1).reshape(B, -1, *x.shape[2:])


def _sequence_order(gathered, nb):
    """[N, nb, ...] gathered per device -> [nb * N, ...] in sequence order of the blocks."""
    if nb == 1:
        return gathered[:, 0]
    return jnp.concatenate([gathered[:, 0], gathered[::-1, 1]])  # zigzag: block b >= N lives on device 2N-1-b


def _fold(seq, initial_state_BHKV):
    """States entering each block [nblocks, B, H, K, V] and the row's final state, from the summaries."""
    def step(carry, blk):
        state, prev_last = carry
        # padding blocks (first id 0) pass the state through (M = I, S0 = 0); a new document cuts it
        cont = (blk["first"] == prev_last) | (blk["first"] == 0)
        state_in = jnp.where(cont[:, None, None, None], state, 0.0)
        state_out = jnp.einsum("bhij,bhjv->bhiv", blk["M"], state_in, precision=HIGHEST) + blk["S0"]
        return (state_out, jnp.where(blk["last"] == 0, prev_last, blk["last"])), state_in

    (final, _), entering = jax.lax.scan(step, (initial_state_BHKV, seq["first"][0]), seq)
    return entering, final


def kda_context_shard(q, k, v, g, beta, segment_ids, *, axis_name: str = "context", load_balance: bool = False,
                      initial_state=None, **kernel_kwargs):
    """Call inside `shard_map`: this device's tokens of each row, `[B, Tl, H, *]` in the layout of reorder.py
    (zigzag when `load_balance`) -> (o [B, Tl, H, V] in v's dtype, final state [B, H, K, V] fp32 (or wider) of
    each whole row, the same on every device). `initial_state` [B, H, K, V] seeds each row's first document;
    `kernel_kwargs` go to `chunk_kda` (impl, chunk_size, gate / L2-norm fusion, ...).
    """
    B, Tl, H, K = q.shape
    V = v.shape[-1]
    nb = 2 if load_balance else 1
    if Tl % nb:
        raise ValueError(f"zigzag needs an even number of tokens per device; got {Tl} (pad rows to 2 x context)")
    n = jax.lax.axis_size(axis_name)
    f32, out_dtype = at_least_fp32(q.dtype, k.dtype, v.dtype, g.dtype), v.dtype
    # fp32 (or float64) in: the kernel computes in it anyway, and P (the read-out of the incoming state) must not
    # be rounded
    q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
    v_aug = jnp.concatenate([v, jnp.zeros((B, Tl, H, K), f32)], axis=-1)
    init_aug = jnp.broadcast_to(jnp.concatenate([jnp.zeros((K, V), f32), jnp.eye(K, dtype=f32)], axis=-1),
                                (nb * B, H, K, V + K))
    seg_blocks = _blocks(segment_ids.astype(jnp.int32), nb)
    o_aug, final_aug = chunk_kda(_blocks(q, nb), _blocks(k, nb), _blocks(v_aug, nb), _blocks(g, nb),
                                 _blocks(beta, nb), segment_ids=seg_blocks, initial_state=init_aug,
                                 output_final_state=True, **kernel_kwargs)
    per_block = lambda x: x.reshape(nb, B, *x.shape[1:])
    # two all-gathers: the fp32 (or float64) [S0 | M] as the kernel returned it, and each block's first / last
    # segment id
    ends = jnp.stack([seg_blocks[:, 0], jnp.max(seg_blocks, axis=1)], axis=-1)
    state, ends = (_sequence_order(jax.lax.all_gather(per_block(x), axis_name), nb) for x in (final_aug, ends))
    seq = dict(S0=state[..., :V], M=state[..., V:], first=ends[..., 0], last=ends[..., 1])
    if initial_state is None:
        initial_state = jnp.zeros((B, H, K, V), f32)
    entering, final = _fold(seq, initial_state.astype(f32))
    rank = jax.lax.axis_index(axis_name)
    mine = jnp.stack([jnp.asarray(c) for c in reorder.local_chunks(rank, n, load_balance)])
    state_in = jnp.take(entering, mine, axis=0).reshape(nb * B, H, K, V)
    o = o_aug[..., :V] + jnp.einsum("bthk,bhkv->bthv", o_aug[..., V:], state_in, precision=HIGHEST)
    return _unblocks(o, nb).astype(out_dtype), final


def chunk_kda_context_parallel(q, k, v, g, beta, *, segment_ids, mesh, axis_name: str = "context",
                               load_balance: bool = False, batch_axes=(), head_axes=(), initial_state=None,
                               output_final_state: bool = False, **kernel_kwargs):
    """`chunk_kda` on global `[B, T, ...]` arrays whose T axis is split over `axis_name` of `mesh` (already in
    the zigzag order of `reorder.reorder_batch` when `load_balance`). Rows go over the `batch_axes` and heads
    over the `head_axes` whose sizes divide them. Returns (o [B, T, H, V], final state or None) with
    chunk_kda's semantics for the unsplit rows.
    """
    n = mesh.shape[axis_name]
    reorder.check_length(q.shape[1], n, load_balance)
    arrays = {name: kernel_kwargs.pop(name) for name in ARRAY_KWARGS if kernel_kwargs.get(name) is not None}
    batch, heads = dividing_axes(mesh, batch_axes, q.shape[0]), dividing_axes(mesh, head_axes, q.shape[2])
    tok = P(batch, axis_name)
    # A_log [H] and dt_bias [H*K] (head-major) split with the heads
    specs = (P(*tok, heads, None),) * 4 + (P(*tok, heads), tok, P(batch, heads), {name: P(heads) for name in arrays})
    if initial_state is None:
        initial_state = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), at_least_fp32(q.dtype, v.dtype))

    def body(q, k, v, g, beta, seg, h0, arrays):
        return kda_context_shard(q, k, v, g, beta, seg, axis_name=axis_name, load_balance=load_balance,
                                 initial_state=h0, **kernel_kwargs, **arrays)

    o, final = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(*tok, heads, None), P(batch, heads)),
                             check_vma=False)(q, k, v, g, beta, segment_ids, initial_state, arrays)
    return o, (final if output_final_state else None)
