"""The seed RFC's varlen design as Pallas TPU kernels: B=1 flattened, chunk-aligned segments, scalar prefetch.

The batch `[B, T]` is flattened and described by `cu_seqlens` padded to `max_segs + 1` (phantom
segments have zero length); `segments.align_plan` places every segment at a chunk boundary of a static
buffer of `T_new = segments.aligned_length(B*T, max_segs, C)` tokens, so no chunk holds two segments.
Per-chunk metadata goes to SMEM as scalar prefetch:
  slot[n]   the cu_seqlens slot (segment) chunk n belongs to; `max_segs` (a dummy slot) for the
            all-filler chunks after the last segment;
  flags[n]  FIRST: the chunk starts its slot (the state is reset to that slot's initial state, which
            the index_map of `h0_slots` fetches); LAST: the chunk ends its slot (its state is the slot's
            final state, written through the index_map of `final_slots`).
Initial and final states are per slot `[max_segs + 1, H, K, V]` like FLA's varlen API; the wrapper maps
a row's initial state to the slot of the row's first segment and reads each row's final state from the
slot of its last segment.

Kernels (layout `[H, T_new, K]`, grid `(H, NT)`, NT sequential) mirror `pallas_segment`: forward
(o + final slot states), states (state entering every chunk, for the backward), backward (reverse
chunk order, dstate in VMEM scratch, dh0 per slot at each slot's first chunk). The chunk math is
`pallas_chunk` without segment masks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lingpack.kernels.kda import api, segments
from lingpack.kernels.kda import pallas_chunk as chunk
from lingpack.kernels.kda.pallas_common import (check_head_dims, compiler_params, resolve_interpret, set_table_row,
                                                table_row)

f32 = jnp.float32
FIRST, LAST = 1, 2
SEMANTICS = ("parallel", "arbitrary")


class ChunkTables(NamedTuple):
    slot: jax.Array    # int32 [NT]
    flags: jax.Array   # int32 [NT]


def chunk_tables(cu_seqlens, n_chunks: int, chunk_size: int) -> ChunkTables:
    """Per-chunk slot and FIRST/LAST flags of the aligned layout (the placement of `segments.align_plan`)."""
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
                       (is_first * FIRST + is_last * LAST).astype(jnp.int32))


def _tiles(q_ref, k_ref, v_ref, g_ref, beta_ref, n, scale):
    return (q_ref[...].astype(f32) * scale, k_ref[...].astype(f32), v_ref[...].astype(f32), g_ref[...].astype(f32),
            table_row(beta_ref[...].astype(f32), n))


def _forward_kernel(slot_ref, flags_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, *refs, scale, safe_gate,
                    emit_states):
    del slot_ref  # used by the index_maps only
    if emit_states:
        states_ref, state_scr = refs
    else:
        o_ref, final_ref, state_scr = refs
    n = pl.program_id(1)

    @pl.when((flags_ref[n] & FIRST) != 0)
    def _():
        state_scr[...] = h0_ref[...]

    S = state_scr[...]
    o, S_next = chunk.chunk_forward(*_tiles(q_ref, k_ref, v_ref, g_ref, beta_ref, n, scale), S, chunk.NO_MASKS,
                                    safe_gate)
    state_scr[...] = S_next
    if emit_states:
        states_ref[...] = S
    else:
        o_ref[...] = o.astype(o_ref.dtype)
        final_ref[...] = S_next   # the block of this chunk's slot; the slot's last chunk writes last


def _backward_kernel(slot_ref, flags_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, states_ref, do_ref, dfinal_ref,
                     dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dh0_ref, dstate_scr, *, scale, safe_gate):
    del slot_ref
    step = pl.program_id(1)
    n = pl.num_programs(1) - 1 - step  # chunks in reverse
    flags = flags_ref[n]

    @pl.when(step == 0)
    def _():
        dstate_scr[...] = jnp.zeros(dstate_scr.shape, f32)
        dbeta_ref[...] = jnp.zeros(dbeta_ref.shape, dbeta_ref.dtype)

    is_last = ((flags & LAST) != 0).astype(f32)
    dS_next = dstate_scr[...] + is_last * dfinal_ref[...]
    dq, dk, dv, dg, dbeta_row, dS = chunk.chunk_backward(
        *_tiles(q_ref, k_ref, v_ref, g_ref, beta_ref, n, scale), states_ref[...], do_ref[...].astype(f32), dS_next,
        chunk.NO_MASKS, safe_gate)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dg_ref[...] = dg.astype(dg_ref.dtype)
    set_table_row(dbeta_ref, n, dbeta_row)
    is_first = (flags & FIRST) != 0

    @pl.when(is_first)
    def _():   # the slot's initial state fed this chunk: its gradient ends here, nothing flows further back
        dh0_ref[...] = dS
        dstate_scr[...] = jnp.zeros(dstate_scr.shape, f32)

    @pl.when(jnp.logical_not(is_first))
    def _():
        dstate_scr[...] = dS


def _specs(H, NT, C, K, V, reverse=False):
    chunk_of = (lambda n: NT - 1 - n) if reverse else (lambda n: n)
    return dict(
        tile=lambda d: pl.BlockSpec((None, C, d), lambda h, n, slot, flags: (h, chunk_of(n), 0)),
        beta=pl.BlockSpec((None, NT, C), lambda h, n, slot, flags: (h, 0, 0)),
        slot_state=pl.BlockSpec((None, None, K, V), lambda h, n, slot, flags: (slot[chunk_of(n)], h, 0, 0)),
        per_chunk_state=pl.BlockSpec((None, None, K, V), lambda h, n, slot, flags: (h, chunk_of(n), 0, 0)),
    )


def _forward_call(q, k, v, g, beta_tab, tables, h0_slots, *, scale, safe_gate, interpret, emit_states):
    H, T_new, K = q.shape
    V = v.shape[-1]
    NT = beta_tab.shape[1]
    s = _specs(H, NT, T_new // NT, K, V)
    if emit_states:
        out_shape, out_specs = jax.ShapeDtypeStruct((H, NT, K, V), f32), s["per_chunk_state"]
    else:
        out_shape = (jax.ShapeDtypeStruct((H, T_new, V), v.dtype), jax.ShapeDtypeStruct(h0_slots.shape, f32))
        out_specs = (s["tile"](V), s["slot_state"])
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(H, NT),
        in_specs=[s["tile"](K), s["tile"](K), s["tile"](V), s["tile"](K), s["beta"], s["slot_state"]],
        out_specs=out_specs, scratch_shapes=[pltpu.VMEM((K, V), f32)])
    return pl.pallas_call(
        functools.partial(_forward_kernel, scale=scale, safe_gate=safe_gate, emit_states=emit_states),
        grid_spec=grid_spec, out_shape=out_shape, compiler_params=compiler_params(*SEMANTICS), interpret=interpret,
        name="kda_varlen_states" if emit_states else "kda_varlen_fwd",
    )(tables.slot, tables.flags, q, k, v, g, beta_tab, h0_slots)


def _backward_call(q, k, v, g, beta_tab, tables, states, do, dfinal_slots, *, scale, safe_gate, interpret):
    H, T_new, K = q.shape
    V = v.shape[-1]
    NT = beta_tab.shape[1]
    s = _specs(H, NT, T_new // NT, K, V, reverse=True)
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype),
                 jax.ShapeDtypeStruct(beta_tab.shape, f32), jax.ShapeDtypeStruct(dfinal_slots.shape, f32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(H, NT),
        in_specs=[s["tile"](K), s["tile"](K), s["tile"](V), s["tile"](K), s["beta"], s["per_chunk_state"],
                  s["tile"](V), s["slot_state"]],
        out_specs=(s["tile"](K), s["tile"](K), s["tile"](V), s["tile"](K), s["beta"], s["slot_state"]),
        scratch_shapes=[pltpu.VMEM((K, V), f32)])
    return pl.pallas_call(
        functools.partial(_backward_kernel, scale=scale, safe_gate=safe_gate),
        grid_spec=grid_spec, out_shape=out_shape, compiler_params=compiler_params(*SEMANTICS), interpret=interpret,
        name="kda_varlen_bwd",
    )(tables.slot, tables.flags, q, k, v, g, beta_tab, states, do, dfinal_slots)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def varlen_core(q, k, v, g, beta_tab, slot, flags, h0_slots, scale, safe_gate, interpret):
    """Kernel layout: q, k, g [H, T_new, K], v [H, T_new, V], beta_tab [H, NT, C] fp32, slot/flags int32 [NT],
    h0_slots [max_segs + 1, H, K, V] fp32 -> (o [H, T_new, V], final_slots [max_segs + 1, H, K, V] fp32)."""
    return _forward_call(q, k, v, g, beta_tab, ChunkTables(slot, flags), h0_slots, scale=scale, safe_gate=safe_gate,
                         interpret=interpret, emit_states=False)


def _core_fwd(q, k, v, g, beta_tab, slot, flags, h0_slots, scale, safe_gate, interpret):
    out = varlen_core(q, k, v, g, beta_tab, slot, flags, h0_slots, scale, safe_gate, interpret)
    return out, (q, k, v, g, beta_tab, slot, flags, h0_slots)


def _core_bwd(scale, safe_gate, interpret, residuals, cotangents):
    q, k, v, g, beta_tab, slot, flags, h0_slots = residuals
    do, dfinal_slots = cotangents
    static = dict(scale=scale, safe_gate=safe_gate, interpret=interpret)
    tables = ChunkTables(slot, flags)
    states = _forward_call(q, k, v, g, beta_tab, tables, h0_slots, emit_states=True, **static)
    dq, dk, dv, dg, dbeta, dh0_slots = _backward_call(q, k, v, g, beta_tab, tables, states, do.astype(v.dtype),
                                                      dfinal_slots.astype(f32), **static)
    return dq, dk, dv, dg, dbeta, None, None, dh0_slots


varlen_core.defvjp(_core_fwd, _core_bwd)


def pallas_varlen_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, segment_ids_BT, scale, initial_state_BHKV,
                      max_segs, chunk_size=64, safe_gate=False, interpret=None):
    """`api.chunk_kda(impl="pallas_varlen")`: same arguments and semantics as `chunked.chunked_aligned`."""
    interpret = resolve_interpret(interpret)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    check_head_dims(K, V, chunk_size)
    total = B * T
    plan = segments.align_plan(segment_ids_BT, max_segs, chunk_size)
    t_new = segments.aligned_length(total, max_segs, chunk_size)
    n_chunks = t_new // chunk_size
    real = segment_ids_BT != 0

    def aligned(x):
        """[B, T, H, *] -> [H, T_new, *]: padding zeroed (no-op tokens), alignment filler zero."""
        x = jnp.where(real.reshape(B, T, *([1] * (x.ndim - 2))), x, jnp.zeros((), x.dtype))
        flat = x.reshape(total, *x.shape[2:])
        buf = jnp.zeros((t_new,) + flat.shape[1:], x.dtype).at[plan.dest].set(flat, mode="drop")
        return jnp.moveaxis(buf, 1, 0)

    q, k, v, g = [aligned(x) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK)]
    beta_tab = aligned(beta_BTH.astype(f32)).reshape(H, n_chunks, chunk_size)   # beta stays fp32
    tables = chunk_tables(plan.cu_seqlens, n_chunks, chunk_size)

    # Slot initial states: a row's first segment starts from the row's initial state, the others from zero.
    starts = segments.segment_starts(segment_ids_BT).reshape(-1)
    (start_pos,) = jnp.nonzero(starts, size=max_segs, fill_value=total)
    first_in_row = (start_pos % T == 0) & (start_pos < total)
    h0 = initial_state_BHKV.astype(f32)
    h0_slots = jnp.where(first_in_row[:, None, None, None], h0[jnp.minimum(start_pos // T, B - 1)], 0.0)
    h0_slots = jnp.concatenate([h0_slots, jnp.zeros((1, H, K, V), f32)])   # the dummy slot of trailing filler

    o, final_slots = varlen_core(q, k, v, g, beta_tab, tables.slot, tables.flags, h0_slots, float(scale),
                                 bool(safe_gate), interpret)
    o_flat = jnp.moveaxis(o, 0, 1)                                        # [T_new, H, V]
    o_BTHV = jnp.take(o_flat, plan.dest, axis=0, mode="fill", fill_value=0).reshape(B, T, H, V)
    has_segment = plan.row_last_seg >= 0
    final = jnp.where(has_segment[:, None, None, None],
                      final_slots[jnp.clip(plan.row_last_seg, 0, max_segs - 1)], h0)
    return jnp.where(real[..., None, None], o_BTHV, 0), final


api.register("pallas_varlen", pallas_varlen_kda, needs_max_segs=True)
