"""The output head and its cross-entropy: whole-vocabulary logits, or one vocabulary chunk at a time.

The model returns each head (the main one and each MTP depth's) unevaluated, as an `LMHead`: the
final-normed hidden state and the head weight, both fp32 (float64 for a float64 model). The loss asks it for `xent(targets)`:

* `chunk = 0`: `logits()` ([B, T, V] fp32 through `head_matmul`), then logsumexp and the target's logit.
* `chunk = C`: one scan over ceil(V / C) column chunks with an online logsumexp (running max m, running
  sum s of exp(logit - m)); the custom VJP recomputes each chunk's logits from the saved (h, w, lse) and
  forms dlogits = (g_xent + g_lse) softmax - g_xent onehot(target) chunk by chunk. Forward and backward
  hold [B*T, C] logits at a time, never [B, T, V]: at V=157184 the whole-vocabulary logits and their
  gradient are the largest arrays of a step. The chunks are ceil(V / C) of equal width (`chunk_width`: at most
  C, a multiple of 128 where that fits); when they do not tile V exactly the last starts at V - width and
  skips the columns its predecessor counted, so no weight is padded or copied and fewer than 128 columns a
  chunk are computed twice (at V = 157184, C = 16384: 10 chunks of 15744, 256 columns, 0.16%).

* `fused_rows = R` (training): `fused_objective` takes the loss's per-token weights and returns the weighted
  sum itself, R rows at a time over the whole vocabulary, forming each row block's logit gradient, dh and
  dw in the forward (Liger-Kernel's fused linear cross-entropy, linkedin/Liger-Kernel:
  src/liger_kernel/ops/fused_linear_cross_entropy.py). The backward only scales them by the objective's
  cotangent: three matmuls of the head's size where the vocabulary chunks run four (their backward
  recomputes the logits). The heads (main and MTP) share one weight and run as one stack of rows.

Under an activation layout (parallel/layout.py) the chunked cross-entropy runs per device in a shard_map:
rows over the token axes, the vocabulary over the `vocab` rule's axes (Megatron's vocab-parallel
cross-entropy: per-device max, sum and target logit combined by pmax / psum; only [B, T] statistics
cross devices).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from lingpack.parallel.layout import axis_tuple, constrain, current_layout
from lingpack.precision import at_least_fp32

LOGITS = ("batch", "length", "vocab")


@jax.custom_vjp
def head_matmul(h_BTD: jax.Array, w_DV: jax.Array) -> jax.Array:
    """h @ w (any leading axes): the vocab head, whose weight gradient is the step's largest matmul.

    The VJP is autodiff's, except that the weight gradient contracts a materialised h^T [D, B, T] with the
    logit gradient. Left alone, XLA:CPU folds that transpose into the dot and copies the [B, T, V] gradient
    transposed for a slower kernel instead (docs/kernels.md#vocabulary-head). Reverse mode only (no jvp).
    """
    return h_BTD @ w_DV


def _head_matmul_fwd(h_BTD, w_DV):
    return h_BTD @ w_DV, (h_BTD, w_DV)


def _head_matmul_bwd(res, g_BTV):
    h_BTD, w_DV = res
    h_DBT = jax.lax.optimization_barrier(jnp.moveaxis(h_BTD, -1, 0))  # the barrier keeps the transpose a copy
    lead = tuple(range(h_BTD.ndim - 1))
    dw_DV = jax.lax.dot_general(h_DBT, g_BTV, ((tuple(a + 1 for a in lead), lead), ((), ())))
    return g_BTV @ w_DV.T, dw_DV


head_matmul.defvjp(_head_matmul_fwd, _head_matmul_bwd)


def pick(values_BTV: jax.Array, index_BT: jax.Array, offset: int | jax.Array = 0) -> jax.Array:
    """values[b, t, index[b, t] - offset], 0 where the index falls outside [offset, offset + V): a masked sum, not
    a gather, so it stays local to each device whatever the rows' and the vocabulary's sharding (exact: one term)."""
    columns = jnp.arange(values_BTV.shape[-1], dtype=jnp.int32) + offset
    hit = columns == index_BT[..., None].astype(jnp.int32)
    return jnp.sum(jnp.where(hit, values_BTV, 0.0), axis=-1)


def _nan_unless_in_vocab(target_logit, targets, vocab: int):
    """A target outside [0, V) gives a NaN logit (as a gather's out-of-bounds fill), so the step's finiteness
    guard sees bad data instead of a finite loss that trained on nothing."""
    return jnp.where((targets >= 0) & (targets < vocab), target_logit, jnp.nan)


def token_xent(logits_BTV: jax.Array, targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cross-entropy [B,T], logsumexp [B,T]), in fp32 (or float64): log-softmax over a large vocab needs it."""
    logits = logits_BTV.astype(at_least_fp32(logits_BTV.dtype))
    lse_BT = jax.nn.logsumexp(logits, axis=-1)
    target_logit_BT = _nan_unless_in_vocab(pick(logits, targets_BT), targets_BT, logits.shape[-1])
    return lse_BT - target_logit_BT, lse_BT


# ------------------------------------------------------------------------------------------ vocabulary chunks

def _chunk(h_ND, w, i, chunk: int, vocab_axis: int):
    """(logits [N, C] of chunk i, its first column, bool [C]: columns not counted by an earlier chunk)."""
    V = w.shape[vocab_axis]
    start = jnp.minimum(i * chunk, V - chunk)
    w_c = jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=vocab_axis)
    logits = h_ND @ w_c if vocab_axis == 1 else h_ND @ w_c.T
    return logits, start, start + jnp.arange(chunk) >= i * chunk


def _num_chunks(w, chunk: int, vocab_axis: int) -> int:
    return -(-w.shape[vocab_axis] // chunk)


def chunk_width(vocab: int, chunk: int) -> int:
    """Columns per chunk: `vocab` in ceil(vocab / chunk) chunks of equal width, rounded up to the 128-column lane
    width where that stays within `chunk` (the logits tile without padding), never wider than the vocabulary."""
    n = -(-vocab // chunk)
    width = -(-vocab // n)
    lanes = -(-width // 128) * 128
    return min(lanes if lanes <= chunk else width, vocab)


def _offset(axes: tuple, local_vocab: int):
    """Global column of this device's first vocabulary column (0 when the vocabulary is not split)."""
    return jax.lax.axis_index(axes) * local_vocab if axes else 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked_xent(h_ND, w, targets_N, chunk: int, vocab_axis: int, axes: tuple, vocab: int):
    return _chunked_xent_fwd(h_ND, w, targets_N, chunk, vocab_axis, axes, vocab)[0]


def _chunked_xent_fwd(h_ND, w, targets_N, chunk, vocab_axis, axes, vocab):
    N = h_ND.shape[0]
    offset = _offset(axes, w.shape[vocab_axis])

    def body(carry, i):
        m_N, s_N, target_N = carry
        logits, start, valid = _chunk(h_ND, w, i, chunk, vocab_axis)
        masked = jnp.where(valid, logits, -jnp.inf)          # exp(-inf - m) = 0: a column counted once
        m_new = jnp.maximum(m_N, jnp.max(masked, axis=-1))    # chunk 0 is all valid: m is finite from then on
        s_N = s_N * jnp.exp(m_N - m_new) + jnp.sum(jnp.exp(masked - m_new[:, None]), axis=-1)
        target_N = target_N + pick(jnp.where(valid, logits, 0.0), targets_N, offset + start)
        return (m_new, s_N, target_N), None

    acc = h_ND.dtype   # the head's dtype (fp32, or float64): the statistics accumulate in it
    init = (jnp.full((N,), -jnp.inf, acc), jnp.zeros((N,), acc), jnp.zeros((N,), acc))
    (m_N, s_N, target_N), _ = jax.lax.scan(body, init, jnp.arange(_num_chunks(w, chunk, vocab_axis)))
    if axes:   # the vocabulary split over devices: combine the per-device max, sum and target logit
        m_all = jax.lax.pmax(m_N, axes)
        s_N = jax.lax.psum(s_N * jnp.exp(m_N - m_all), axes)
        m_N, target_N = m_all, jax.lax.psum(target_N, axes)
    lse_N = m_N + jnp.log(s_N)
    target_N = _nan_unless_in_vocab(target_N, targets_N, vocab)
    return (lse_N - target_N, lse_N), (h_ND, w, targets_N, lse_N)


def _chunked_xent_bwd(chunk, vocab_axis, axes, vocab, res, g):
    h_ND, w, targets_N, lse_N = res
    g_xent_N, g_lse_N = g
    if axes:   # shard_map hands each vocabulary shard 1/n of a replicated output's cotangent: whole again
        g_xent_N, g_lse_N = jax.lax.psum(g_xent_N, axes), jax.lax.psum(g_lse_N, axes)
    offset = _offset(axes, w.shape[vocab_axis])
    h_DN = jax.lax.optimization_barrier(h_ND.T)  # one materialised transpose for every chunk's weight gradient

    def body(carry, i):
        dh_ND, dw = carry
        logits, start, valid = _chunk(h_ND, w, i, chunk, vocab_axis)
        p = jnp.where(valid, jnp.exp(logits - lse_N[:, None]), 0.0)   # softmax of this chunk's columns
        hit = (start + jnp.arange(chunk) + offset == targets_N[:, None]) & valid
        g_logits = (g_xent_N + g_lse_N)[:, None] * p - jnp.where(hit, g_xent_N[:, None], 0.0)
        w_c = jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=vocab_axis)
        if vocab_axis == 1:
            dh_ND = dh_ND + g_logits @ w_c.T
            dw_c = h_DN @ g_logits
        else:
            dh_ND = dh_ND + g_logits @ w_c
            dw_c = g_logits.T @ h_ND
        # add, not overwrite: the last chunk may overlap its predecessor (its skipped columns add zeros)
        dw = jax.lax.dynamic_update_slice_in_dim(
            dw, jax.lax.dynamic_slice_in_dim(dw, start, chunk, axis=vocab_axis) + dw_c, start, axis=vocab_axis)
        return (dh_ND, dw), None

    init = (jnp.zeros(h_ND.shape, h_ND.dtype), jnp.zeros(w.shape, w.dtype))   # fp32 (float64) accumulators
    (dh_ND, dw), _ = jax.lax.scan(body, init, jnp.arange(_num_chunks(w, chunk, vocab_axis)))
    return dh_ND.astype(h_ND.dtype), dw.astype(w.dtype), None


_chunked_xent.defvjp(_chunked_xent_fwd, _chunked_xent_bwd)


def _vocab_split(layout, w, vocab_axis: int, rows: tuple):
    """(rows' PartitionSpec, w's, the mesh axes splitting the vocabulary, local vocabulary size) under `layout`."""
    tokens = layout.spec(("batch", "length"), rows)
    w_logical = ("vocab", None) if vocab_axis == 0 else (None, "vocab")
    w_spec = layout.spec(w_logical, w.shape)           # the model width enters whole (an FSDP gather)
    token_axes = {a for entry in tokens for a in axis_tuple(entry)}
    axes = axis_tuple(w_spec[vocab_axis])
    if token_axes & set(axes):   # a mesh axis splitting both rows and vocabulary: the vocabulary enters whole
        w_spec, axes = P(), ()
    return tokens, w_spec, axes, w.shape[vocab_axis] // math.prod(layout.mesh.shape[a] for a in axes)


def chunked_xent(h_BTD: jax.Array, w: jax.Array, targets_BT: jax.Array, *, chunk: int, vocab_axis: int = 1):
    """(cross-entropy, logsumexp) [B, T] fp32 of the logits h @ w (w [D, V]; or h @ w.T for a [V, D] table,
    `vocab_axis=0`), computed `chunk` vocabulary columns at a time (see the module docstring)."""
    B, T, D = h_BTD.shape
    V = w.shape[vocab_axis]
    layout = current_layout()
    if layout is None:
        xent, lse = _chunked_xent(h_BTD.reshape(B * T, D), w, targets_BT.reshape(-1), chunk_width(V, chunk),
                                  vocab_axis, (), V)
        return xent.reshape(B, T), lse.reshape(B, T)
    tokens, w_spec, axes, local_vocab = _vocab_split(layout, w, vocab_axis, (B, T))

    def local(h, w, t):
        b, t_len = t.shape
        xent, lse = _chunked_xent(h.reshape(b * t_len, D), w, t.reshape(-1), chunk_width(local_vocab, chunk),
                                  vocab_axis, axes, V)
        return xent.reshape(b, t_len), lse.reshape(b, t_len)

    return jax.shard_map(local, mesh=layout.mesh, in_specs=(P(*tokens, None), w_spec, tokens),
                         out_specs=(tokens, tokens), check_vma=False)(h_BTD, w, targets_BT)


# ------------------------------------------------------------------------ gradient in the forward (fused)

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused_xent(h_ND, w, targets_N, cx_N, cz_N, rows: int, vocab_axis: int, axes: tuple, vocab: int):
    return _fused_xent_fwd(h_ND, w, targets_N, cx_N, cz_N, rows, vocab_axis, axes, vocab)[0]


def _fused_xent_fwd(h_ND, w, targets_N, cx_N, cz_N, rows, vocab_axis, axes, vocab):
    """sum_n cx[n] xent[n] + cz[n] lse[n]^2 over this device's rows, with xent and lse [N]; residuals: the
    gradients of that sum (dh [N, D], this device's dw), formed block by block of `rows` rows."""
    N, D = h_ND.shape
    pad = -N % rows
    h_RD, t_R, cx_R, cz_R = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (h_ND, targets_N, cx_N, cz_N))
    offset = _offset(axes, w.shape[vocab_axis])
    columns = jnp.arange(w.shape[vocab_axis], dtype=jnp.int32) + offset

    def body(dw, i):
        h_c, t_c, cx_c, cz_c = (jax.lax.dynamic_slice_in_dim(a, i * rows, rows) for a in (h_RD, t_R, cx_R, cz_R))
        logits = h_c @ w if vocab_axis == 1 else h_c @ w.T                  # [rows, V] in w's dtype
        m = jnp.max(logits, axis=-1)
        if axes:
            m = jax.lax.pmax(m, axes)
        s = jnp.sum(jnp.exp(logits - m[:, None]), axis=-1)
        target = pick(logits, t_c, offset)
        if axes:   # the vocabulary split over devices: each row's sum and target logit whole
            s, target = jax.lax.psum(s, axes), jax.lax.psum(target, axes)
        lse = m + jnp.log(s)
        hit = columns == t_c[:, None].astype(jnp.int32)
        # d(cx xent + cz lse^2)/dlogits = (cx + 2 cz lse) softmax - cx onehot(target)
        g = (cx_c + 2.0 * cz_c * lse)[:, None] * jnp.exp(logits - lse[:, None]) - jnp.where(hit, cx_c[:, None], 0.0)
        if vocab_axis == 1:
            dh_c, dw = g @ w.T, dw + h_c.T @ g
        else:
            dh_c, dw = g @ w, dw + g.T @ h_c
        return dw, (dh_c, lse - target, lse)

    dw, (dh, xent, lse) = jax.lax.scan(body, jnp.zeros(w.shape, w.dtype), jnp.arange((N + pad) // rows))
    dh_ND, xent_N, lse_N = dh.reshape(-1, D)[:N], xent.reshape(-1)[:N], lse.reshape(-1)[:N]
    xent_N = _nan_unless_in_vocab(xent_N, targets_N, vocab)
    total = jnp.sum(cx_N * xent_N + cz_N * lse_N ** 2)
    return (total, xent_N, lse_N), (dh_ND, dw)


def _fused_xent_bwd(rows, vocab_axis, axes, vocab, res, g):
    dh_ND, dw = res
    g_total = g[0]   # xent and lse leave `fused_objective` without a gradient (stop_gradient)
    if axes:   # shard_map hands each vocabulary shard 1/n of a replicated output's cotangent: whole again
        g_total = jax.lax.psum(g_total, axes)
    return (g_total * dh_ND).astype(dh_ND.dtype), (g_total * dw).astype(dw.dtype), None, None, None


_fused_xent.defvjp(_fused_xent_fwd, _fused_xent_bwd)


def fused_objective(heads: list, targets: list, cx: list, cz: list) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum over heads and tokens of cx xent + cz lse^2, xent [H, B, T], lse [H, B, T]) for heads sharing one
    weight (the main head and each MTP depth's, `Ling3.head`), each with its targets and per-token weights
    cx, cz [B, T]: the loss's derivative of its objective in each token's cross-entropy and squared
    logsumexp (data: masks over counts, no gradient flows into them). Only the sum is differentiable; its
    gradient is formed in the forward, `heads[0].fused_rows` rows at a time (the module docstring)."""
    with jax.named_scope("head_xent"):   # the planner's name for the head's matmuls in the loss (plan/cost.py)
        return _fused_objective(heads, targets, cx, cz)


def _fused_objective(heads, targets, cx, cz):
    head = heads[0]
    w, vocab_axis, rows = head.w, head.vocab_axis, head.fused_rows
    if any(hd.w.shape != w.shape or hd.vocab_axis != vocab_axis for hd in heads):
        raise ValueError(f"fused_objective: the heads must share one weight; got {[hd.w.shape for hd in heads]} "
                         f"with vocab axes {[hd.vocab_axis for hd in heads]}")
    h_HBTD = jnp.stack([hd.h_BTD for hd in heads])
    t_HBT, cx_HBT, cz_HBT = (jnp.stack(a).astype(dt) for a, dt in ((targets, jnp.int32), (cx, w.dtype), (cz, w.dtype)))
    H, B, T, D = h_HBTD.shape
    V = w.shape[vocab_axis]
    layout = current_layout()
    if layout is None:
        total, xent, lse = _fused_xent(h_HBTD.reshape(-1, D), w, t_HBT.reshape(-1), cx_HBT.reshape(-1),
                                       cz_HBT.reshape(-1), rows, vocab_axis, (), V)
        return total, *(jax.lax.stop_gradient(a.reshape(H, B, T)) for a in (xent, lse))
    tokens, w_spec, axes, _ = _vocab_split(layout, w, vocab_axis, (B, T))
    token_axes = tuple(a for entry in tokens for a in axis_tuple(entry))

    def local(h, w, t, cx, cz):
        shape = t.shape
        total, xent, lse = _fused_xent(h.reshape(-1, D), w, t.reshape(-1), cx.reshape(-1), cz.reshape(-1), rows,
                                       vocab_axis, axes, V)
        return total[None], xent.reshape(shape), lse.reshape(shape)

    rows_spec = P(None, *tokens)
    totals, xent, lse = jax.shard_map(
        local, mesh=layout.mesh, in_specs=(P(None, *tokens, None), w_spec, rows_spec, rows_spec, rows_spec),
        out_specs=(P(token_axes or None), rows_spec, rows_spec), check_vma=False)(h_HBTD, w, t_HBT, cx_HBT, cz_HBT)
    return jnp.sum(totals), jax.lax.stop_gradient(xent), jax.lax.stop_gradient(lse)


@struct.dataclass
class LMHead:
    """One output head, unevaluated: logits = h @ w, cross-entropy whole or per vocabulary chunk."""
    h_BTD: jax.Array                                          # final-normed hidden state, fp32
    w: jax.Array                                              # fp32 head weight [D, V], or a tied table [V, D]
    vocab_axis: int = struct.field(pytree_node=False, default=1)
    chunk: int = struct.field(pytree_node=False, default=0)   # vocabulary columns per chunk; 0 = whole
    fused_rows: int = struct.field(pytree_node=False, default=0)   # training loss: `fused_objective`'s row block; 0 = off

    def logits(self) -> jax.Array:
        """fp32 [B, T, V] logits (materialised: what `chunk` avoids)."""
        w_DV = self.w if self.vocab_axis == 1 else self.w.T
        return constrain(head_matmul(self.h_BTD, w_DV), LOGITS)

    def xent(self, targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(cross-entropy [B, T], logsumexp [B, T]), fp32, against `targets_BT`."""
        with jax.named_scope("head_xent"):
            if not self.chunk:
                return token_xent(self.logits(), targets_BT)
            return chunked_xent(self.h_BTD, self.w, targets_BT, chunk=self.chunk, vocab_axis=self.vocab_axis)


def xent(logits_or_head, targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`token_xent` of [B, T, V] logits, or an LMHead's own `xent`."""
    if isinstance(logits_or_head, LMHead):
        return logits_or_head.xent(targets_BT)
    return token_xent(logits_or_head, targets_BT)
