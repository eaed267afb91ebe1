"""Chunkwise KDA in XLA (docs/design.md#chunked-wy-form), in two packing designs.

Per chunk of C tokens, with G the cumsum of g within the chunk and the token's segment:
    Akk[c,i] = sum_d k_cd k_id exp(G_cd - G_id)  (i < c)      Aqk[c,i] = sum_d q_cd k_id exp(G_cd - G_id)  (i <= c)
    Tm = (I + beta * Akk)^-1 Diag(beta);  W = Tm (exp(G) K);  U = Tm V
    V' = U - W S;  O = (Q exp(G)) S + Aqk V';  S <- exp(G_last) S + (exp(G_last - G) K)^T V'

* `chunked_segment_native`: rows stay `[B, T]`; pairs are masked to the same segment, the carried state
  reaches only tokens continuing the previous chunk's last segment, and the outgoing state is built from
  the chunk's last segment only. No flattening, no phantom segments; T is padded to a chunk multiple.
* `chunked_aligned`: the aligned cu_seqlens layout: flatten to `[1, B*T]`, describe it with `cu_seqlens`
  (`max_segs + 1`, phantom segments), place every segment at a chunk boundary of a static buffer of
  `segments.aligned_length` tokens, reset the state at chunks that start a segment, gather back.

Padding tokens and alignment filler are no-ops (k = v = g = beta = 0), so they never touch the state.
Gradients come from autodiff of this code, except closed-form VJPs: the triangular inverse with beta
(`beta_inverse`), and the inter-chunk recurrence with the outputs (`chunk_scan`: every product in the loop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from lingpack.kernels.kda import segments
from lingpack.kernels.kda.gate import SUB_CHUNK, check_chunk_size  # decays factored per sub-chunk
from lingpack.precision import at_least_fp32


def _decay_products(q_NCK, k_NCK, G_NCK, seg_NC, *, sub: int, safe_gate: bool):
    """A_qk[c,i] = sum_d q_cd k_id exp(G_cd - G_id) (i <= c) and A_kk (same with k, i < c), both zero unless c
    and i share a segment; fp32, returned stacked as [.., C, 2, C] (qk, kk); C need not be a power of 2
    (padded inside). G is the segment-local cumsum, so G_c - G_i <= 0 for every kept pair.

    exp(G_c - G_i) overflows if split as exp(G_c) exp(-G_i), so the chunk is split in halves recursively: the
    lower-left quarter of a block (rows in its 2nd half, columns in its 1st) is split at r = the block's middle
    row, exp(G_c - G_r) exp(G_r - G_i), both <= 1 for any gate: one batched matmul per level (a pair can only be
    kept if r shares its segment, so other factors are zeroed). Base blocks: with `safe_gate` (every g >= -5),
    `sub` tokens split at each token's segment start inside the block (a factor <= exp(5 * 15), far below
    fp32's exp(88)); without it single tokens (the diagonal q_c . k_c; halving down to 1 token was faster on
    CPU than forming 4x4 pairs explicitly). Exponents are masked BEFORE exp (NaN-free gradients). q and k rows
    are interleaved so each level is one matmul for both products.
    """
    *outer, C, K = q_NCK.shape
    # one batch axis: a YNN fused transpose of XLA:CPU segfaulted on the 8-9-dim arrays of [B, N, H] (jaxlib 0.10.2)
    q_NCK, k_NCK, G_NCK = [a.reshape(-1, C, K) for a in (q_NCK, k_NCK, G_NCK)]
    seg_NC = jnp.broadcast_to(seg_NC, (*outer, C)).reshape(-1, C)
    P = q_NCK.shape[0]
    base = sub if safe_gate else 1
    size = base * 2 ** max(0, (C // base - 1).bit_length())     # halvable size >= C; pad rows/cols are masked
    if size != C:
        q_NCK, k_NCK, G_NCK = [jnp.pad(a, [(0, 0), (0, size - C), (0, 0)]) for a in (q_NCK, k_NCK, G_NCK)]
        seg_NC = jnp.pad(seg_NC, [(0, 0), (0, size - C)], constant_values=-1)  # ids are >= 0: padding pairs masked
    nb = size // base
    q_b, k_b, G_b = [a.reshape(P, nb, base, a.shape[-1]) for a in (q_NCK, k_NCK, G_NCK)]
    seg_b = seg_NC.reshape(P, nb, base)
    same_b = seg_b[..., :, None] == seg_b[..., None, :]
    incl = jnp.tril(jnp.ones((base, base), bool)) & same_b
    strict = jnp.tril(jnp.ones((base, base), bool), -1) & same_b
    mask = jnp.stack([incl, strict], axis=-2)                            # [.., nb, base, 2, base]
    if safe_gate:
        starts = jnp.concatenate([jnp.ones_like(seg_b[..., :1], bool), seg_b[..., 1:] != seg_b[..., :-1]], -1)
        ref = jax.lax.cummax(jnp.where(starts, jnp.arange(base), 0), axis=seg_b.ndim - 1)  # segment start in block
        pick = (ref[..., :, None] == jnp.arange(base)).astype(G_b.dtype)
        G_ref = jnp.einsum("...tr,...rk->...tk", pick, G_b, precision="highest")  # one-hot gather, exact
        pos = jnp.exp(G_b - G_ref)                                       # exponent <= 0
        A = jnp.einsum("...cxk,...ik->...cxi", jnp.stack([q_b * pos, k_b * pos], -2),
                       k_b * jnp.exp(G_ref - G_b))                       # exponent in [0, 75]
    else:  # 1-token blocks: a token's own pair has no decay, q_c . k_c (A_kk is strictly lower)
        diag = jnp.einsum("...ck,...ck->...c", q_b, k_b)
        A = jnp.stack([diag, jnp.zeros_like(diag)], -1)[..., None]
    A = jnp.where(mask, A, 0.0)                                          # [.., n, s, 2, s]
    s = base
    while s < size:
        m = size // (2 * s)
        q2, k2, G2 = [a.reshape(P, m, 2, s, a.shape[-1]) for a in (q_NCK, k_NCK, G_NCK)]
        seg2 = seg_NC.reshape(P, m, 2, s)
        G_r, seg_r = G2[..., 1, :1, :], seg2[..., 1, :1]                 # the 2nd half's first row
        # exp(-inf) = 0 drops other segments' factors; its derivative is 0 too, so gradients stay finite
        row_decay = jnp.exp(jnp.where((seg2[..., 1, :] == seg_r)[..., None], G2[..., 1, :, :] - G_r, -jnp.inf))
        col_decay = jnp.exp(jnp.where((seg2[..., 0, :] == seg_r)[..., None], G_r - G2[..., 0, :, :], -jnp.inf))
        rows = jnp.stack([q2[..., 1, :, :] * row_decay, k2[..., 1, :, :] * row_decay], -2)
        quarter = jnp.einsum("...cxk,...ik->...cxi", rows, k2[..., 0, :, :] * col_decay)  # [.., m, s, 2, s]
        A2 = A.reshape(P, m, 2, s, 2, s)
        top = jnp.concatenate([A2[..., 0, :, :, :], jnp.zeros_like(quarter)], axis=-1)
        bottom = jnp.concatenate([quarter, A2[..., 1, :, :, :]], axis=-1)
        A, s = jnp.concatenate([top, bottom], axis=-3), 2 * s
    return A.reshape(*outer, size, 2, size)[..., :C, :, :C]


@jax.custom_vjp
def unit_lower_inverse(L_CC):
    """(I + L)^-1 for strictly lower L by recursive doubling from 1x1 blocks, every block of a level in one
    batched matmul: [[A,0],[B,D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]] (XLA's batched triangular solve is
    ~70x slower on CPU). Exact block algebra, unlike a Neumann product, so it stays exact when keys repeat."""
    *lead, C, _ = L_CC.shape
    size = 1 << (C - 1).bit_length()                      # zero padding: I + 0 inverts to I
    diag = jnp.pad(L_CC.reshape(-1, C, C), [(0, 0), (0, size - C), (0, size - C)])[:, None]
    quarters = []                                         # lower-left quarters of the diagonal blocks, per level
    while diag.shape[-1] > 1:
        P, n, s = diag.shape[0], diag.shape[1], diag.shape[-1] // 2
        q4 = diag.reshape(P, n, 2, s, 2, s)
        quarters.append(q4[:, :, 1, :, 0, :])
        diag = jnp.stack([q4[:, :, 0, :, 0, :], q4[:, :, 1, :, 1, :]], axis=2).reshape(P, 2 * n, s, s)
    X = jnp.ones_like(diag)                               # inverses of the 1x1 diagonal blocks
    for B in reversed(quarters):
        P, n, s = X.shape[0], X.shape[1] // 2, X.shape[-1]
        A_inv, D_inv = X.reshape(P, n, 2, s, s)[:, :, 0], X.reshape(P, n, 2, s, s)[:, :, 1]
        top = jnp.concatenate([A_inv, jnp.zeros_like(A_inv)], -1)
        X = jnp.concatenate([top, jnp.concatenate([-(D_inv @ B @ A_inv), D_inv], -1)], -2)
    return X[:, 0, :C, :C].reshape(*lead, C, C)


def _inverse_fwd(L_CC):
    X = unit_lower_inverse(L_CC)
    return X, X


def _inverse_cotangent(X_CC, dX_CC):
    Xt = jnp.swapaxes(X_CC, -1, -2)
    # d(M^-1) = -M^-1 dM M^-1 with M = I + L; only the strictly lower entries of L are free.
    return jnp.tril(-(Xt @ dX_CC @ Xt), -1)


unit_lower_inverse.defvjp(_inverse_fwd, lambda X, dX: (_inverse_cotangent(X, dX),))


@jax.custom_vjp
def beta_inverse(A_kk_CC, beta_C):
    """Tm = (I + Diag(beta) A_kk)^-1 Diag(beta) for strictly lower A_kk. Its VJP forms beta's gradient as batched
    dot products: autodiff's broadcast multiplies turn into fused multiply + reduce, ~10x slower on XLA:CPU."""
    return _beta_inverse_fwd(A_kk_CC, beta_C)[0]


