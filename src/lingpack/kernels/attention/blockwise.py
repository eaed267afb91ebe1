"""The blockwise online-softmax step: the per-block primitive of every context-parallel strategy.

A tile is one query block against one key block. Each side carries its segment ids `[B, n]` and its
token index `[n]`: the token's place in the ORIGINAL row order (not its place in the local array), so
the mask `allowed(...)` stays right when the row is zigzag-reordered or a key block arrived from
another device. Query i may attend key j iff seg_i == seg_j != 0 and (not causal or index_j <= index_i).

Numerics (docs/design.md#blockwise-softmax-attention): m, l, the output accumulator, lse and every gradient
accumulator are fp32 (float64 for float64 inputs: `precision.at_least_fp32`);
masked logits are the finite MASK_VALUE and masked probabilities are exactly 0, so a query with no
visible key (padding, or a document whose keys live elsewhere) keeps l = 0, outputs 0 through a
guarded 1/l and gets lse = 0 (unused: all its probabilities are masked). No `-inf - -inf` anywhere.

`forward_tiles` / `backward_tiles` run all tiles of a query range against a key range, skipping a tile
whose ranges prove it fully masked (`tile_visible`); `blockwise_attention` wraps them in a custom VJP
that recomputes probabilities from the saved lse (the local kernel of all_gather and Ulysses).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lingpack.kernels.attention.masks import MASK_VALUE, allowed
from lingpack.precision import at_least_fp32


class Tiling(NamedTuple):
    """Static settings of a tiled call (hashable: a custom_vjp non-differentiable argument)."""
    scale: float
    causal: bool
    block_q: int
    block_kv: int
    residual_name: str | None = None   # the forward's (o, lse) named for a remat policy: `name_residuals`


class Softmax(NamedTuple):
    """Running online-softmax state of a query range: fp32 (or float64) max m [B,H,Q], normaliser l [B,H,Q],
    acc [B,H,Q,V]."""
    m: jax.Array
    l: jax.Array
    acc: jax.Array


def init_softmax(B: int, H: int, Q: int, V: int, dtype=jnp.float32) -> Softmax:
    """`dtype`: the accumulation dtype, `at_least_fp32` of the inputs'."""
    # m starts at the finite MASK_VALUE (not -inf): exp(m_old - m_new) is then always finite.
    return Softmax(jnp.full((B, H, Q), MASK_VALUE, dtype), jnp.zeros((B, H, Q), dtype),
                   jnp.zeros((B, H, Q, V), dtype))


def name_residuals(name: str | None, *arrays):
    """The arrays (a softmax's output and logsumexp, as its VJP keeps them) named `name` for a remat policy
    (models/remat.py `tag`'s `<part>/context`): a policy that keeps that name then skips this forward in the
    backward pass. Unchanged when `name` is None."""
    return arrays if name is None else tuple(checkpoint_name(a, name) for a in arrays)


def finalize(state: Softmax) -> tuple[jax.Array, jax.Array]:
    """(o [B,H,Q,V], lse [B,H,Q]) in the state's dtype; empty rows (l == 0) give o = 0 and lse = 0."""
    nonempty = state.l > 0
    safe_l = jnp.where(nonempty, state.l, 1.0)  # guarded 1/l
    return state.acc / safe_l[..., None], jnp.where(nonempty, state.m + jnp.log(safe_l), 0.0)


def tile_visible(q_seg_BQ, kv_seg_BS, q_index_Q, kv_index_S, causal: bool) -> jax.Array:
    """bool scalar, False only when the tile is provably fully masked (a sound, O(Q + S) range test).

    Causal: every key comes after every query. Segments: the nonzero id ranges of the two sides are
    disjoint in every row (disjoint ranges share no id, whatever the order of ids in the row).
    """
    big = jnp.iinfo(jnp.int32).max
    lo = lambda s: jnp.min(jnp.where(s > 0, s, big), axis=1)    # padding (0) takes part in nothing
    hi = lambda s: jnp.max(jnp.where(s > 0, s, 0), axis=1)
    overlap = (lo(q_seg_BQ) <= hi(kv_seg_BS)) & (lo(kv_seg_BS) <= hi(q_seg_BQ))
    visible = jnp.any(overlap)
    if causal:
        visible &= jnp.min(kv_index_S) <= jnp.max(q_index_Q)
    return visible


def _logits(q_BHQK, k_BHSK, q_seg, kv_seg, q_index, kv_index, tiling: Tiling):
    wide = at_least_fp32(q_BHQK.dtype, k_BHSK.dtype)  # logits in fp32 (or wider): see dot_product.py
    s = jnp.einsum("bhqk,bhsk->bhqs", q_BHQK.astype(wide), k_BHSK.astype(wide)) * tiling.scale
    mask = allowed(q_seg, kv_seg, q_index, kv_index, tiling.causal)
    return jnp.where(mask, s, MASK_VALUE), mask


