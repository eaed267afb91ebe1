"""One KDA chunk, forward and backward, written for the body of a Pallas TPU kernel.

Every function here takes and returns in-kernel values (2-D fp32 arrays of one chunk of one head) and
uses only what Pallas lowers to Mosaic: 2-D matmuls (`dot_general`, some with a transposed operand, which
Mosaic receives as matmul dimension numbers), elementwise ops, `broadcasted_iota` masks, lane/sublane
reductions and `pltpu.roll` along sublanes. No gathers, no dynamic indexing, no cumsum primitive, no
`.T`. Shapes: C tokens (64), K, V head dims; a [1, N] row becomes an [N, 1] column by `row_to_col`.

Forward of a chunk (docs/design.md#chunked-wy-form; `chunked.py` has the same math in XLA):
    G   = Tri g                                   chunk-local cumsum as a matmul with lower-triangular ones
    Aqk = P(q, k)[c,i] = sum_d q_cd k_id e^(G_cd - G_id)   (i <= c, same segment)
    Akk = P(k, k)                                          (i <  c, same segment)
    X   = (I + beta_c Akk)^-1 (recursive block doubling, `unit_lower_inverse`)
    Tm  = X Diag(beta),  W = Tm (k e^G),  U = Tm v
    Vn  = U - Wc S,  O = Qg S + Aqk Vn,  S' = keep e^(G_last) * S + Ko^T Vn
with the segment masks of `ChunkMasks`: Wc, Qg = carry * (W, q e^G) (rows continuing the carried
segment), Ko = inlast * k e^(G_last - G) (rows of the chunk's last segment), keep = the whole chunk
continues the carried segment. The varlen kernel passes no masks (chunks never straddle segments).

Backward of a chunk, given dO and dS' (the gradient of the state leaving the chunk):
    dVn  = Aqk^T dO + Ko dS'                       dS   = Qg^T dO - Wc^T dVn + keep e^(G_last) * dS'
    dQg  = dO S^T,  dAqk = dO Vn^T (masked),  dKo = Vn dS'^T,  dWc = -dVn S^T,  dU = dVn
    dTm  = dW (k e^G)^T + dU v^T,  d(k e^G) = Tm^T dW,  dv = Tm^T dU
    dX   = dTm Diag(beta),  dbeta_i += sum_c dTm_ci X_ci
    dL   = -(X^T dX X^T) on the strictly-lower same-segment entries (d(M^-1) = -M^-1 dM M^-1),
           dbeta_c += sum_i dL_ci Akk_ci,  dAkk = beta_c dL
    a decay product P(x, y) = sum_d x_cd y_id e^(G_cd - G_id) has
           dx = R(dA, y)[c] = sum_i dA_ci y_i e^(G_c - G_i),   dy = R^T(dA, x)[i] = sum_c dA_ci x_c e^(G_c - G_i),
           dG_c += x_c dx_c,  dG_i -= y_i dy_i
    plus the direct terms of Qg, Ko, k e^G and e^(G_last); finally dg = Tri^T dG (reverse cumsum).

Overflow safety: e^(G_c - G_i) is never split as e^(G_c) e^(-G_i). Pairs in different 16-token
sub-blocks are split at the first token n of the row's sub-block, e^(G_c - G_n) e^(G_n - G_i), both
factors <= 1 (g <= 0), which makes them matmuls. Pairs inside a sub-block are formed explicitly, one
sub-diagonal at a time (16 steps), with the exponent masked before exp: exact for any g <= 0. With
`safe_gate` (every g >= -5, Ling3's lower-bound gate) they are split at the sub-block's first token
instead, e^(G_c - G_n) e^(G_n - G_i) with the second factor <= e^(5*15) (fp32 overflows at e^88): one
matmul per product, masked to the sub-block diagonal.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from lingpack.kernels.kda.gate import SAFE_GATE_MIN, SUB_CHUNK

f32 = jnp.float32
SUB = SUB_CHUNK  # sub-block size: pairs inside a sub-block are explicit (SUB steps), across sub-blocks matmuls
# Matmul precision policy. Products whose errors compound stay fp32 at HIGHEST (~6 bf16 MXU passes): the
# chunk cumsum and its reverse (a bf16 operand would round g's partial sums), the WY inverse's block
# doubling and its gradient (errors there grow with each doubling level). Every other product takes
# `bulk` operands: bf16 (one MXU pass, fp32 accumulation) or None = fp32 at HIGHEST.
EXACT = jax.lax.Precision.HIGHEST


def _dot(a, b, contract, bulk):
    if bulk is not None and jnp.dtype(bulk) != f32:
        a, b, precision = a.astype(bulk), b.astype(bulk), jax.lax.Precision.DEFAULT
    else:
        precision = EXACT
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=f32)


def mm(a, b, bulk=None):
    """a @ b, fp32 result; operands rounded to `bulk` (None: fp32 at HIGHEST)."""
    return _dot(a, b, ((1,), (0,)), bulk)


def mm_nt(a, b, bulk=None):
    """a @ b^T (contract the last dims), fp32 result."""
    return _dot(a, b, ((1,), (1,)), bulk)


def mm_tn(a, b, bulk=None):
    """a^T @ b (contract the first dims), fp32 result."""
    return _dot(a, b, ((0,), (0,)), bulk)


def iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def row_to_col(row):
    """[1, N] -> [N, 1] without a transpose: keep the diagonal of the broadcast, reduce over lanes."""
    n = row.shape[1]
    eye = iota((n, n), 0) == iota((n, n), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(row, (n, n)), 0.0), axis=1, keepdims=True)


def col_to_row(col):
    """[N, 1] -> [1, N], the same trick reduced over sublanes."""
    n = col.shape[0]
    eye = iota((n, n), 0) == iota((n, n), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(col, (n, n)), 0.0), axis=0, keepdims=True)


def roll_rows(x, shift):
    """Row r of the result is row (r - shift) mod C of x (jnp.roll semantics; Mosaic's sublane rotate)."""
    shift %= x.shape[0]
    return x if shift == 0 else pltpu.roll(x, shift, 0)


class ChunkMasks(NamedTuple):
    """Segment structure of one chunk (segment-native kernel); all None for chunk-aligned segments."""
    same: jax.Array | None     # bool [C, C]: tokens c and i belong to the same segment
    carry: jax.Array | None    # f32 [C, 1]: 1 where the token continues the segment the incoming state belongs to
    inlast: jax.Array | None   # f32 [C, 1]: 1 where the token belongs to the chunk's last segment
    keep: jax.Array | None     # f32 [1, 1]: 1 when the whole chunk continues the incoming segment


NO_MASKS = ChunkMasks(None, None, None, None)


def segment_masks(ids_row, prev_last):
    """Masks from the chunk's (padding-filled) segment ids [1, C] and the id the incoming state belongs to [1, 1].

    Ids are non-decreasing along a row, so the carried segment is a prefix of the chunk and the last
    segment a suffix; both are found by comparing ids, never by searching.
    """
    ids_col = row_to_col(ids_row)
    last = jnp.max(ids_row, axis=1, keepdims=True)
    return ChunkMasks(same=ids_col == ids_row,
                      carry=(ids_col == prev_last).astype(f32),
                      inlast=(ids_col == last).astype(f32),
                      keep=(prev_last == last).astype(f32))


def _mask_rows(x, mask_col):
    return x if mask_col is None else x * mask_col


class _SubBlocks(NamedTuple):
    """Per-chunk constants of the sub-block factoring (built once per chunk, shared by every product)."""
    row: jax.Array            # int32 [C, 1]
    local_row: jax.Array      # int32 [C, 1]: position inside the sub-block
    diff: jax.Array           # int32 [C, C]: row - col
    in_block: list            # bool [C, 1] per sub-block p >= 1: row lies in sub-block p
    to_block: list            # f32 [C, K] per p >= 1: e^(G_n - G) on rows before n = p*SUB (<= 1), else 0
    from_start: jax.Array     # f32 [C, K]: e^(G - G_n(row)), n(row) = first token of the row's sub-block (<= 1)
    to_start: jax.Array | None  # f32 [C, K]: e^(G_n(row) - G) (<= e^75), only with safe_gate
    same_block: jax.Array     # bool [C, C]: row and column in the same sub-block


def _sub_blocks(G, safe_gate: bool):
    C, K = G.shape
    if C % SUB:
        raise ValueError(f"chunk size must be a multiple of {SUB}; got {C}")
    row = iota((C, 1), 0)
    in_block, to_block = [], []
    G_first = jnp.broadcast_to(G[0:1, :], (C, K))
    for p in range(1, C // SUB):
        n = p * SUB
        G_n = G[n:n + 1, :]
        in_p = (row >= n) & (row < n + SUB)
        before_p = row < n
        G_first = jnp.where(in_p, G_n, G_first)
        # Exponent masked BEFORE exp: on rows at or after n it would be positive (overflow).
        to_block.append(jnp.where(before_p, jnp.exp(jnp.where(before_p, G_n - G, 0.0)), 0.0))
        in_block.append(in_p)
    r, c = iota((C, C), 0), iota((C, C), 1)
    same_block = jax.lax.div(r, SUB) == jax.lax.div(c, SUB)
    to_start = jnp.exp(G_first - G) if safe_gate else None   # exponent in [0, 75] when every g >= -5
    return _SubBlocks(row, jax.lax.rem(row, SUB), r - c, in_block, to_block, jnp.exp(G - G_first),
                      to_start, same_block)


def _diagonal_steps(G, sb: _SubBlocks):
    """Yield (d, ok [C,1], E [C,K]) for pairs (c, c-d) inside one sub-block: E = e^(G_c - G_{c-d}) where ok."""
    for d in range(SUB):
        ok = sb.local_row >= d
        E = jnp.exp(jnp.where(ok, G - roll_rows(G, d), 0.0))  # masked before exp: wrapped rows would overflow
        yield d, ok, E


def decay_products(q, k, G, sb: _SubBlocks, bulk=None):
    """Aqk (i <= c) and Akk (i < c) of the module docstring, causal but not yet segment-masked; fp32 [C, C]."""
    C = q.shape[0]
    q_from, k_from = q * sb.from_start, k * sb.from_start
    A_qk = jnp.zeros((C, C), f32)
    A_kk = jnp.zeros((C, C), f32)
    for in_p, to_p in zip(sb.in_block, sb.to_block):
        k_to = k * to_p
        A_qk += mm_nt(jnp.where(in_p, q_from, 0.0), k_to, bulk)
        A_kk += mm_nt(jnp.where(in_p, k_from, 0.0), k_to, bulk)
    if sb.to_start is not None:
        k_start = k * sb.to_start
        A_qk += jnp.where(sb.same_block & (sb.diff >= 0), mm_nt(q_from, k_start, bulk), 0.0)
        A_kk += jnp.where(sb.same_block & (sb.diff > 0), mm_nt(k_from, k_start, bulk), 0.0)
        return A_qk, A_kk
    for d, ok, E in _diagonal_steps(G, sb):
        kE = roll_rows(k, d) * E
        on_diag = sb.diff == d
        A_qk += jnp.where(on_diag, jnp.where(ok, jnp.sum(q * kE, axis=1, keepdims=True), 0.0), 0.0)
        if d:
            A_kk += jnp.where(on_diag, jnp.where(ok, jnp.sum(k * kE, axis=1, keepdims=True), 0.0), 0.0)
    return A_qk, A_kk


def decay_product_grads(dA_qk, dA_kk, q, k, G, sb: _SubBlocks, bulk=None):
    """Gradients of A_qk = P(q, k) and A_kk = P(k, k) given masked dA: returns (dq, dk, dG)."""
    C, K = q.shape
    zeros = jnp.zeros((C, K), f32)
    R_q, R_k, RT_k, RT_q = zeros, zeros, zeros, zeros   # R(dAqk,k), R(dAkk,k), R^T(dAkk,k), R^T(dAqk,q)
    q_from, k_from = q * sb.from_start, k * sb.from_start
    for in_p, to_p in zip(sb.in_block, sb.to_block):
        k_to = k * to_p
        R_q += jnp.where(in_p, mm(dA_qk, k_to, bulk), 0.0)
        R_k += jnp.where(in_p, mm(dA_kk, k_to, bulk), 0.0)
        RT_k += to_p * mm_tn(dA_kk, jnp.where(in_p, k_from, 0.0), bulk)   # to_p is 0 outside rows before n
        RT_q += to_p * mm_tn(dA_qk, jnp.where(in_p, q_from, 0.0), bulk)
    if sb.to_start is not None:
        dA_qk_d = jnp.where(sb.same_block, dA_qk, 0.0)
        dA_kk_d = jnp.where(sb.same_block, dA_kk, 0.0)
        k_start = k * sb.to_start
        R_q += mm(dA_qk_d, k_start, bulk)
        R_k += mm(dA_kk_d, k_start, bulk)
        RT_k += sb.to_start * mm_tn(dA_kk_d, k_from, bulk)
        RT_q += sb.to_start * mm_tn(dA_qk_d, q_from, bulk)
    R_q *= sb.from_start
    R_k *= sb.from_start
    for d, ok, E in ([] if sb.to_start is not None else _diagonal_steps(G, sb)):
        on_diag = sb.diff == d
        a_q = jnp.where(ok, jnp.sum(jnp.where(on_diag, dA_qk, 0.0), axis=1, keepdims=True), 0.0)  # dA[c, c-d]
        R_q += a_q * roll_rows(k, d) * E
        RT_q += roll_rows(a_q * q * E, -d)          # lands on row c-d
        if d:
            a_k = jnp.where(ok, jnp.sum(jnp.where(on_diag, dA_kk, 0.0), axis=1, keepdims=True), 0.0)
            R_k += a_k * roll_rows(k, d) * E
            RT_k += roll_rows(a_k * k * E, -d)
    dq = R_q
    dk = R_k + RT_k + RT_q
    dG = q * R_q + k * (R_k - RT_k - RT_q)
    return dq, dk, dG


def unit_lower_inverse(L):
    """(I + L)^-1 for strictly lower L [C, C] by recursive block doubling (2 log2 C matmuls).

    With X the inverse of the block-diagonal part at block size s, and N the part of L coupling the two
    halves of each 2s block, (I + L_2s)^-1 = X - X N X exactly ((X N)^2 = 0): the blocked forward
    substitution of `chunked.unit_lower_inverse`, merged from 1x1 blocks upwards.
    """
    C = L.shape[0]
    r, c = iota((C, C), 0), iota((C, C), 1)
    X = (r == c).astype(f32)
    s = 1
    while s < C:
        couple = (jax.lax.div(r, 2 * s) == jax.lax.div(c, 2 * s)) & (jax.lax.div(r, s) != jax.lax.div(c, s))
        X = X - mm(mm(X, jnp.where(couple, L, 0.0)), X)
        s *= 2
    return X


class Intra(NamedTuple):
    """State-independent quantities of one chunk."""
    G: jax.Array       # [C, K] chunk-local cumsum of g
    A_qk: jax.Array    # [C, C] masked (i <= c, same segment)
    A_kk: jax.Array    # [C, C] masked (i < c, same segment)
    X: jax.Array       # [C, C] (I + beta Akk)^-1
    Tm: jax.Array      # [C, C] X Diag(beta)
    kg: jax.Array      # [C, K] k e^G
    W: jax.Array       # [C, K] Tm kg, carry-masked
    U: jax.Array       # [C, V] Tm v
    Qg: jax.Array      # [C, K] q e^G, carry-masked
    Ko: jax.Array      # [C, K] k e^(G_last - G), last-segment-masked
    decay: jax.Array   # [K, 1] keep * e^(G_last), as a column so it scales the state's rows


def intra_chunk(q, k, v, g, beta_row, masks: ChunkMasks, safe_gate: bool = False,
                sb_out: list | None = None, bulk=None, inverse=None) -> Intra:
    """q already scaled; all inputs fp32: q, k, g [C, K], v [C, V], beta_row [1, C]. `inverse`: X saved by
    an earlier pass over the same chunk (then A_kk feeds only dbeta, and a kernel that needs no dbeta drops it)."""
    C = q.shape[0]
    r, c = iota((C, C), 0), iota((C, C), 1)
    G = mm((r >= c).astype(f32), g)  # cumsum as a matmul: Mosaic has no cumsum; HIGHEST keeps it fp32-exact
    sb = _sub_blocks(G, safe_gate)
    if sb_out is not None:
        sb_out.append(sb)
    A_qk, A_kk = decay_products(q, k, G, sb, bulk)
    if masks.same is not None:
        A_qk = jnp.where(masks.same, A_qk, 0.0)
        A_kk = jnp.where(masks.same, A_kk, 0.0)
    beta_col = row_to_col(beta_row)
    X = unit_lower_inverse(beta_col * A_kk) if inverse is None else inverse
    Tm = X * beta_row
    eG = jnp.exp(G)                                  # exponent <= 0
    kg = k * eG
    G_last = G[C - 1:C, :]
    decay = row_to_col(jnp.exp(G_last))              # [K, 1]
    if masks.keep is not None:
        decay = decay * masks.keep
    return Intra(G=G, A_qk=A_qk, A_kk=A_kk, X=X, Tm=Tm, kg=kg,
                 W=_mask_rows(mm(Tm, kg, bulk), masks.carry), U=mm(Tm, v, bulk), Qg=_mask_rows(q * eG, masks.carry),
                 Ko=_mask_rows(k * jnp.exp(G_last - G), masks.inlast), decay=decay)


def chunk_forward(q, k, v, g, beta_row, S, masks: ChunkMasks = NO_MASKS, safe_gate: bool = False, bulk=None,
                  inverse=None):
    """(O [C, V], S' [K, V], X [C, C]) for incoming state S [K, V] (kept fp32: only its matmul operand is
    rounded); X is the chunk's WY inverse (given as `inverse` when saved, else computed)."""
    it = intra_chunk(q, k, v, g, beta_row, masks, safe_gate, bulk=bulk, inverse=inverse)
    v_new = it.U - mm(it.W, S, bulk)
    o = mm(it.Qg, S, bulk) + mm(it.A_qk, v_new, bulk)
    return o, it.decay * S + mm_tn(it.Ko, v_new, bulk), it.X


def chunk_backward(q, k, v, g, beta_row, S, dO, dS_next, masks: ChunkMasks = NO_MASKS, safe_gate: bool = False,
                   bulk=None, inverse=None):
    """Recompute the chunk from its inputs, incoming state S and (if saved) its WY inverse; return
    (dq, dk, dv, dg, dbeta_row, dS)."""
    C, K = q.shape
    sbs = []
    it = intra_chunk(q, k, v, g, beta_row, masks, safe_gate, sb_out=sbs, bulk=bulk, inverse=inverse)
    sb = sbs[0]
    v_new = it.U - mm(it.W, S, bulk)
    d_vnew = mm_tn(it.A_qk, dO, bulk) + mm(it.Ko, dS_next, bulk)
    dS = mm_tn(it.Qg, dO, bulk) - mm_tn(it.W, d_vnew, bulk) + it.decay * dS_next

    causal_incl = iota((C, C), 0) >= iota((C, C), 1)
    dA_qk = mm_nt(dO, v_new, bulk)
    dA_qk = jnp.where(causal_incl if masks.same is None else causal_incl & masks.same, dA_qk, 0.0)
    dQg = mm_nt(dO, S, bulk)                                    # [C, K]
    dKo = mm_nt(v_new, dS_next, bulk)                           # [C, K]
    dW = _mask_rows(-mm_nt(d_vnew, S, bulk), masks.carry)

    eG = jnp.exp(it.G)
    dq = _mask_rows(dQg * eG, masks.carry)
    dG = dQg * it.Qg
    G_last = it.G[C - 1:C, :]
    dk = _mask_rows(dKo * jnp.exp(G_last - it.G), masks.inlast)
    dKo_Ko = dKo * it.Ko
    dG = dG - dKo_Ko
    # G_last enters Ko and the state decay: d/dG_last of sum(dS' * decay * S) = decay_k sum_v S_kv dS'_kv.
    dG_last = jnp.sum(dKo_Ko, axis=0, keepdims=True) + col_to_row(
        it.decay * jnp.sum(S * dS_next, axis=1, keepdims=True))

    dTm = mm_nt(dW, it.kg, bulk) + mm_nt(d_vnew, v, bulk)
    dkg = mm_tn(it.Tm, dW, bulk)
    dv = mm_tn(it.Tm, d_vnew, bulk)
    dk = dk + dkg * eG
    dG = dG + dkg * it.kg

    dX = dTm * beta_row
    dbeta_row = jnp.sum(dTm * it.X, axis=0, keepdims=True)
    strict = iota((C, C), 0) > iota((C, C), 1)
    dL = -mm_nt(mm_tn(it.X, dX), it.X)   # the inverse's gradient: fp32 like the inverse
    dL = jnp.where(strict if masks.same is None else strict & masks.same, dL, 0.0)
    dbeta_row = dbeta_row + col_to_row(jnp.sum(dL * it.A_kk, axis=1, keepdims=True))
    dA_kk = row_to_col(beta_row) * dL

    dq_p, dk_p, dG_p = decay_product_grads(dA_qk, dA_kk, q, k, it.G, sb, bulk)
    dq = dq + dq_p
    dk = dk + dk_p
    dG = dG + dG_p + jnp.where(iota((C, 1), 0) == C - 1, dG_last, 0.0)
    r, c = iota((C, C), 0), iota((C, C), 1)
    dg = mm((c >= r).astype(f32), dG)                           # reverse cumsum: dg_t = sum_{c >= t} dG_c
    return dq, dk, dv, dg, dbeta_row, dS


# --- fused prologue: the KDA gate and the q/k L2 norm, applied to a chunk's tiles inside the kernel ----------
L2NORM_EPS = 1e-6        # FLA's l2norm: x * rsqrt(sum(x^2) + 1e-6)
PADDING_GATE_RAW = -1e30  # raw gate of padding/filler tokens: both gate forms map it to exactly 0 (no decay)


class Fusion(NamedTuple):
    """Static choice of what the kernel computes from raw inputs (see `gate.py` for the formulas), and how."""
    # None: g is the log-decay; "softplus": -a softplus(g + dt); "lower_bound": lb sigmoid(a (g + dt))
    gate: str | None = None
    lower_bound: float = SAFE_GATE_MIN
    qk_l2norm: bool = False
    bulk: str | None = None   # operand dtype of the bulk matmuls ("bfloat16"), None = fp32 HIGHEST (policy above)


def l2norm_rows(x):
    """(x / |x|, 1 / |x|) per row, fp32."""
    r = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2NORM_EPS)
    return x * r, r


def l2norm_rows_backward(x_n, r, dx_n):
    """Gradient through x_n = x r, r = (|x|^2 + eps)^-1/2:  dx = r (dx_n - x_n <x_n, dx_n>)."""
    return r * (dx_n - x_n * jnp.sum(x_n * dx_n, axis=1, keepdims=True))


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))  # torch's threshold; clamp keeps exp finite