def _beta_inverse_fwd(A_kk, beta):
    X = unit_lower_inverse(beta[..., :, None] * A_kk)
    return X * beta[..., None, :], (A_kk, beta, X)


def _beta_inverse_bwd(res, dT):
    A_kk, beta, X = res
    dL = _inverse_cotangent(X, dT * beta[..., None, :])
    d_beta = jnp.einsum("...ci,...ci->...i", dT, X) + jnp.einsum("...ci,...ci->...c", dL, A_kk)
    return dL * beta[..., :, None], d_beta


beta_inverse.defvjp(_beta_inverse_fwd, _beta_inverse_bwd)


def decay_factors(q_MCK, k_MCK, G_MCK, carry_MC, last_MC, keep_M):
    """A chunk's gate-decayed operands from its cumsum G (masks: the token continues the incoming state's segment;
    the token is in the chunk's last segment; the whole chunk continues): q exp(G) and k exp(G) (rows that do not
    continue the state zeroed), k exp(G_last - G) over the last segment (exponent <= 0), exp(G_last) or 0."""
    eG = jnp.exp(G_MCK)
    carry, last = carry_MC[..., None], last_MC[..., None]
    k_out = jnp.where(last, jnp.exp(jnp.where(last, G_MCK[..., -1:, :] - G_MCK, 0.0)) * k_MCK, 0.0)
    return (jnp.where(carry, q_MCK * eG, 0.0), jnp.where(carry, k_MCK * eG, 0.0), k_out,
            jnp.where(keep_M[..., None], jnp.exp(G_MCK[..., -1, :]), 0.0))


