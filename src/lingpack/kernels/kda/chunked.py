"""Chunkwise KDA in XLA (the WY form of REFERENCE.md §1), in two packing designs.

Per chunk of C tokens, with G the cumsum of g within the chunk and the token's segment:
    Akk[c,i] = sum_d k_cd k_id exp(G_cd - G_id)  (i < c)      Aqk[c,i] = sum_d q_cd k_id exp(G_cd - G_id)  (i <= c)
    Tm = (I + beta * Akk)^-1 Diag(beta);  W = Tm (exp(G) K);  U = Tm V
    V' = U - W S;  O = (Q exp(G)) S + Aqk V';  S <- exp(G_last) S + (exp(G_last - G) K)^T V'

* `chunked_segment_native`: rows stay `[B, T]`; pairs are masked to the same segment, the carried state
  reaches only tokens continuing the previous chunk's last segment, and the outgoing state is built from
  the chunk's last segment only. No flattening, no phantom segments; T is padded to a chunk multiple.
* `chunked_aligned`: the seed RFC's design: flatten to `[1, B*T]`, describe it with `cu_seqlens`
  (`max_segs + 1`, phantom segments), place every segment at a chunk boundary of a static buffer of
  `segments.aligned_length` tokens, reset the state at chunks that start a segment, gather back.

Padding tokens and alignment filler are no-ops (k = v = g = beta = 0), so they never touch the state.
Gradients come from autodiff of this code (the triangular inverse has its own closed-form VJP).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lingpack.kernels.kda import segments
from lingpack.kernels.kda.gate import SUB_CHUNK, check_chunk_size  # decays factored per sub-chunk

ANY_GATE_BASE = 4  # smallest blocks of the any-gate decay products, whose pairs are formed explicitly


def _decay_products(q_NCK, k_NCK, G_NCK, seg_NC, *, sub: int, safe_gate: bool):
    """A_qk[c,i] = sum_d q_cd k_id exp(G_cd - G_id) (i <= c) and A_kk (same with k, i < c), both zero unless c
    and i share a segment; fp32, returned stacked as [.., C, 2, C] (qk, kk). G is the segment-local cumsum, so
    G_c - G_i <= 0 for every kept pair.

    exp(G_c - G_i) overflows if split as exp(G_c) exp(-G_i), so the chunk is split in halves recursively: the
    lower-left quarter of a block (rows in its 2nd half, columns in its 1st) is split at r = the block's middle
    row, exp(G_c - G_r) exp(G_r - G_i), both <= 1 for any gate: one batched matmul per level (a pair can only be
    kept if r shares its segment, so other factors are zeroed). Base blocks of `base` tokens: with `safe_gate`
    (every g >= -5) split at each token's segment start inside the block (a factor <= exp(5 * 15), far below
    fp32's exp(88)); without it the pairs are formed explicitly. Exponents are masked BEFORE exp (NaN-free
    gradients). q and k rows are interleaved so each level is one matmul for both products.
    """
    *outer, C, K = q_NCK.shape
    # one batch axis: XLA:CPU's YNN transposes segfault on arrays of more than 8 dimensions (jaxlib 0.10.2)
    q_NCK, k_NCK, G_NCK = [a.reshape(-1, C, K) for a in (q_NCK, k_NCK, G_NCK)]
    seg_NC = jnp.broadcast_to(seg_NC, (*outer, C)).reshape(-1, C)
    lead = q_NCK.shape[:1]
    base = sub if safe_gate else min(ANY_GATE_BASE, sub)
    size = base * 2 ** max(0, (C // base - 1).bit_length())     # halvable size >= C; pad rows/cols are masked
    if size != C:
        pad = lambda a, value=0: jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, size - C), (0, 0)], constant_values=value)
        q_NCK, k_NCK, G_NCK = pad(q_NCK), pad(k_NCK), pad(G_NCK)
        seg_NC = jnp.pad(seg_NC, [(0, 0)] * (seg_NC.ndim - 1) + [(0, size - C)], constant_values=-1)  # ids are >= 0
    nb = size // base
    q_b, k_b, G_b = [a.reshape(*lead, nb, base, a.shape[-1]) for a in (q_NCK, k_NCK, G_NCK)]
    seg_b = seg_NC.reshape(*seg_NC.shape[:-1], nb, base)
    same_b = seg_b[..., :, None] == seg_b[..., None, :]
    incl = jnp.tril(jnp.ones((base, base), bool)) & same_b
    strict = jnp.tril(jnp.ones((base, base), bool), -1) & same_b
    mask = jnp.stack([incl, strict], axis=-2)                            # [.., nb, base, 2, base]
    if safe_gate:
        starts = jnp.concatenate([jnp.ones_like(seg_b[..., :1], bool), seg_b[..., 1:] != seg_b[..., :-1]], -1)
        ref = jax.lax.cummax(jnp.where(starts, jnp.arange(base), 0), axis=seg_b.ndim - 1)  # segment start in block
        pick = (ref[..., :, None] == jnp.arange(base)).astype(jnp.float32)
        G_ref = jnp.einsum("...tr,...rk->...tk", pick, G_b, precision="highest")  # one-hot gather, exact
        pos = jnp.exp(G_b - G_ref)                                       # exponent <= 0
        A = jnp.einsum("...cxk,...ik->...cxi", jnp.stack([q_b * pos, k_b * pos], -2),
                       k_b * jnp.exp(G_ref - G_b))                       # exponent in [0, 75]
    else:
        decay = jnp.exp(jnp.where(incl[..., None], G_b[..., :, None, :] - G_b[..., None, :, :], 0.0))
        kd = decay * k_b[..., None, :, :]
        A = jnp.stack([jnp.einsum("...ck,...cik->...ci", x, kd) for x in (q_b, k_b)], -2)
    A = jnp.where(mask, A, 0.0)                                          # [.., n, s, 2, s]
    s = base
    while s < size:
        m = size // (2 * s)
        q2, k2, G2 = [a.reshape(*lead, m, 2, s, a.shape[-1]) for a in (q_NCK, k_NCK, G_NCK)]
        seg2 = seg_NC.reshape(*seg_NC.shape[:-1], m, 2, s)
        G_r, seg_r = G2[..., 1, :1, :], seg2[..., 1, :1]                 # the 2nd half's first row
        # exp(-inf) = 0 drops other segments' factors; its derivative is 0 too, so gradients stay finite
        row_decay = jnp.exp(jnp.where((seg2[..., 1, :] == seg_r)[..., None], G2[..., 1, :, :] - G_r, -jnp.inf))
        col_decay = jnp.exp(jnp.where((seg2[..., 0, :] == seg_r)[..., None], G_r - G2[..., 0, :, :], -jnp.inf))
        rows = jnp.stack([q2[..., 1, :, :] * row_decay, k2[..., 1, :, :] * row_decay], -2)
        quarter = jnp.einsum("...cxk,...ik->...cxi", rows, k2[..., 0, :, :] * col_decay)  # [.., m, s, 2, s]
        A2 = A.reshape(*lead, m, 2, s, 2, s)
        top = jnp.concatenate([A2[..., 0, :, :, :], jnp.zeros_like(quarter)], axis=-1)
        bottom = jnp.concatenate([quarter, A2[..., 1, :, :, :]], axis=-1)
        A, s = jnp.concatenate([top, bottom], axis=-3), 2 * s
    return A.reshape(*outer, size, 2, size)[..., :C, :, :C]


def _base_inverse(L_bb):
    """(I + L)^-1 for strictly lower L by forward substitution, one row per step (b steps)."""
    b = L_bb.shape[-1]
    X = jnp.broadcast_to(jnp.eye(b, dtype=L_bb.dtype), L_bb.shape)
    for i in range(1, b):
        X = X.at[..., i, :].add(-jnp.einsum("...j,...jc->...c", L_bb[..., i, :], X))
    return X


@jax.custom_vjp
def unit_lower_inverse(L_CC):
    """(I + L)^-1 for strictly lower L: 16x16 diagonal blocks by substitution, merged pairwise with
    [[A,0],[B,D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]] (matmuls; XLA's batched triangular solve is
    ~70x slower on CPU). Substitution, unlike a Neumann product, stays exact when keys repeat."""
    *lead, C, _ = L_CC.shape
    base = min(SUB_CHUNK, C)
    nb = C // base
    L_blocks = L_CC.reshape(*lead, nb, base, nb, base)
    blocks = list(jnp.moveaxis(_base_inverse(jnp.stack([L_blocks[..., j, :, j, :] for j in range(nb)], -3)), -3, 0))
    size = base
    while len(blocks) > 1:
        merged = []
        for p in range(0, len(blocks), 2):
            r0 = p * size
            lower = -blocks[p + 1] @ L_CC[..., r0 + size:r0 + 2 * size, r0:r0 + size] @ blocks[p]
            top = jnp.concatenate([blocks[p], jnp.zeros_like(blocks[p])], -1)
            merged.append(jnp.concatenate([top, jnp.concatenate([lower, blocks[p + 1]], -1)], -2))
        blocks, size = merged, size * 2
    return blocks[0]


def _inverse_fwd(L_CC):
    X = unit_lower_inverse(L_CC)
    return X, X


def _inverse_bwd(X_CC, dX_CC):
    Xt = jnp.swapaxes(X_CC, -1, -2)
    # d(M^-1) = -M^-1 dM M^-1 with M = I + L; only the strictly lower entries of L are free.
    return (jnp.tril(-(Xt @ dX_CC @ Xt), -1),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def _intra_chunk(q, k, v, g, beta, seg_C, *, sub: int, safe_gate: bool):
    """Everything that does not depend on the carried state, for all chunks at once ([.., H, C, *]).

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
        prefix = (same & jnp.tril(jnp.ones((C, C), bool))).astype(jnp.float32)
        G = jnp.einsum("...ci,...ik->...ck", prefix, g, precision="highest")
    A = _decay_products(q, k, G, seg_C, sub=sub, safe_gate=safe_gate)
    A_qk, A_kk = A[..., :, 0, :], A[..., :, 1, :]
    lower = beta[..., :, None] * A_kk
    # Tm = (I + L)^-1 Diag(beta), L strictly lower (block-diagonal per segment).
    t_mat = unit_lower_inverse(lower) * beta[..., None, :]
    w = t_mat @ (jnp.exp(G) * k)
    u = t_mat @ v
    G_last = G[..., -1:, :]
    in_last = (seg_C == seg_C[..., -1:])[..., None]  # tokens of the chunk's last segment build the outgoing state
    return dict(
        q_decay=q * jnp.exp(G), w=w, u=u, a_qk=A_qk,
        k_out=jnp.where(in_last, jnp.exp(jnp.where(in_last, G_last - G, 0.0)) * k, 0.0),  # exponent <= 0
        decay_last=jnp.exp(G_last[..., 0, :]),   # [.., K]
    )