def step_forward(state: Softmax, q_BHQK, k_BHSK, v_BHSV, q_seg, kv_seg, q_index, kv_index, tiling: Tiling) -> Softmax:
    """One online-softmax update of `state` with one key block."""
    s, mask = _logits(q_BHQK, k_BHSK, q_seg, kv_seg, q_index, kv_index, tiling)
    m_new = jnp.maximum(state.m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # masked probabilities are exactly 0
    alpha = jnp.exp(state.m - m_new)                          # <= 1 and finite: both maxima are finite
    acc = alpha[..., None] * state.acc + jnp.einsum("bhqs,bhsv->bhqv", p, v_BHSV.astype(state.acc.dtype))
    return Softmax(m_new, alpha * state.l + p.sum(-1), acc)


def step_backward(q_BHQK, k_BHSK, v_BHSV, do_BHQV, lse_BHQ, delta_BHQ, q_seg, kv_seg, q_index, kv_index,
                  tiling: Tiling):
    """(dq, dk, dv) of one tile in the logits' dtype (fp32 or wider), probabilities recomputed from the saved lse."""
    s, mask = _logits(q_BHQK, k_BHSK, q_seg, kv_seg, q_index, kv_index, tiling)
    p = jnp.where(mask, jnp.exp(s - lse_BHQ[..., None]), 0.0)
    q, k, v = q_BHQK.astype(s.dtype), k_BHSK.astype(s.dtype), v_BHSV.astype(s.dtype)
    dv = jnp.einsum("bhqs,bhqv->bhsv", p, do_BHQV)
    ds = p * (jnp.einsum("bhqv,bhsv->bhqs", do_BHQV, v) - delta_BHQ[..., None])  # softmax Jacobian
    dq = jnp.einsum("bhqs,bhsk->bhqk", ds, k) * tiling.scale
    dk = jnp.einsum("bhqs,bhqk->bhsk", ds, q) * tiling.scale
    return dq, dk, dv


def _block(x, i, block: int, axis: int):
    """Block `i` (length `block`) of `axis`: a dynamic slice, which XLA fuses into its consumer (no copy)."""
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis)


def _put(x, update, i, block: int, axis: int):
    """`x` with block `i` of `axis` replaced by `update` (in place on a loop carry)."""
    return jax.lax.dynamic_update_slice_in_dim(x, update, i * block, axis)


def check_tiling(Q: int, S: int, tiling: Tiling) -> None:
    for name, n, block in (("query", Q, tiling.block_q), ("key", S, tiling.block_kv)):
        if block <= 0 or n % block:
            raise ValueError(f"{name} length {n} must be a positive multiple of its block size {block}; choose a "
                             "block that divides it (model.attention_block_size)")


# The tile loops below index blocks in place (dynamic slices of loop-invariant inputs, dynamic updates of
# loop carries) rather than reshaping the operands into a [blocks, ...] stack for lax.scan: a stack is a
# transposed copy of every operand and of every accumulator, each as large as the operand itself.