SCAN_INPUTS = ("q", "k", "G", "v", "t_mat", "a_qk", "carry", "last", "keep")  # chunk_scan's per-chunk inputs


@jax.custom_vjp
def chunk_scan(table_RHKV, idx_NL, r_NL, q_NMCK, k_NMCK, G_NMCK, v_NMCV, t_NMCC, a_NMCC, carry_NMC, last_NMC,
               keep_NM):
    """The inter-chunk recurrence over N chunks of L independent lanes (the only sequential part), and the outputs;
    lanes and heads are flattened, M = L * H (no size-1 axes, which XLA:CPU relayouts with copies). With
    qd, kd, ko, decay = `decay_factors` of chunk n:
        S_in[n] = r[n] S_out[n-1] + table[idx[n]];   x[n] = v[n] - kd[n] S_in[n];   v'[n] = t[n] x[n]
        o[n] = qd[n] S_in[n] + a[n] v'[n];   S_out[n] = decay[n] S_in[n] + ko[n]^T v'[n]   (S_out[-1] = 0; r is 0/1)
    (v' = U - W S of the WY form with U = t v, W = t kd, without forming U and W.) Returns o [N, M, C, V],
    S_in [N, M, K, V], x [N, M, C, V] and S_out[N - 1] [M, K, V]. The decay factors and every product are
    computed inside the loop, forward and backward, while the chunk's state is in cache (batched over all chunks,
    the [K, V] states stream from memory: ~2x slower on CPU); only the transposed recurrence is sequential.
    """
    return _chunk_scan(table_RHKV, idx_NL, r_NL, q_NMCK, k_NMCK, G_NMCK, v_NMCV, t_NMCC, a_NMCC, carry_NMC,
                       last_NMC, keep_NM)[0]


