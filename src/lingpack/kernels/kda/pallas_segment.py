"""Segment-native Pallas TPU KDA (docs/design.md#segment-native-chunking): segment ids go straight into the kernel.

Rows stay `[B, T]` (any B); T is padded to a chunk multiple, nothing else: no flattening, no phantom
segments, no alignment. Each kernel step reads its chunk's segment ids from a per-row id table
`[B, NT8, C]` (2 * local segment number + real-token bit, fetched 8 chunks per block; the local number
counts segment starts since the token before the chunk, so 0 = the segment the incoming state belongs
to and a chunk needs no other chunk's ids) and builds the masks of `pallas_chunk.segment_masks`
(pairs in the same segment, tokens that continue the incoming state's segment, tokens of the chunk's
last segment), so a document boundary anywhere inside a chunk resets the state exactly; padding tokens
are made no-ops in the kernel (output 0, no decay, no write).

A grid step runs one chunk of `heads` heads of one row (`heads_per_step`: up to 4), sharing the
segment masks. Tiles are `(C, heads*K)` of the free reshape `[B, T, H*K]` when K and V are multiples of
128 (no transpose around the kernels), else `(heads, C, K)` of `[B, H, T, K]` (transposed in the
wrapper). Kernels (grid `(B * H / heads, NT)`: rows x head groups "parallel" in one leading axis, which
megacore chips split over their two cores; the NT chunks "arbitrary", i.e. sequential):
  forward   states `[heads, K, V]` fp32 in VMEM scratch carried over chunks; emits o and the final state
            and, under differentiation, each chunk's WY inverse `[B, H, NT, C, C]` fp32 (as large as a bf16
            q at C = K), so no later kernel recomputes it.
  states    the forward's state recurrence again from the saved inverses, emitting the state entering
            every chunk `[B, H, NT, K, V]` fp32 (run by the backward only: no state-sized residual).
  backward  chunks in reverse (index_map NT-1-n); dstate fp32 in VMEM scratch; each step recomputes the
            chunk's decay products from its inputs, entering state and saved inverse and emits
            dq, dk, dv, dg, dbeta; dh0 is the dstate left after chunk 0.
The chunk math and its backward derivation are in `pallas_chunk`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lingpack.kernels.kda import api, pallas_shard, segments
from lingpack.kernels.kda import pallas_chunk as chunk
from lingpack.kernels.kda.pallas_common import (TABLE_ROWS, backward_operands, check_head_dims, chunk_order,
                                                forward_operands, from_heads, fusion_inputs, head_dims, heads_per_step,
                                                kda_pallas_call, load_tiles, resolve_interpret, split_backward_refs,
                                                split_forward_refs, store_chunk_grads, table_row, table_rows, to_heads,
                                                zero_accumulators)

f32 = jnp.float32


def _segment_masks(ids_ref, n):
    """Chunk n's segment masks and real-token row from the table of 2 * (local segment number) + (token is real)."""
    code = ids_ref[...]   # TABLE_ROWS chunks; numbers <= C are exact in fp32 (fp32 reductions lower everywhere)
    ids_row = table_row(jax.lax.div(code, 2).astype(f32), n)
    real_row = table_row(jax.lax.rem(code, 2).astype(f32), n)
    return chunk.segment_masks(ids_row, jnp.zeros((1, 1), f32)), real_row


def _per_head(heads_minor):
    """Head j's view of a step's block: a lane slice of a (C, heads*d) tile, or the j-th of stacked blocks."""
    def view(ref, j, d=None):
        return ref.at[:, pl.ds(j * d, d)] if heads_minor and d is not None else ref.at[j]
    return view