def gate_forward(g_raw, gate_params, fusion: Fusion):
    """Log-decay [C, K] from the raw gate; gate_params [2, K] = (dt_bias row, a = exp(A_log) broadcast)."""
    x = g_raw + gate_params[0:1, :]
    a = gate_params[1:2, :]
    if fusion.gate == "softplus":
        return -a * _softplus(x)
    return fusion.lower_bound * jax.nn.sigmoid(a * x)


def gate_backward(g_raw, gate_params, dg, fusion: Fusion):
    """(dg_raw [C, K], d gate_params [2, K] summed over the chunk's tokens)."""
    x = g_raw + gate_params[0:1, :]
    a = gate_params[1:2, :]
    if fusion.gate == "softplus":
        dx = -a * dg * jnp.where(x > 20.0, 1.0, jax.nn.sigmoid(x))
        da = -dg * _softplus(x)
    else:
        s = jax.nn.sigmoid(a * x)
        dz = dg * fusion.lower_bound * s * (1.0 - s)
        dx, da = dz * a, dz * x          # x is finite (the padding sentinel too), so 0 * x stays 0
    d_params = jnp.where(iota((2, 1), 0) == 0, jnp.sum(dx, axis=0, keepdims=True), jnp.sum(da, axis=0, keepdims=True))
    return dx, d_params


def prologue(q, k, g, gate_params, fusion: Fusion):
    """Kernel inputs -> the chunk math's (q, k, g), plus what `prologue_backward` needs."""
    saved = {}
    if fusion.qk_l2norm:
        q, saved["rq"] = l2norm_rows(q)
        k, saved["rk"] = l2norm_rows(k)
    if fusion.gate is not None:
        saved["g_raw"] = g
        g = gate_forward(g, gate_params, fusion)
    return q, k, g, saved


def prologue_backward(q, k, dq, dk, dg, gate_params, saved, fusion: Fusion):
    """Chain the chunk gradients through the prologue; q, k are the prologue's outputs (normalised)."""
    d_params = None
    if fusion.qk_l2norm:
        dq = l2norm_rows_backward(q, saved["rq"], dq)
        dk = l2norm_rows_backward(k, saved["rk"], dk)
    if fusion.gate is not None:
        dg, d_params = gate_backward(saved["g_raw"], gate_params, dg, fusion)
    return dq, dk, dg, d_params