def _lanes(table, idx_L, r_L):
    """Per flattened lane (lane-major, then head): the table rows, and r as a [M, 1, 1] factor."""
    rows = table[idx_L]
    return rows.reshape(-1, *rows.shape[2:]), jnp.repeat(r_L, table.shape[1])[:, None, None]


def _chunk_scan(table, idx, r, q, k, G, v, t, a, carry, last, keep):
    def step(S_MKV, xs):
        idx_L, r_L, q_n, k_n, G_n, v_n, t_n, a_n, c_n, l_n, keep_n = xs
        qd, kd, ko, d = decay_factors(q_n, k_n, G_n, c_n, l_n, keep_n)
        rows, r_M = _lanes(table, idx_L, r_L)
        S_in = r_M * S_MKV + rows
        x_n = v_n - kd @ S_in
        v_new = t_n @ x_n
        S_out = d[..., None] * S_in + jnp.swapaxes(ko, -1, -2) @ v_new
        return S_out, (qd @ S_in + a_n @ v_new, S_in, x_n)

    S0 = jnp.zeros((idx.shape[1] * table.shape[1], *table.shape[2:]), table.dtype)
    S_last, (o, S_in, x) = jax.lax.scan(step, S0, (idx, r, q, k, G, v, t, a, carry, last, keep))
    return (o, S_in, x, S_last), (table, idx, r, q, k, G, t, a, carry, last, keep, S_in, x)


def _chunk_scan_fwd(*primals):  # symbolic zeros: the outputs a caller drops (S_in, x) add no work backward
    return _chunk_scan(*(p.value for p in primals))


def _chunk_scan_bwd(res, cts):
    table, idx, r, q, k, G, t, a, carry, last, keep, S_in, x = res
    do, dS_in_ext, dx_ext, dS_last = cts
    tr = lambda m: jnp.swapaxes(m, -1, -2)
    extra = {n: c for n, c in (("dS_in", dS_in_ext), ("dx", dx_ext)) if not isinstance(c, SymbolicZero)}

    def step(carry_, xs):
        dS_out, d_table = carry_                             # dS_out: gradient of S_out[n]
        idx_L, r_L, q_n, k_n, G_n, t_n, a_n, c_n, l_n, keep_n, S_n, x_n, do_n, ext = xs
        (qd, kd, ko, d), factors_vjp = jax.vjp(lambda *qkG: decay_factors(*qkG, c_n, l_n, keep_n), q_n, k_n, G_n)
        v_new = t_n @ x_n                                    # recomputed: cheaper than storing it
        dv_new = ko @ dS_out + tr(a_n) @ do_n
        dx = tr(t_n) @ dv_new + ext.get("dx", 0.0)
        dS_in = d[..., None] * dS_out + tr(qd) @ do_n - tr(kd) @ dx + ext.get("dS_in", 0.0)
        dq, dk, dG = factors_vjp((do_n @ tr(S_n), -(dx @ tr(S_n)), v_new @ tr(dS_out),
                                  jnp.einsum("...kv,...kv->...k", S_n, dS_out)))
        grads = (dq, dk, dG, dx, dv_new @ tr(x_n), do_n @ tr(v_new))
        return (_lanes(table, idx_L, r_L)[1] * dS_in, d_table.at[idx_L].add(dS_in.reshape(-1, *table.shape[1:]))), grads

    if isinstance(dS_last, SymbolicZero):
        dS_last = jnp.zeros((idx.shape[1] * table.shape[1], *table.shape[2:]), table.dtype)
    (_, d_table), (dq, dk, dG, dv, dt, da) = jax.lax.scan(
        step, (dS_last, jnp.zeros_like(table)), (idx, r, q, k, G, t, a, carry, last, keep, S_in, x, do, extra),
        reverse=True)
    return d_table, None, None, dq, dk, dG, dv, dt, da, None, None, None


chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd, symbolic_zeros=True)