def forward_tiles(state: Softmax, q_BHQK, k_BHSK, v_BHSV, q_seg, kv_seg, q_index, kv_index, tiling: Tiling):
    """`state` updated with every visible tile of q x kv -> (state, number of tiles computed)."""
    Q, S = q_BHQK.shape[2], k_BHSK.shape[2]
    check_tiling(Q, S, tiling)
    bq, bk = tiling.block_q, tiling.block_kv

    def one_q_block(i, carry):
        state, count = carry
        q, qs, qi = _block(q_BHQK, i, bq, 2), _block(q_seg, i, bq, 1), _block(q_index, i, bq, 0)

        def one_kv_block(j, carry):
            st, count = carry
            k, v, ks, ki = _block(k_BHSK, j, bk, 2), _block(v_BHSV, j, bk, 2), _block(kv_seg, j, bk, 1), \
                _block(kv_index, j, bk, 0)
            visible = tile_visible(qs, ks, qi, ki, tiling.causal)
            st = jax.lax.cond(visible, lambda: step_forward(st, q, k, v, qs, ks, qi, ki, tiling), lambda: st)
            return st, count + visible.astype(jnp.int32)

        st = Softmax(*(_block(x, i, bq, 2) for x in state))
        st, count = jax.lax.fori_loop(0, S // bk, one_kv_block, (st, count))
        return Softmax(*(_put(x, y, i, bq, 2) for x, y in zip(state, st))), count

    return jax.lax.fori_loop(0, Q // bq, one_q_block, (state, jnp.int32(0)))


def backward_tiles(q_BHQK, k_BHSK, v_BHSV, do_BHQV, lse_BHQ, delta_BHQ, q_seg, kv_seg, q_index, kv_index,
                   tiling: Tiling, dq_BHQK=None, fill: float = 0.0):
    """(dq [B,H,Q,K], dk [B,H,S,K], dv [B,H,S,V]) fp32 (or wider) summed over every visible tile.

    `dq_BHQK`: a dq accumulator to add into (in place; the ring's running dq), else zeros. `fill`: the
    starting value of the dk / dv accumulators, 0.0 or -0.0 (both add exactly: x + -0.0 == x for every x).
    """
    Q, S = q_BHQK.shape[2], k_BHSK.shape[2]
    check_tiling(Q, S, tiling)
    wide = at_least_fp32(q_BHQK.dtype, k_BHSK.dtype)  # gradient accumulators: the logits' dtype
    bq, bk = tiling.block_q, tiling.block_kv

    def one_q_block(i, carry):
        dq_all, dk_all, dv_all = carry
        q, do, lse, delta = (_block(x, i, bq, 2) for x in (q_BHQK, do_BHQV, lse_BHQ, delta_BHQ))
        qs, qi = _block(q_seg, i, bq, 1), _block(q_index, i, bq, 0)

        def one_kv_block(j, carry):
            dq, dk_all, dv_all = carry
            k, v, ks, ki = _block(k_BHSK, j, bk, 2), _block(v_BHSV, j, bk, 2), _block(kv_seg, j, bk, 1), \
                _block(kv_index, j, bk, 0)
            zeros = lambda: (jnp.zeros_like(dq), jnp.zeros(k.shape, wide), jnp.zeros(v.shape, wide))
            grads = lambda: step_backward(q, k, v, do, lse, delta, qs, ks, qi, ki, tiling)
            dq_t, dk_t, dv_t = jax.lax.cond(tile_visible(qs, ks, qi, ki, tiling.causal), grads, zeros)
            dk_all = _put(dk_all, _block(dk_all, j, bk, 2) + dk_t, j, bk, 2)
            dv_all = _put(dv_all, _block(dv_all, j, bk, 2) + dv_t, j, bk, 2)
            return dq + dq_t, dk_all, dv_all

        dq, dk_all, dv_all = jax.lax.fori_loop(0, S // bk, one_kv_block, (_block(dq_all, i, bq, 2), dk_all, dv_all))
        return _put(dq_all, dq, i, bq, 2), dk_all, dv_all

    dq0 = jnp.zeros(q_BHQK.shape, wide) if dq_BHQK is None else dq_BHQK
    init = (dq0, jnp.full(k_BHSK.shape, fill, wide), jnp.full(v_BHSV.shape, fill, wide))
    return jax.lax.fori_loop(0, Q // bq, one_q_block, init)


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def blockwise_attention(q_BHQK, k_BHSK, v_BHSV, q_seg, kv_seg, q_index, kv_index, tiling: Tiling):
    """o [B,H,Q,V] (fp32 or wider) of q attending k/v under the shared mask (see the module docstring)."""
    return _blockwise_forward(q_BHQK, k_BHSK, v_BHSV, q_seg, kv_seg, q_index, kv_index, tiling)[0]


def _blockwise_forward(q, k, v, q_seg, kv_seg, q_index, kv_index, tiling):
    B, H, Q, _ = q.shape
    state = init_softmax(B, H, Q, v.shape[-1], at_least_fp32(q.dtype, k.dtype, v.dtype))
    state, _ = forward_tiles(state, q, k, v, q_seg, kv_seg, q_index, kv_index, tiling)
    return finalize(state)


def _blockwise_fwd(q, k, v, q_seg, kv_seg, q_index, kv_index, tiling):
    o, lse = name_residuals(tiling.residual_name,
                            *_blockwise_forward(q, k, v, q_seg, kv_seg, q_index, kv_index, tiling))
    return o, (q, k, v, q_seg, kv_seg, q_index, kv_index, o, lse)


def _blockwise_bwd(tiling, res, do):
    q, k, v, q_seg, kv_seg, q_index, kv_index, o, lse = res
    do = do.astype(o.dtype)
    delta = jnp.sum(do * o, axis=-1)  # D_i = sum_v dO_iv O_iv, the softmax-Jacobian row term
    dq, dk, dv = backward_tiles(q, k, v, do, lse, delta, q_seg, kv_seg, q_index, kv_index, tiling)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


blockwise_attention.defvjp(_blockwise_fwd, _blockwise_bwd)