def _forward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, ids_ref, h0_ref, *refs, scale, safe_gate, fusion, emit,
                    heads, heads_minor):
    """emit: "output" (o, final), "saving" (o, final, and each chunk's WY inverse for the backward), "states"
    (reads the saved inverses, writes the state entering each chunk)."""
    gate_ref, inv_in, outs, state_scr = split_forward_refs(refs, fusion, emit)
    K, V = state_scr.shape[1:]
    at = _per_head(heads_minor)
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
        state_scr[...] = h0_ref[...].astype(f32)

    masks, real_row = _segment_masks(ids_ref, n)   # built once per step, shared by its heads
    for j in range(heads):
        tiles = load_tiles(at(q_ref, j, K), at(k_ref, j, K), at(v_ref, j, V), at(g_ref, j, K), at(beta_ref, j),
                           None if gate_ref is None else at(gate_ref, j), n, scale, fusion, real_row)
        S = state_scr[j]
        o, S_next, X = chunk.chunk_forward(*tiles.inputs, S, masks, safe_gate, fusion.bulk,
                                           inverse=None if inv_in is None else inv_in[j])
        state_scr[j] = S_next
        if emit == "states":
            outs[0][j] = S
            continue
        at(outs[0], j, V)[...] = tiles.mask_rows(o).astype(outs[0].dtype)   # padding outputs 0
        if emit == "saving":
            outs[2][j] = X

    if emit != "states":
        @pl.when(n == pl.num_programs(1) - 1)
        def _():
            outs[1][...] = state_scr[...]


def _backward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, ids_ref, states_ref, inv_ref, do_ref, dfinal_ref, *refs,
                     scale, safe_gate, fusion, heads, heads_minor):
    gate_ref, (dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dh0_ref), dgate_ref, dstate_scr = split_backward_refs(
        refs, fusion)
    K, V = dstate_scr.shape[1:]
    at = _per_head(heads_minor)
    step = pl.program_id(1)
    n_chunks = pl.num_programs(1)
    n = n_chunks - 1 - step  # chunks in reverse

    @pl.when(step == 0)
    def _():
        dstate_scr[...] = dfinal_ref[...]
        zero_accumulators(dbeta_ref, dgate_ref)

    masks, real_row = _segment_masks(ids_ref, n)   # built once per step, shared by its heads
    for j in range(heads):
        tiles = load_tiles(at(q_ref, j, K), at(k_ref, j, K), at(v_ref, j, V), at(g_ref, j, K), at(beta_ref, j),
                           None if gate_ref is None else at(gate_ref, j), n, scale, fusion, real_row)
        grads = chunk.chunk_backward(*tiles.inputs, states_ref[j], tiles.mask_rows(at(do_ref, j, V)[...].astype(f32)),
                                     dstate_scr[j], masks, safe_gate, fusion.bulk, inverse=inv_ref[j])
        dq, dk, dv, dg, dbeta_row, dS, d_gate = tiles.backward(*grads)
        dstate_scr[j] = dS
        store_chunk_grads((at(dq_ref, j, K), at(dk_ref, j, K), at(dv_ref, j, V), at(dg_ref, j, K), at(dbeta_ref, j),
                           None if dgate_ref is None else at(dgate_ref, j)), n, dq, dk, dv, dg, dbeta_row, d_gate)

    @pl.when(step == n_chunks - 1)
    def _():
        dh0_ref[...] = dstate_scr[...]


def _specs(B, H, heads, NT, C, K, V, heads_minor, reverse=False):
    """BlockSpecs over the grid (B * H / heads, NT): `heads` heads of one row per step, chunk tables 8 per block.

    heads_minor: tiles of the free reshape [B, T, H*K] (block (C, heads*K), legal when K and V are multiples
    of 128: no transposes around the kernels); else of [B, H, T, K] (blocks (heads, C, K), K the full dim).
    """
    groups = H // heads
    row, group = (lambda i: jax.lax.div(i, groups)), (lambda i: jax.lax.rem(i, groups))
    chunk_of = chunk_order(NT, reverse)
    table_block = lambda n: jax.lax.div(chunk_of(n), TABLE_ROWS)
    if heads_minor:
        tile = lambda d: pl.BlockSpec((None, C, heads * d), lambda i, n: (row(i), chunk_of(n), group(i)))
    else:
        tile = lambda d: pl.BlockSpec((None, heads, C, d), lambda i, n: (row(i), group(i), chunk_of(n), 0))
    per_chunk = lambda a, b: pl.BlockSpec((None, heads, None, a, b), lambda i, n: (row(i), group(i), chunk_of(n), 0, 0))
    state = pl.BlockSpec((None, heads, K, V), lambda i, n: (row(i), group(i), 0, 0))
    return dict(
        tile=tile,
        beta=pl.BlockSpec((None, heads, TABLE_ROWS, C), lambda i, n: (row(i), group(i), table_block(n), 0)),
        ids=pl.BlockSpec((None, TABLE_ROWS, C), lambda i, n: (row(i), table_block(n), 0)),
        initial=state, final=state,
        per_chunk_state=per_chunk(K, V),
        inverse=per_chunk(C, C),
        gate=pl.BlockSpec((heads, 2, K), lambda i, n: (group(i), 0, 0)),
        gate_grad=pl.BlockSpec((None, heads, 2, K), lambda i, n: (row(i), group(i), 0, 0)),
    )