def _intra_chunk(q, k, g, beta, seg_C, *, sub: int, safe_gate: bool):
    """Everything that does not depend on the carried state, for all chunks at once ([.., H, C, *]): the
    segment-local cumsum G, A_qk and t = (I + Diag(beta) A_kk)^-1 Diag(beta).

    `seg_C` (ids broadcastable to [.., C]) marks segments inside a chunk; None = the chunk is one segment.
    """
    C = q.shape[-2]
    if seg_C is None:
        seg_C = jnp.zeros(q.shape[:-1], jnp.int32)
        G = jnp.cumsum(g, axis=-2)  # chunk-local log-decay, fp32
    else:
        # Segment-local cumsum as a 0/1 matmul: another document's g enters with an exact 0 weight, so its
        # gradient is exactly zero (a difference of prefix sums only cancels to rounding).
        same = seg_C[..., :, None] == seg_C[..., None, :]
        prefix = (same & jnp.tril(jnp.ones((C, C), bool))).astype(g.dtype)
        prefix = jnp.broadcast_to(prefix, (*g.shape[:-2], C, C))  # per head: no transposes of g and its gradient
        G = jnp.einsum("...ci,...ik->...ck", prefix, g, precision="highest")
    A = _decay_products(q, k, G, seg_C, sub=sub, safe_gate=safe_gate)
    # t is block-diagonal per segment, as A_kk
    return dict(G=G, a_qk=A[..., :, 0, :], t_mat=beta_inverse(A[..., :, 1, :], beta))


def _to_chunks(x_BTH_, n_chunks, chunk_size):
    """[B, T, H, *] -> [B, N, H, C, *]."""
    B, T, H = x_BTH_.shape[:3]
    x = x_BTH_.reshape(B, n_chunks, chunk_size, H, *x_BTH_.shape[3:])
    return jnp.moveaxis(x, 2, 3)


def _from_chunks(x_BNHCV):
    B, N, H, C, V = x_BNHCV.shape
    return jnp.moveaxis(x_BNHCV, 3, 2).reshape(B, N * C, H, V)


def _lanes_major(x_BNH_):
    """[B, N, H, *] -> [N, B * H, *]: chunk-major, lanes and heads flattened for `chunk_scan`."""
    B, N, H = x_BNH_.shape[:3]
    return jnp.moveaxis(x_BNH_, 1, 0).reshape(N, B * H, *x_BNH_.shape[3:])