def _to_chunks(x_BTH_, n_chunks, chunk_size):
    """[B, T, H, *] -> [B, N, H, C, *]."""
    B, T, H = x_BTH_.shape[:3]
    x = x_BTH_.reshape(B, n_chunks, chunk_size, H, *x_BTH_.shape[3:])
    return jnp.moveaxis(x, 2, 3)


def _from_chunks(x_BNHCV):
    B, N, H, C, V = x_BNHCV.shape
    return jnp.moveaxis(x_BNHCV, 3, 2).reshape(B, N * C, H, V)


def _prepare(q, k, v, g, beta, real_BT, scale):
    """fp32 copies with padding turned into no-op tokens."""
    f32 = jnp.float32  # the state and every accumulation are fp32 whatever the input dtype
    m = real_BT[..., None, None]
    return (jnp.where(m, q.astype(f32) * scale, 0.0), jnp.where(m, k.astype(f32), 0.0),
            jnp.where(m, v.astype(f32), 0.0), jnp.where(m, g.astype(f32), 0.0),
            jnp.where(real_BT[..., None], beta.astype(f32), 0.0))


def chunked_segment_native(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, segment_ids_BT, scale,
                           initial_state_BHKV, chunk_size=64, safe_gate=False,
                           sub_chunk=SUB_CHUNK):
    check_chunk_size(chunk_size)
    B, T, H, K = q_BTHK.shape
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
    pre = _intra_chunk(q, k, v, g, beta, ids_BNC[:, :, None], sub=sub_chunk, safe_gate=safe_gate)
    carry = carry_BNC[:, :, None, :, None]
    pre["w"] = pre["w"] * carry
    pre["q_decay"] = pre["q_decay"] * carry
    keep_BN = carry_BNC[..., -1]                       # the whole chunk continues: carry the decayed state on

    def step(state_BHKV, x):
        v_new = x["u"] - x["w"] @ state_BHKV
        decayed = jnp.where(x["keep"][:, None, None, None], x["decay_last"][..., None] * state_BHKV, 0.0)
        return decayed + jnp.swapaxes(x["k_out"], -1, -2) @ v_new, (state_BHKV, v_new)

    pre["keep"] = keep_BN
    chunk_major = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), pre)
    carried = {k: chunk_major[k] for k in ("u", "w", "k_out", "decay_last", "keep")}
    final_BHKV, (states_NBHKV, v_new_NBHCV) = jax.lax.scan(step, initial_state_BHKV.astype(jnp.float32), carried)
    # Outputs need no recurrence: one batched matmul over all chunks once the entering states are known.
    o_NBHCV = chunk_major["q_decay"] @ states_NBHKV + chunk_major["a_qk"] @ v_new_NBHCV
    o_BTHV = _from_chunks(jnp.moveaxis(o_NBHCV, 0, 1))[:, :T]
    return jnp.where(real[..., None, None], o_BTHV, 0.0), final_BHKV


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
    pre = _intra_chunk(q, k, v, g, beta, None, sub=sub_chunk, safe_gate=safe_gate)

    # Initial state per chunk: a row's first segment starts from that row's state, others from zero.
    init_table = jnp.concatenate([initial_state_BHKV.astype(jnp.float32), jnp.zeros((1, H, K, V), jnp.float32)])
    # Capture each row's final state at the chunk holding the end of the row's last segment.
    last_seg = jnp.clip(plan.row_last_seg, 0, max_segs - 1)
    row_final_chunk = jnp.where(plan.row_last_seg >= 0, plan.seg_last_chunk[last_seg], -1)   # [B]

    def step(carry, x):
        state_1HKV, finals_BHKV = carry
        state_1HKV = jnp.where(x["reset"], init_table[x["init_row"]][None], state_1HKV)
        v_new = x["u"] - x["w"] @ state_1HKV
        new_state = x["decay_last"][..., None] * state_1HKV + jnp.swapaxes(x["k_out"], -1, -2) @ v_new
        finals_BHKV = jnp.where((row_final_chunk == x["index"])[:, None, None, None], new_state, finals_BHKV)
        return (new_state, finals_BHKV), (state_1HKV, v_new)

    chunk_major = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), pre)
    carried = {k: chunk_major[k] for k in ("u", "w", "k_out", "decay_last")}
    carried.update(reset=plan.chunk_starts_seg, init_row=plan.chunk_init_row, index=jnp.arange(n_chunks))
    init_carry = (jnp.zeros((1, H, K, V), jnp.float32), initial_state_BHKV.astype(jnp.float32))
    (_, final_BHKV), (states_N1HKV, v_new_N1HCV) = jax.lax.scan(step, init_carry, carried)
    o_N1HCV = chunk_major["q_decay"] @ states_N1HKV + chunk_major["a_qk"] @ v_new_N1HCV  # batched, outside the scan
    o_flat = _from_chunks(jnp.moveaxis(o_N1HCV, 0, 1))[0]                  # [T_new, H, V]
    o_BTHV = jnp.take(o_flat, plan.dest, axis=0, mode="fill", fill_value=0.0).reshape(B, T, H, V)
    return jnp.where(real[..., None, None], o_BTHV, 0.0), final_BHKV
