"""The aligned cu_seqlens layout as Pallas TPU kernels: B=1 flattened, chunk-aligned segments, scalar prefetch.

The batch `[B, T]` is flattened and described by `cu_seqlens` padded to `max_segs + 1` (phantom
segments have zero length); `segments.align_plan` places every segment at a chunk boundary of a static
buffer of `T_new = segments.aligned_length(B*T, max_segs, C)` tokens, so no chunk holds two segments.
Per-chunk metadata goes to SMEM as scalar prefetch:
  slot[n]      the cu_seqlens slot (segment) chunk n belongs to; `max_segs` (a dummy slot) for the
               all-filler chunks after the last segment;
  flags[n]     FIRST: the chunk starts its slot, so the state is reset; LAST: the chunk ends its slot,
               so its state is the slot's final state;
  init_row[n]  the row whose initial state a reset starts from (the slot is its row's first segment),
               else B: block B of `h0_rows` is zeros. Consecutive chunks share the index, so the
               pipeline fetches an initial state only where it changes (per row, not per segment).
Final states are per slot `[max_segs + 1, H, K, V]` (FLA's varlen output), written through the
index_map `slot[n]`; the wrapper reads each row's final state from the slot of its last segment.

Tiles are `(C, K)` of `[T_new, H*K]` (K, V multiples of 128) or `[H, T_new, K]`. Kernels (grid `(H, NT)`,
H "parallel", NT sequential; one head per step) mirror `pallas_segment`: forward (o + final slot states,
and under differentiation each chunk's WY inverse), states (state entering every chunk from the saved
inverses, for the backward), backward (reverse chunk order, dstate in VMEM scratch, dh0 per slot at each
slot's first chunk). The chunk math is `pallas_chunk` without segment masks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lingpack.kernels.kda import api, pallas_shard, segments
from lingpack.kernels.kda import pallas_chunk as chunk
from lingpack.kernels.kda.pallas_common import (TABLE_ROWS, backward_operands, check_head_dims, chunk_order,
                                                forward_operands, fusion_inputs, head_dims, kda_pallas_call,
                                                load_tiles, resolve_interpret, split_backward_refs, split_forward_refs,
                                                store_chunk_grads, table_rows, zero_accumulators)

f32 = jnp.float32
FIRST, LAST = 1, 2


class ChunkTables(NamedTuple):
    slot: jax.Array       # int32 [NT]
    flags: jax.Array      # int32 [NT]
    init_row: jax.Array   # int32 [NT]


def chunk_tables(cu_seqlens, slot_init_row, n_rows: int, n_chunks: int, chunk_size: int) -> ChunkTables:
    """Per-chunk slot, FIRST/LAST flags and initial-state row of the aligned layout (`segments.align_plan`'s
    placement); `slot_init_row` [max_segs] is each slot's row if it is the row's first segment, else
    n_rows (the zero block), which the trailing filler chunks also use."""
    max_segs = cu_seqlens.shape[0] - 1
    span = cu_seqlens[1:] - cu_seqlens[:-1]
    span_chunks = (span + chunk_size - 1) // chunk_size
    first = jnp.cumsum(span_chunks) - span_chunks          # aligned start of each slot, in chunks
    chunk_index = jnp.arange(n_chunks)
    in_use = chunk_index < jnp.sum(span_chunks)
    slot = jnp.sum((span[None, :] > 0) & (first[None, :] <= chunk_index[:, None]), axis=1) - 1
    slot = jnp.clip(slot, 0, max_segs - 1)
    is_first = (in_use & (chunk_index == first[slot])) | (chunk_index == 0)
    is_last = in_use & (chunk_index == first[slot] + span_chunks[slot] - 1)
    return ChunkTables(jnp.where(in_use, slot, max_segs).astype(jnp.int32),
                       (is_first * FIRST + is_last * LAST).astype(jnp.int32),
                       jnp.where(in_use, slot_init_row[slot], n_rows).astype(jnp.int32))


def _forward_kernel(slot_ref, flags_ref, init_row_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, *refs, scale,
                    safe_gate, fusion, emit):
    """emit as in `pallas_segment`: "output", "saving" (+ each chunk's WY inverse), "states" (inverses in)."""
    del slot_ref, init_row_ref  # used by the index_maps only
    gate_ref, inv_in, outs, state_scr = split_forward_refs(refs, fusion, emit)
    n = pl.program_id(1)

    @pl.when((flags_ref[n] & FIRST) != 0)
    def _():
        state_scr[...] = h0_ref[...]

    S = state_scr[...]
    tiles = load_tiles(q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, n, scale, fusion)
    o, S_next, X = chunk.chunk_forward(*tiles.inputs, S, chunk.NO_MASKS, safe_gate, fusion.bulk,
                                       inverse=None if inv_in is None else inv_in[...])
    state_scr[...] = S_next
    if emit == "states":
        outs[0][...] = S
        return
    outs[0][...] = o.astype(outs[0].dtype)
    outs[1][...] = S_next   # the block of this chunk's slot; the slot's last chunk writes last
    if emit == "saving":
        outs[2][...] = X


def _backward_kernel(slot_ref, flags_ref, init_row_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, states_ref, inv_ref,
                     do_ref, dfinal_ref, *refs, scale, safe_gate, fusion):
    del slot_ref, init_row_ref
    gate_ref, (dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dh0_ref), dgate_ref, dstate_scr = split_backward_refs(
        refs, fusion)
    step = pl.program_id(1)
    n = pl.num_programs(1) - 1 - step  # chunks in reverse
    flags = flags_ref[n]

    @pl.when(step == 0)
    def _():
        dstate_scr[...] = jnp.zeros(dstate_scr.shape, f32)
        zero_accumulators(dbeta_ref, dgate_ref)

    is_last = ((flags & LAST) != 0).astype(f32)
    dS_next = dstate_scr[...] + is_last * dfinal_ref[...]
    tiles = load_tiles(q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, n, scale, fusion)
    grads = chunk.chunk_backward(*tiles.inputs, states_ref[...], do_ref[...].astype(f32), dS_next, chunk.NO_MASKS,
                                 safe_gate, fusion.bulk, inverse=inv_ref[...])
    dq, dk, dv, dg, dbeta_row, dS, d_gate = tiles.backward(*grads)
    store_chunk_grads((dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dgate_ref), n, dq, dk, dv, dg, dbeta_row, d_gate)
    is_first = (flags & FIRST) != 0

    @pl.when(is_first)
    def _():   # the initial state fed this chunk: its gradient ends here (block B collects the zero states')
        dh0_ref[...] = dS
        dstate_scr[...] = jnp.zeros(dstate_scr.shape, f32)

    @pl.when(jnp.logical_not(is_first))
    def _():
        dstate_scr[...] = dS


def _specs(H, NT, C, K, V, heads_minor, reverse=False):
    """Tiles (C, K) of [T_new, H*K] when K and V are multiples of 128 (no transpose), else of [H, T_new, K]."""
    chunk_of = chunk_order(NT, reverse)
    if heads_minor:
        tile = lambda d: pl.BlockSpec((C, d), lambda h, n, *_: (chunk_of(n), h))
    else:
        tile = lambda d: pl.BlockSpec((None, C, d), lambda h, n, *_: (h, chunk_of(n), 0))
    gate = pl.BlockSpec((None, 2, K), lambda h, n, *_: (h, 0, 0))
    return dict(
        tile=tile,
        beta=pl.BlockSpec((None, TABLE_ROWS, C), lambda h, n, *_: (h, jax.lax.div(chunk_of(n), TABLE_ROWS), 0)),
        final=pl.BlockSpec((None, None, K, V), lambda h, n, slot, *_: (slot[chunk_of(n)], h, 0, 0)),       # per slot
        initial=pl.BlockSpec((None, None, K, V), lambda h, n, slot, flags, row: (row[chunk_of(n)], h, 0, 0)),  # per row
        per_chunk_state=pl.BlockSpec((None, None, K, V), lambda h, n, *_: (h, chunk_of(n), 0, 0)),
        inverse=pl.BlockSpec((None, None, C, C), lambda h, n, *_: (h, chunk_of(n), 0, 0)),
        gate=gate, gate_grad=gate,
    )


def _dims(q, v, beta_tab):
    """(H, NT, C, K, V, heads_minor) of the kernel operands."""
    H, _, C = beta_tab.shape
    heads_minor = q.ndim == 2
    return (H, q.shape[-2] // C, C, *head_dims(q, v, H, heads_minor), heads_minor)


def _call(kernel, operands, tables, name, kind, dims, safe_gate, fusion, interpret):
    H, NT, C, K, V, heads_minor = dims
    return kda_pallas_call(functools.partial(kernel, safe_gate=safe_gate, fusion=fusion), operands, name=name,
                           kind=kind, grid=(H, NT), scratch=(K, V), C=C, K=K, V=V, heads=1, safe_gate=safe_gate,
                           masked=False, fusion=fusion, interpret=interpret, prefetch=tuple(tables))


def _forward_call(q, k, v, g, beta_tab, tables, h0_rows, gate_tab, n_slots, inverse=None, *, scale, safe_gate, fusion,
                  interpret, emit):
    dims = H, NT, C, K, V, heads_minor = _dims(q, v, beta_tab)
    s = _specs(H, NT, C, K, V, heads_minor)
    operands = forward_operands(s, q, k, v, g, beta_tab, [], h0_rows, gate_tab, inverse, K=K, V=V, emit=emit,
                                fusion=fusion, states_shape=(H, NT, K, V), final_shape=(n_slots, H, K, V),
                                inverse_shape=(H, NT, C, C))
    name = "kda_varlen_states" if emit == "states" else "kda_varlen_fwd"
    return _call(functools.partial(_forward_kernel, scale=scale, emit=emit), operands, tables, name,
                 "states" if emit == "states" else "forward", dims, safe_gate, fusion, interpret)


def _backward_call(q, k, v, g, beta_tab, tables, states, inverse, do, dfinal_slots, gate_tab, n_rows, *, scale,
                   safe_gate, fusion, interpret):
    dims = H, NT, C, K, V, heads_minor = _dims(q, v, beta_tab)
    s = _specs(H, NT, C, K, V, heads_minor, reverse=True)
    operands = backward_operands(s, q, k, v, g, beta_tab, [], states, inverse, do, dfinal_slots, gate_tab, K=K, V=V,
                                 fusion=fusion, dh0_shape=(n_rows, H, K, V), dgate_shape=gate_tab.shape)
    return _call(functools.partial(_backward_kernel, scale=scale), operands, tables, "kda_varlen_bwd", "backward",
                 dims, safe_gate, fusion, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13, 14))
def varlen_core(q, k, v, g, beta_tab, slot, flags, init_row, h0_rows, gate_tab, n_slots, scale, safe_gate, fusion,
                interpret):
    """Kernel layout: q, k, g [T_new, H*K] (or [H, T_new, K]), v likewise, beta_tab [H, NT8, C] fp32, tables int32 [NT],
    h0_rows [B + 1, H, K, V] fp32 (block B zeros), gate_tab [H, 2, K] (fused gate only)
    -> (o in v's layout, final_slots [n_slots, H, K, V] fp32)."""
    return _forward_call(q, k, v, g, beta_tab, ChunkTables(slot, flags, init_row), h0_rows, gate_tab, n_slots,
                         scale=scale, safe_gate=safe_gate, fusion=fusion, interpret=interpret, emit="output")


def _core_fwd(q, k, v, g, beta_tab, slot, flags, init_row, h0_rows, gate_tab, n_slots, scale, safe_gate, fusion,
              interpret):
    # Each chunk's WY inverse is computed once per training step and kept for the states and gradient kernels.
    o, final_slots, inverse = _forward_call(q, k, v, g, beta_tab, ChunkTables(slot, flags, init_row), h0_rows,
                                            gate_tab, n_slots, scale=scale, safe_gate=safe_gate, fusion=fusion,
                                            interpret=interpret, emit="saving")
    return (o, final_slots), (q, k, v, g, beta_tab, slot, flags, init_row, h0_rows, gate_tab, inverse)


def _core_bwd(n_slots, scale, safe_gate, fusion, interpret, residuals, cotangents):
    q, k, v, g, beta_tab, slot, flags, init_row, h0_rows, gate_tab, inverse = residuals
    do, dfinal_slots = cotangents
    static = dict(scale=scale, safe_gate=safe_gate, fusion=fusion, interpret=interpret)
    tables = ChunkTables(slot, flags, init_row)
    (states,) = _forward_call(q, k, v, g, beta_tab, tables, h0_rows, gate_tab, n_slots, inverse, emit="states",
                              **static)
    dq, dk, dv, dg, dbeta, dh0_rows, *dgate = _backward_call(
        q, k, v, g, beta_tab, tables, states, inverse, do.astype(v.dtype), dfinal_slots.astype(f32), gate_tab,
        h0_rows.shape[0], **static)
    # Rows without a segment never reset from their block: it is unwritten (the wrapper masks it).
    return (dq, dk, dv, dg, dbeta, None, None, None, dh0_rows, dgate[0] if dgate else jnp.zeros_like(gate_tab))


varlen_core.defvjp(_core_fwd, _core_bwd)


class AlignedLayout(NamedTuple):
    plan: segments.AlignPlan
    t_new: int
    n_chunks: int
    tables: ChunkTables


def aligned_layout(segment_ids_BT, max_segs: int, chunk_size: int) -> AlignedLayout:
    """The aligned buffer and the scalar-prefetch tables of a batch (also used by experiments/pallas_cost)."""
    B, T = segment_ids_BT.shape
    total = B * T
    plan = segments.align_plan(segment_ids_BT, max_segs, chunk_size)
    t_new = segments.aligned_length(total, max_segs, chunk_size)
    # A row's first segment starts from the row's initial state, every other segment from zeros (block B).
    starts = segments.segment_starts(segment_ids_BT).reshape(-1)
    (start_pos,) = jnp.nonzero(starts, size=max_segs, fill_value=total)
    first_in_row = (start_pos % T == 0) & (start_pos < total)
    slot_init_row = jnp.where(first_in_row, start_pos // T, B)
    tables = chunk_tables(plan.cu_seqlens, slot_init_row, B, t_new // chunk_size, chunk_size)
    return AlignedLayout(plan, t_new, t_new // chunk_size, tables)


def pallas_varlen_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, segment_ids_BT, scale, initial_state_BHKV,
                      max_segs, chunk_size=64, safe_gate=False, interpret=None, use_gate_in_kernel=False, A_log=None,
                      dt_bias=None, lower_bound=None, use_qk_l2norm_in_kernel=False, precision=None):
    """`api.chunk_kda(impl="pallas_varlen")`: same arguments and semantics as `chunked.chunked_aligned`; the
    fused gate / L2 norm options as in `pallas_segment.pallas_segment_kda`."""
    interpret = resolve_interpret(interpret)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    check_head_dims(K, V, chunk_size)
    fusion, gate_tab, safe_gate = fusion_inputs(H, K, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                                                use_qk_l2norm_in_kernel, safe_gate, precision, v_BTHV.dtype)
    total = B * T
    layout = aligned_layout(segment_ids_BT, max_segs, chunk_size)
    plan, t_new, n_chunks = layout.plan, layout.t_new, layout.n_chunks
    real = segment_ids_BT != 0

    heads_minor = K % 128 == 0 and V % 128 == 0   # (C, K) tiles of [T_new, H*K]: the scatter's own layout

    def aligned(x, fill=0.0, heads_minor=heads_minor):
        """[B, T, H, *] -> [T_new, H*] (or [H, T_new, *]): padding and alignment filler become no-op tokens."""
        fill = jnp.asarray(fill, x.dtype)
        x = jnp.where(real.reshape(B, T, *([1] * (x.ndim - 2))), x, fill)
        flat = x.reshape(total, *x.shape[2:])
        buf = jnp.full((t_new,) + flat.shape[1:], fill, x.dtype).at[plan.dest].set(flat, mode="drop")
        return buf.reshape(t_new, -1) if heads_minor else jnp.moveaxis(buf, 1, 0)

    q, k, v = [aligned(x) for x in (q_BTHK, k_BTHK, v_BTHV)]
    g = aligned(g_BTHK, chunk.PADDING_GATE_RAW if fusion.gate else 0.0)
    beta_tab = aligned(beta_BTH.astype(f32), heads_minor=False).reshape(H, n_chunks, chunk_size)   # fp32
    beta_tab = jnp.pad(beta_tab, [(0, 0), (0, table_rows(n_chunks) - n_chunks), (0, 0)])

    has_segment = plan.row_last_seg >= 0
    h0 = initial_state_BHKV.astype(f32)
    # Masking rows without a segment also drops their (never written) dh0 blocks from the gradient.
    h0_rows = jnp.concatenate([jnp.where(has_segment[:, None, None, None], h0, 0.0), jnp.zeros((1, H, K, V), f32)])

    o, final_slots = varlen_core(q, k, v, g, beta_tab, *layout.tables, h0_rows, gate_tab, max_segs + 1, float(scale),
                                 bool(safe_gate), fusion, interpret)
    o_flat = o.reshape(t_new, H, V) if heads_minor else jnp.moveaxis(o, 0, 1)   # [T_new, H, V]
    o_BTHV = jnp.take(o_flat, plan.dest, axis=0, mode="fill", fill_value=0).reshape(B, T, H, V)
    final = jnp.where(has_segment[:, None, None, None], final_slots[jnp.clip(plan.row_last_seg, 0, max_segs - 1)], h0)
    return jnp.where(real[..., None, None], o_BTHV, 0), final


api.register("pallas_varlen", pallas_shard.over_mesh(pallas_varlen_kda), needs_max_segs=True, fuses_gate=True)
