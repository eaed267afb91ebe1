"""Neighbour tokens under context parallelism: the short-convolution halo and the MTP roll.

Inside `shard_map` over the `context` axis every device holds one block of each row (two under zigzag:
global chunks r and 2N-1-r, see reorder.py). Code that looks a few tokens back (a causal conv of width
K needs K-1) or ahead (MTP's roll needs 1) runs on each block extended by the neighbour block's tokens
and their segment ids, received by `ppermute`, then drops them again. The receiving code masks by
segment id as it does on one device, so a document boundary at a block boundary still cuts; the row's
first block has no previous tokens and its last no next ones (ids -1: equal to no real or padding id).

Which device holds the neighbour (N devices, rank r):
  contiguous  previous of block r: device r-1;  next: device r+1
  zigzag      previous of chunk r: device r-1's first chunk; of chunk 2N-1-r: device r+1's second chunk,
              or for r = N-1 (chunk N) its own first chunk (chunk N-1)
              next of chunk r: device r+1's first chunk, or for r = N-1 its own second chunk;
              of chunk 2N-1-r: device r-1's second chunk (none for r = 0: the row's end)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lingpack.parallel.context import dividing_axes

NO_SEGMENT = -1  # segment id of tokens beyond the row's ends: matches no document and no padding (0)


def _shift(x, axis_name: str, n: int, step: int):
    """Every device receives x from device rank - step (zeros where there is none)."""
    return jax.lax.ppermute(x, axis_name, [(i, i + step) for i in range(n) if 0 <= i + step < n])


def neighbour_tokens(blocks, *, side: str, width: int, axis_name: str):
    """blocks: a pytree of [nb, B, c, ...] arrays (this device's blocks; nb = 1 contiguous, 2 zigzag) ->
    (the `width` tokens before / after each block in its row, [nb, B, width, ...], bool [nb]: they exist)."""
    nb = jax.tree.leaves(blocks)[0].shape[0]
    n = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    edge = jax.tree.map(lambda a: a[:, :, -width:] if side == "previous" else a[:, :, :width], blocks)
    pick = lambda i: jax.tree.map(lambda a: a[i], edge)
    where = lambda cond, a, b: jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)
    stack = lambda a, b: jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
    toward = 1 if side == "previous" else -1   # contiguous / first chunks: from rank - 1 (previous) or + 1 (next)
    first = _shift(pick(0), axis_name, n, toward)
    if nb == 1:
        return jax.tree.map(lambda a: a[None], first), jnp.stack([rank > 0 if side == "previous" else rank < n - 1])
    second = _shift(pick(1), axis_name, n, -toward)  # second chunks run in the opposite direction
    if side == "previous":   # chunk N (device N-1's second) follows chunk N-1, its own first
        return stack(first, where(rank == n - 1, pick(0), second)), jnp.stack([rank > 0, jnp.bool_(True)])
    first = where(rank == n - 1, pick(1), first)  # chunk N-1's next is chunk N, on the same device
    return stack(first, second), jnp.stack([jnp.bool_(True), rank > 0])


def apply_with_neighbours(fn: Callable, x_BT_, segment_ids_BT, *, side: str, width: int, axis_name: str,
                          load_balance: bool, apart: bool = False):
    """fn(x [rows, c + width, ...], segment_ids [rows, c + width]) -> [rows, c + width, ...], run on each local
    block extended by `width` neighbour tokens on `side` ("previous" or "next"), which are then dropped.
    `apart`: fn(x [rows, c, ...], segment_ids, neighbour x [rows, width, ...], neighbour ids) -> [rows, c, ...]
    gets them apart, so nothing holds a copy of the extended block (the short convolution's case).

    Call inside shard_map; x is this device's [B, Tl, ...] in the layout of reorder.py. Exact whenever fn
    looks at most `width` tokens toward `side` and masks by segment id.
    """
    if side not in ("previous", "next"):
        raise ValueError(f"side must be 'previous' or 'next'; got {side!r}")
    nb = 2 if load_balance else 1
    B, Tl = x_BT_.shape[:2]
    c = Tl // nb
    if Tl % nb or c < width:
        raise ValueError(f"each context-parallel block has {Tl / nb:g} tokens, fewer than the {width} neighbour "
                         "tokens needed (or an odd zigzag split): use longer rows or a smaller parallel.context")
    if width == 0:
        return fn(x_BT_, segment_ids_BT, None, None) if apart else fn(x_BT_, segment_ids_BT)
    blocks = lambda a: jnp.moveaxis(a.reshape(B, nb, c, *a.shape[2:]), 1, 0)   # [nb, B, c, ...]
    xb, sb = blocks(x_BT_), blocks(segment_ids_BT.astype(jnp.int32))
    (nx, ns), valid = neighbour_tokens((xb, sb), side=side, width=width, axis_name=axis_name)
    nx = jnp.where(valid.reshape((nb,) + (1,) * (nx.ndim - 1)), nx, jnp.zeros_like(nx))
    ns = jnp.where(valid[:, None, None], ns, NO_SEGMENT)
    join = (lambda own, extra: jnp.concatenate([extra, own], 2)) if side == "previous" else (
        lambda own, extra: jnp.concatenate([own, extra], 2))
    rows = lambda a: a.reshape(nb * B, *a.shape[2:])
    if apart:
        y = fn(rows(xb), rows(sb), rows(nx), rows(ns))
    else:
        y = fn(rows(join(xb, nx)), rows(join(sb, ns)))
        y = y[:, width:] if side == "previous" else y[:, :c]
    return jnp.moveaxis(y.reshape(nb, B, c, *y.shape[2:]), 0, 1).reshape(B, Tl, *y.shape[2:])


def context_neighbours(fn: Callable, x_BT_, segment_ids_BT, *params, cp, side: str, width: int, apart: bool = False):
    """`apply_with_neighbours` on global [B, T, ...] arrays whose T axis is split over `cp.axis` of `cp.mesh`
    in `cp`'s layout (a parallel.context.ContextParallel: mesh, axis, load_balance, batch_axes);
    fn(x, segment_ids, *params) gets `params` replicated (their gradients are summed)."""
    mesh, axis = cp.mesh, cp.axis
    batch = dividing_axes(mesh, cp.batch_axes, x_BT_.shape[0])
    x_spec = P(batch, axis, *([None] * (x_BT_.ndim - 2)))

    def local(x, seg, *params):
        call = (lambda a, s, na, ns: fn(a, s, na, ns, *params)) if apart else (lambda a, s: fn(a, s, *params))
        return apply_with_neighbours(call, x, seg, side=side, width=width, axis_name=axis,
                                     load_balance=cp.load_balance, apart=apart)
    return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, P(batch, axis)) + (P(),) * len(params),
                         out_specs=x_spec, check_vma=False)(x_BT_, segment_ids_BT, *params)