def _prepare(q, k, v, g, beta, real_BT, scale):
    """fp32 (or float64) copies with padding turned into no-op tokens."""
    # the state and every accumulation are fp32 whatever the input dtype (float64 when an input is float64)
    f32 = at_least_fp32(q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
    m = real_BT[..., None, None]
    return (jnp.where(m, q.astype(f32) * scale, 0.0), jnp.where(m, k.astype(f32), 0.0),
            jnp.where(m, v.astype(f32), 0.0), jnp.where(m, g.astype(f32), 0.0),
            jnp.where(real_BT[..., None], beta.astype(f32), 0.0))


def chunked_segment_native(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, segment_ids_BT, scale,
                           initial_state_BHKV, chunk_size=64, safe_gate=False,
                           sub_chunk=SUB_CHUNK):
    check_chunk_size(chunk_size)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    n_chunks = -(-T // chunk_size)
    pad = n_chunks * chunk_size - T
    real = segment_ids_BT != 0
    ids = segments.fill_padding_ids(segment_ids_BT)
    xs = _prepare(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, real, scale)
    if pad:  # tail filler continues the row's last segment as no-op tokens
        xs = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in xs]
        ids = jnp.pad(ids, [(0, 0), (0, pad)], mode="edge")
    q, k, v, g, beta = [_to_chunks(x, n_chunks, chunk_size) for x in xs[:4]] + [
        jnp.moveaxis(xs[4].reshape(B, n_chunks, chunk_size, H), 2, 3)]

    ids_BNC = ids.reshape(B, n_chunks, chunk_size)
    prev_last = jnp.concatenate([ids_BNC[:, :1, 0], ids_BNC[:, :-1, -1]], axis=1)     # [B, N]
    carry_BNC = ids_BNC == prev_last[..., None]        # token continues the segment the state belongs to
    pre = _intra_chunk(q, k, g, beta, ids_BNC[:, :, None], sub=sub_chunk, safe_gate=safe_gate)
    heads = lambda x_BN_: jnp.broadcast_to(x_BN_[:, :, None], (B, n_chunks, H, *x_BN_.shape[2:]))
    # t_mat is block-diagonal per segment, so masking k's rows masks W's; keep: the whole chunk continues
    pre.update(q=q, k=k, v=v, carry=heads(carry_BNC), last=heads(ids_BNC == ids_BNC[..., -1:]),
               keep=heads(carry_BNC[..., -1]))
    m = jax.tree.map(_lanes_major, pre)
    # lane b starts from table row b (its initial state); later chunks add the zero row B
    wide = xs[0].dtype
    table = jnp.concatenate([initial_state_BHKV.astype(wide), jnp.zeros((1, H, K, V), wide)])
    idx_NB = jnp.full((n_chunks, B), B, jnp.int32).at[0].set(jnp.arange(B, dtype=jnp.int32))
    r_NB = jnp.broadcast_to((jnp.arange(n_chunks) > 0)[:, None], (n_chunks, B)).astype(wide)
    o_NMCV, _, _, final_MKV = chunk_scan(table, idx_NB, r_NB, *(m[name] for name in SCAN_INPUTS))
    o_BTHV = _from_chunks(jnp.moveaxis(o_NMCV.reshape(n_chunks, B, H, chunk_size, V), 0, 1))[:, :T]
    return jnp.where(real[..., None, None], o_BTHV, 0.0), final_MKV.reshape(B, H, K, V)


def chunked_aligned(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, segment_ids_BT, scale, initial_state_BHKV,
                    max_segs, chunk_size=64, safe_gate=False, sub_chunk=SUB_CHUNK):
    check_chunk_size(chunk_size)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    plan = segments.align_plan(segment_ids_BT, max_segs, chunk_size)
    t_new = segments.aligned_length(B * T, max_segs, chunk_size)
    n_chunks = t_new // chunk_size
    real = segment_ids_BT != 0
    xs = _prepare(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, real, scale)
    # Scatter the flattened stream into the aligned buffer; unfilled slots are zero = no-op tokens.
    scatter = lambda x: jnp.zeros((t_new,) + x.shape[2:], x.dtype).at[plan.dest].set(
        x.reshape(B * T, *x.shape[2:]), mode="drop")[None]
    q, k, v, g = [_to_chunks(scatter(x), n_chunks, chunk_size) for x in xs[:4]]
    beta = jnp.moveaxis(scatter(xs[4]).reshape(1, n_chunks, chunk_size, H), 2, 3)
    pre = _intra_chunk(q, k, g, beta, None, sub=sub_chunk, safe_gate=safe_gate)
    every = jnp.ones(beta.shape, bool)               # one segment per chunk; resets come from r and the table
    pre.update(q=q, k=k, v=v, carry=every, last=every, keep=every[..., 0])

    # Initial state per chunk: a row's first segment starts from that row's state, others from zero.
    wide = xs[0].dtype
    init_table = jnp.concatenate([initial_state_BHKV.astype(wide), jnp.zeros((1, H, K, V), wide)])
    # Capture each row's final state at the chunk holding the end of the row's last segment.
    last_seg = jnp.clip(plan.row_last_seg, 0, max_segs - 1)
    row_final_chunk = jnp.where(plan.row_last_seg >= 0, plan.seg_last_chunk[last_seg], -1)   # [B]

    m = jax.tree.map(_lanes_major, pre)             # [N, H, ...]: the one lane of the aligned buffer
    reset_N1 = plan.chunk_starts_seg[:, None]
    idx_N1 = jnp.where(reset_N1, plan.chunk_init_row[:, None], B).astype(jnp.int32)
    o_NHCV, states_NHKV, x_NHCV, _ = chunk_scan(init_table, idx_N1, 1.0 - reset_N1.astype(wide),
                                                *(m[name] for name in SCAN_INPUTS))
    # Each row's final state: the state leaving the chunk that holds the end of its last segment.
    at = lambda a: jnp.take(a, jnp.maximum(row_final_chunk, 0), axis=0)   # [B, ...]
    _, _, k_out, decay = decay_factors(*(at(m[name]) for name in ("q", "k", "G", "carry", "last", "keep")))
    leaving = decay[..., None] * at(states_NHKV) + jnp.swapaxes(k_out, -1, -2) @ (at(m["t_mat"]) @ at(x_NHCV))
    final_BHKV = jnp.where((row_final_chunk >= 0)[:, None, None, None], leaving,
                           initial_state_BHKV.astype(wide))
    o_flat = _from_chunks(o_NHCV[None])[0]                  # [T_new, H, V]
    o_BTHV = jnp.take(o_flat, plan.dest, axis=0, mode="fill", fill_value=0.0).reshape(B, T, H, V)
    return jnp.where(real[..., None, None], o_BTHV, 0.0), final_BHKV
