"""Pallas TPU kernel for the backward of the segment-masked short convolution (models/layers.py `short_conv`).

XLA's backward (recompute the conv and SiLU' into an fp32 cotangent, then K shifted and masked copies of it and
their products with x summed over tokens) is two fusions over [B, T, C] that XLA:TPU costs at 3.6x their HBM
traffic, vector-bound by its own model (docs/kernels.md, "The short convolution's backward"). This kernel is one
pass: per block of `rows` tokens and `cols` channels it reads x, the output's cotangent and the 8 rows either
side of the block (the halo: taps reach K - 1 < 8 rows across the block's edges), and writes dx and the block's
share of the kernel's gradient, the fp32 cotangent kept in VMEM. Same math as `layers._short_conv_bwd`, in the
same fp32 order per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lingpack.kernels.shard import Dims, over_mesh

BACKWARDS = ("xla", "pallas")   # `kernel.short_conv`: XLA's backward (models/layers.py) or this kernel
HALO = 8                     # rows of each neighbouring block a step reads: one sublane tile, K <= HALO
NO_TOKEN = jnp.iinfo(jnp.int32).min   # segment id of a halo row with no token (before the row, after its end)
ROWS, COLS = 256, 512        # block of tokens x channels (the largest dividing T, C)
f32 = jnp.float32


def supported(T: int, C: int, K: int) -> bool:
    """Whether the kernel takes this shape: whole sublane tiles of tokens, taps within one halo."""
    return T % HALO == 0 and 1 <= K <= HALO


def _block(n: int, most: int, unit: int) -> int:
    """The largest multiple of `unit` up to `most` dividing n; n itself when n is not a multiple of `unit`."""
    if n % unit:
        return n
    return max(b for b in range(unit, min(n, most) + 1, unit) if n % b == 0)


def _kernel(x_ref, xp_ref, xn_ref, d_ref, dn_ref, id_ref, idp_ref, idn_ref, w_ref, dx_ref, dw_ref, dxp_ref,
            xs, ids, gs, *, K: int, silu: bool, x_dtype):
    rows, first = x_ref.shape[0], pl.program_id(1) == 0
    n = rows + HALO                                   # the block's rows and the next block's first HALO rows
    # x and segment ids with their halos, rows [prev HALO | block | next HALO]
    xs[:HALO], xs[HALO:HALO + rows], xs[HALO + rows:] = (r[...].astype(f32) for r in (xp_ref, x_ref, xn_ref))
    ids[:HALO], ids[HALO:HALO + rows], ids[HALO + rows:] = idp_ref[...], id_ref[...], idn_ref[...]
    w = w_ref[...].astype(f32)                                                     # [K, cols]
    tap = lambda lag, start, size: jnp.where(ids[pl.ds(start - lag, size)] == ids[pl.ds(start, size)],
                                             xs[pl.ds(start - lag, size)], 0.0)
    # the forward's output at the n rows, accumulated in fp32 in the forward's tap order, rounded as it was
    y = jnp.zeros((n, w.shape[1]), f32)
    for lag in range(K):
        y = y + tap(lag, HALO, n) * w[K - 1 - lag:K - lag]
    y = y.astype(x_dtype).astype(f32)
    d = jnp.concatenate([d_ref[...].astype(f32), dn_ref[...].astype(f32)], axis=0)
    if silu:   # silu'(y) = s (1 + y (1 - s)), s = sigmoid(y)
        s = jax.nn.sigmoid(y)
        d = d * s * (1 + y * (1 - s))
    # the conv's input cotangent g, rows [prev HALO (none here: zero) | block | next HALO | spare HALO]
    gs[:HALO], gs[HALO:HALO + n], gs[HALO + n:] = jnp.zeros((HALO, d.shape[1]), f32), d, jnp.zeros_like(d[:HALO])
    ahead = lambda lag, start, size: jnp.where(ids[pl.ds(start + lag, size)] == ids[pl.ds(start, size)],
                                               gs[pl.ds(start + lag, size)], 0.0)
    # tap `lag` sent x[t - lag] to y[t]: dx[s] = sum_lag w[K-1-lag] g[s + lag] over s + lag in s's segment
    dx = sum(ahead(lag, HALO, rows) * w[K - 1 - lag:K - lag] for lag in range(K))
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dxp_ref[...] = sum(ahead(lag, 0, HALO) * w[K - 1 - lag:K - lag] for lag in range(1, K))
    # kernel[K-1-lag]'s gradient: sum_s g[s + lag] x[s] over the block's rows, and on the first block also over
    # the previous HALO rows (a context-parallel halo's tokens; other blocks' are the previous block's rows)
    row = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    own = (row >= HALO) | first
    dw = jnp.zeros(dw_ref.shape, f32)
    out_row = jax.lax.broadcasted_iota(jnp.int32, dw.shape, 0)
    for lag in range(K):
        part = jnp.sum(jnp.where(own, ahead(lag, 0, n) * xs[pl.ds(0, n)], 0.0), axis=0, keepdims=True)
        dw = jnp.where(out_row == K - 1 - lag, part, dw)
    dw_ref[...] = dw


def _halos(a_BTX, nT: int, before, after):
    """a's HALO rows before and after each of the nT blocks: [B, nT, HALO, ...], `before` / `after` at the ends."""
    B, T = a_BTX.shape[:2]
    blocks = a_BTX.reshape(B, nT, T // nT, *a_BTX.shape[2:])
    prev = jnp.concatenate([before[:, None], blocks[:, :-1, -HALO:]], axis=1)
    nxt = jnp.concatenate([blocks[:, 1:, :HALO], after[:, None]], axis=1)
    return prev, nxt


@functools.partial(jax.jit, static_argnames=("silu", "interpret", "rows", "cols"))
def short_conv_bwd(x_BTC, kernel_KC, segment_ids_BT, d_out_BTC, prev_x_BWC=None, prev_ids_BW=None, *,
                   silu: bool, interpret: bool = False, rows: int | None = None, cols: int | None = None):
    """(dx [B, T, C] in x's dtype, d_kernel [K, C] fp32, d_prev [B, W, C] fp32 or None) of `short_conv` at these
    inputs and the cotangent of its output. `prev_x` / `prev_ids`: the W = K - 1 tokens before the block (context
    parallelism), else the row starts here. `rows` / `cols` override the block shape (tests). On a mesh the
    kernel runs per shard of rows and channels (`kernels/shard.py`); the kernel gradient's per-block partial
    sums are added here, across shards too."""
    T, K = x_BTC.shape[1], kernel_KC.shape[0]
    if not supported(T, x_BTC.shape[2], K):
        raise ValueError(f"short_conv_bwd needs T % {HALO} == 0 and K <= {HALO}; got T={T}, K={K}")
    dx, dw, dxp = _per_shard(x_BTC, kernel_KC, d_out_BTC, segment_ids_BT=segment_ids_BT, prev_x_BWC=prev_x_BWC,
                             prev_ids_BW=prev_ids_BW, silu=silu, interpret=interpret, rows=rows, cols=cols)
    d_kernel = jnp.sum(dw[:, :, :K], axis=(0, 1))
    d_prev = None if prev_x_BWC is None else dxp[:, 0, HALO - prev_x_BWC.shape[1]:]
    return dx, d_kernel, d_prev


ROWS_CHANNELS = Dims(rows=0, heads=2)   # x, the cotangent, dx [B, T, C]; C is head-major (H * head_dim)
BLOCKS = Dims(rows=0, heads=3)          # per-block partials [B, nT, HALO, C]


@over_mesh(args=(ROWS_CHANNELS, Dims(heads=1), ROWS_CHANNELS),
           kwargs={"segment_ids_BT": Dims(rows=0), "prev_x_BWC": ROWS_CHANNELS, "prev_ids_BW": Dims(rows=0)},
           out=(ROWS_CHANNELS, BLOCKS, BLOCKS), kernel="the Pallas short-conv backward")
def _per_shard(x_BTC, kernel_KC, d_out_BTC, *, segment_ids_BT, prev_x_BWC, prev_ids_BW, silu, interpret, rows,
               cols):
    """(dx, the kernel gradient's and the halo's per-block partials [B, nT, HALO, C]) of one shard's rows."""
    B, T, C = x_BTC.shape
    K = kernel_KC.shape[0]
    rows = rows or _block(T, ROWS, HALO)
    cols = cols or _block(C, COLS, 128)
    nT, nC = T // rows, C // cols
    ids = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT.astype(jnp.int32)
    none_x, none_ids = jnp.zeros((B, HALO, C), x_BTC.dtype), jnp.full((B, HALO), NO_TOKEN, jnp.int32)
    before_x, before_ids = none_x, none_ids
    if prev_x_BWC is not None:   # the halo's W rows end the HALO rows before the first block
        W = prev_x_BWC.shape[1]
        before_x = before_x.at[:, HALO - W:].set(prev_x_BWC.astype(x_BTC.dtype))
        before_ids = before_ids.at[:, HALO - W:].set(prev_ids_BW.astype(jnp.int32))
    xp, xn = _halos(x_BTC, nT, before_x, none_x)
    _, dn = _halos(d_out_BTC, nT, none_x.astype(d_out_BTC.dtype), none_x.astype(d_out_BTC.dtype))
    idp, idn = _halos(ids[..., None], nT, before_ids[..., None], none_ids[..., None])
    big = pl.BlockSpec((None, rows, cols), lambda b, i, c: (b, i, c))
    halo = pl.BlockSpec((None, None, HALO, cols), lambda b, i, c: (b, i, 0, c))
    big_ids = pl.BlockSpec((None, rows, 1), lambda b, i, c: (b, i, 0))
    halo_ids = pl.BlockSpec((None, None, HALO, 1), lambda b, i, c: (b, i, 0, 0))
    weights = pl.BlockSpec((K, cols), lambda b, i, c: (0, c))
    itemsize = x_BTC.dtype.itemsize
    # per element: the conv's K taps, SiLU', dx's K taps, the kernel gradient's K products and sums (vector ops);
    # bytes: x and the cotangent read, dx written, ids once per channel block, the halos and per-block partials
    cost = pl.CostEstimate(flops=(8 * K + 12) * B * T * C, transcendentals=B * T * C if silu else 0,
                           bytes_accessed=3 * B * T * C * itemsize + B * T * 4 * nC
                           + B * nT * HALO * C * (3 * itemsize + 2 * 4))
    dx, dw, dxp = pl.pallas_call(
        functools.partial(_kernel, K=K, silu=silu, x_dtype=x_BTC.dtype),
        grid=(B, nT, nC),
        in_specs=[big, halo, halo, big, halo, big_ids, halo_ids, halo_ids, weights],
        out_specs=[big, halo, halo],
        out_shape=[jax.ShapeDtypeStruct((B, T, C), x_BTC.dtype), jax.ShapeDtypeStruct((B, nT, HALO, C), f32),
                   jax.ShapeDtypeStruct((B, nT, HALO, C), f32)],
        scratch_shapes=[pltpu.VMEM((rows + 2 * HALO, cols), f32), pltpu.VMEM((rows + 2 * HALO, 1), jnp.int32),
                        pltpu.VMEM((rows + 3 * HALO, cols), f32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3,
                                             vmem_limit_bytes=32 * 2**20),
        cost_estimate=cost, interpret=interpret, name="short_conv_bwd",
    )(x_BTC, xp, xn, d_out_BTC, dn, ids[..., None], idp, idn, kernel_KC)
    return dx, dw, dxp