def _dims(q, v, beta_tab):
    """(B, H, heads per step, NT, C, K, V, heads_minor) of the kernel operands."""
    B, H, _, C = beta_tab.shape
    heads_minor = q.ndim == 3
    return (B, H, heads_per_step(B, H), q.shape[-2] // C, C, *head_dims(q, v, H, heads_minor), heads_minor)


def _call(kernel, operands, name, kind, dims, safe_gate, fusion, interpret):
    B, H, heads, NT, C, K, V, heads_minor = dims
    kernel = functools.partial(kernel, safe_gate=safe_gate, fusion=fusion, heads=heads, heads_minor=heads_minor)
    return kda_pallas_call(kernel, operands, name=name, kind=kind, grid=(B * H // heads, NT), scratch=(heads, K, V),
                           C=C, K=K, V=V, heads=heads, safe_gate=safe_gate, masked=True, fusion=fusion,
                           interpret=interpret)


def _forward_call(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, inverse=None, *, scale, safe_gate, fusion, interpret,
                  emit):
    dims = B, H, heads, NT, C, K, V, heads_minor = _dims(q, v, beta_tab)
    s = _specs(B, H, heads, NT, C, K, V, heads_minor)
    operands = forward_operands(s, q, k, v, g, beta_tab, [(s["ids"], ids_tab)], h0, gate_tab, inverse, K=K, V=V,
                                emit=emit, fusion=fusion, states_shape=(B, H, NT, K, V), final_shape=(B, H, K, V),
                                inverse_shape=(B, H, NT, C, C))
    name = "kda_segment_states" if emit == "states" else "kda_segment_fwd"
    return _call(functools.partial(_forward_kernel, scale=scale, emit=emit), operands, name,
                 "states" if emit == "states" else "forward", dims, safe_gate, fusion, interpret)


def _backward_call(q, k, v, g, beta_tab, ids_tab, states, inverse, do, dfinal, gate_tab, *, scale, safe_gate, fusion,
                   interpret):
    dims = B, H, heads, NT, C, K, V, heads_minor = _dims(q, v, beta_tab)
    s = _specs(B, H, heads, NT, C, K, V, heads_minor, reverse=True)
    operands = backward_operands(s, q, k, v, g, beta_tab, [(s["ids"], ids_tab)], states, inverse, do, dfinal,
                                 gate_tab, K=K, V=V, fusion=fusion, dh0_shape=(B, H, K, V), dgate_shape=(B, H, 2, K))
    return _call(functools.partial(_backward_kernel, scale=scale), operands, "kda_segment_bwd", "backward", dims,
                 safe_gate, fusion, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def segment_core(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, scale, safe_gate, fusion, interpret):
    """Kernel layout in and out: q, k, g [B, Tp, H*K] (or [B, H, Tp, K]), v likewise, beta_tab [B, H, NT8, C]
    fp32, ids_tab [B, NT8, C] int32 (2 * local segment number + real), h0 [B, H, K, V] fp32, gate_tab [H, 2, K]
    fp32 (used with a fused gate) -> (o in v's layout, final [B, H, K, V] fp32)."""
    return _forward_call(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, scale=scale, safe_gate=safe_gate, fusion=fusion,
                         interpret=interpret, emit="output")


def _core_fwd(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, scale, safe_gate, fusion, interpret):
    # The WY inverses [B, H, NT, C, C] fp32 (as large as a bf16 copy of q at C = K) are kept for the backward:
    # each chunk's inverse is computed once per training step, not again by the states and gradient kernels.
    o, final, inverse = _forward_call(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, scale=scale, safe_gate=safe_gate,
                                      fusion=fusion, interpret=interpret, emit="saving")
    return (o, final), (q, k, v, g, beta_tab, ids_tab, h0, gate_tab, inverse)


def _core_bwd(scale, safe_gate, fusion, interpret, residuals, cotangents):
    q, k, v, g, beta_tab, ids_tab, h0, gate_tab, inverse = residuals
    do, dfinal = cotangents
    static = dict(scale=scale, safe_gate=safe_gate, fusion=fusion, interpret=interpret)
    (states,) = _forward_call(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, inverse, emit="states", **static)
    dq, dk, dv, dg, dbeta, dh0, *dgate = _backward_call(q, k, v, g, beta_tab, ids_tab, states, inverse,
                                                        do.astype(v.dtype), dfinal.astype(f32), gate_tab, **static)
    dgate_tab = jnp.sum(dgate[0], axis=0) if dgate else jnp.zeros_like(gate_tab)   # per-row partial sums
    return dq, dk, dv, dg, dbeta, None, dh0.astype(h0.dtype), dgate_tab


segment_core.defvjp(_core_fwd, _core_bwd)


def pallas_segment_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, segment_ids_BT, scale, initial_state_BHKV,
                       chunk_size=64, safe_gate=False, interpret=None, use_gate_in_kernel=False, A_log=None,
                       dt_bias=None, lower_bound=None, use_qk_l2norm_in_kernel=False, precision=None):
    """`api.chunk_kda(impl="pallas_segment")`: same arguments and semantics as `chunked.chunked_segment_native`.

    With `use_gate_in_kernel` (g holds the raw gate; `A_log`, `dt_bias`, `lower_bound` as in `gate.kda_gate`)
    and/or `use_qk_l2norm_in_kernel`, the gate and the L2 norm are computed inside the kernels.
    """
    interpret = resolve_interpret(interpret)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    check_head_dims(K, V, chunk_size)
    fusion, gate_tab, safe_gate = fusion_inputs(H, K, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                                                use_qk_l2norm_in_kernel, safe_gate, precision, v_BTHV.dtype)
    NT = -(-T // chunk_size)
    pad = NT * chunk_size - T
    real = segment_ids_BT != 0
    # Each row's segments are numbered by a running count of segment starts (any id values work); padding keeps
    # its row's last number and continues that segment as no-op tokens (made so in the kernel): the final state
    # is the state after the row's last real token. The tail filler up to a chunk multiple is padding too.
    # Numbers are taken relative to the segment entering each chunk (that of the token before it; for chunk 0
    # the row's first), so they are <= C and exact in the kernel's fp32 compares.
    numbered = jnp.cumsum(segments.segment_starts(segment_ids_BT), axis=1, dtype=jnp.int32)
    filled = jnp.pad(numbered, [(0, 0), (0, pad)], mode="edge").reshape(B, NT, chunk_size)
    entering = jnp.concatenate([filled[:, :1, :1], filled[:, :-1, -1:]], axis=1)
    NT8 = table_rows(NT)
    ids_tab = 2 * (filled - entering) + jnp.pad(real.astype(jnp.int32), [(0, 0), (0, pad)]).reshape(B, NT, -1)
    ids_tab = jnp.pad(ids_tab, [(0, 0), (0, NT8 - NT), (0, 0)])
    heads_minor = K % 128 == 0 and V % 128 == 0   # (C, K) tiles of [B, T, H*K]: a free reshape, no transpose
    if heads_minor:
        layout = lambda x: jnp.pad(x.reshape(B, T, -1), [(0, 0), (0, pad), (0, 0)]) if pad else x.reshape(B, T, -1)
    else:
        layout = lambda x: to_heads(x, pad)
    beta_tab = jnp.pad(jnp.moveaxis(beta_BTH.astype(f32), 2, 1), [(0, 0), (0, 0), (0, (NT8 - NT) * chunk_size + pad)]
                       ).reshape(B, H, NT8, chunk_size)   # beta stays fp32 (the erase strength)
    o, final = segment_core(layout(q_BTHK), layout(k_BTHK), layout(v_BTHV), layout(g_BTHK), beta_tab, ids_tab,
                            initial_state_BHKV.astype(f32), gate_tab, float(scale), bool(safe_gate), fusion, interpret)
    o = o[:, :T].reshape(B, T, H, V) if heads_minor else from_heads(o, T)
    return o, final   # padding rows are written as 0 by the kernel


api.register("pallas_segment", pallas_shard.over_mesh(pallas_segment_kda), fuses_gate=True)
