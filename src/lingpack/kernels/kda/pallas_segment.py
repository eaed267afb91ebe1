"""Segment-native Pallas TPU KDA ("Alt1" of the seed RFC): segment ids go straight into the kernel.

Rows stay `[B, T]` (any B); T is padded to a chunk multiple, nothing else: no flattening, no phantom
segments, no alignment. Each kernel step reads its chunk's segment ids and builds the masks of
`pallas_chunk.segment_masks` (pairs in the same segment, tokens that continue the incoming state's
segment, tokens of the chunk's last segment), so a document boundary anywhere inside a chunk resets the
state exactly.

Kernels (layout `[B, H, T, K]`, one `(C, K)` tile per step; grid `(B, H, NT)`, NT sequential):
  forward   state `[K, V]` fp32 in VMEM scratch carried over chunks; emits o and the final state.
  states    the forward again, emitting the state entering every chunk `[B, H, NT, K, V]` fp32
            (run by the backward only, so nothing state-sized is kept between forward and backward).
  backward  chunks in reverse (index_map NT-1-n); dstate `[K, V]` fp32 in VMEM scratch; each step
            recomputes the chunk's WY quantities from its inputs and entering state and emits
            dq, dk, dv, dg, dbeta; dh0 is the dstate left after chunk 0.
The chunk math and its backward derivation are in `pallas_chunk`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lingpack.kernels.kda import api, segments
from lingpack.kernels.kda import pallas_chunk as chunk
from lingpack.kernels.kda.pallas_common import (check_head_dims, compiler_params, from_heads, resolve_interpret,
                                                set_table_row, table_row, to_heads)

f32 = jnp.float32
SEMANTICS = ("parallel", "parallel", "arbitrary")


def _chunk_inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, ids_ref, n, scale):
    """Load chunk n: fp32 tiles (q scaled), beta row [1, C] and the segment masks."""
    ids = ids_ref[...].astype(f32)  # ids < 2^24 are exact in fp32, and fp32 reductions lower everywhere
    ids_row = table_row(ids, n)
    prev_row = table_row(ids, jnp.maximum(n - 1, 0))
    # The state entering chunk 0 belongs to the row's first segment; later, to the previous chunk's last one.
    prev_last = jnp.where(n == 0, jnp.min(ids_row, axis=1, keepdims=True), jnp.max(prev_row, axis=1, keepdims=True))
    masks = chunk.segment_masks(ids_row, prev_last)
    tiles = (q_ref[...].astype(f32) * scale, k_ref[...].astype(f32), v_ref[...].astype(f32), g_ref[...].astype(f32),
             table_row(beta_ref[...].astype(f32), n))
    return tiles, masks


def _forward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, ids_ref, h0_ref, *refs, scale, safe_gate, emit_states):
    if emit_states:
        states_ref, state_scr = refs
    else:
        o_ref, final_ref, state_scr = refs
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        state_scr[...] = h0_ref[...].astype(f32)

    S = state_scr[...]
    tiles, masks = _chunk_inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, ids_ref, n, scale)
    o, S_next = chunk.chunk_forward(*tiles, S, masks, safe_gate)
    state_scr[...] = S_next
    if emit_states:
        states_ref[...] = S
    else:
        o_ref[...] = o.astype(o_ref.dtype)

        @pl.when(n == pl.num_programs(2) - 1)
        def _():
            final_ref[...] = S_next


def _backward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, ids_ref, states_ref, do_ref, dfinal_ref,
                     dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dh0_ref, dstate_scr, *, scale, safe_gate):
    step = pl.program_id(2)
    n_chunks = pl.num_programs(2)
    n = n_chunks - 1 - step  # chunks in reverse

    @pl.when(step == 0)
    def _():
        dstate_scr[...] = dfinal_ref[...]
        dbeta_ref[...] = jnp.zeros(dbeta_ref.shape, dbeta_ref.dtype)

    tiles, masks = _chunk_inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, ids_ref, n, scale)
    dq, dk, dv, dg, dbeta_row, dS = chunk.chunk_backward(*tiles, states_ref[...], do_ref[...].astype(f32),
                                                         dstate_scr[...], masks, safe_gate)
    dstate_scr[...] = dS
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dg_ref[...] = dg.astype(dg_ref.dtype)
    set_table_row(dbeta_ref, n, dbeta_row)

    @pl.when(step == n_chunks - 1)
    def _():
        dh0_ref[...] = dS


def _specs(B, H, NT, C, K, V, reverse=False):
    """BlockSpecs of the chunk tiles and the per-(row, head) tables."""
    chunk_of = (lambda n: NT - 1 - n) if reverse else (lambda n: n)
    tile = lambda d: pl.BlockSpec((None, None, C, d), lambda b, h, n: (b, h, chunk_of(n), 0))
    return dict(
        tile=tile,
        beta=pl.BlockSpec((None, None, NT, C), lambda b, h, n: (b, h, 0, 0)),
        ids=pl.BlockSpec((None, NT, C), lambda b, h, n: (b, 0, 0)),
        state=pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0)),
        per_chunk_state=pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, chunk_of(n), 0, 0)),
    )


def _forward_call(q, k, v, g, beta_tab, ids_tab, h0, *, scale, safe_gate, interpret, emit_states):
    B, H, Tp, K = q.shape
    V = v.shape[-1]
    NT = beta_tab.shape[2]
    C = Tp // NT
    s = _specs(B, H, NT, C, K, V)
    if emit_states:
        out_shape = jax.ShapeDtypeStruct((B, H, NT, K, V), f32)
        out_specs = s["per_chunk_state"]
    else:
        out_shape = (jax.ShapeDtypeStruct((B, H, Tp, V), v.dtype), jax.ShapeDtypeStruct((B, H, K, V), f32))
        out_specs = (s["tile"](V), s["state"])
    return pl.pallas_call(
        functools.partial(_forward_kernel, scale=scale, safe_gate=safe_gate, emit_states=emit_states),
        grid=(B, H, NT),
        in_specs=[s["tile"](K), s["tile"](K), s["tile"](V), s["tile"](K), s["beta"], s["ids"], s["state"]],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
        compiler_params=compiler_params(*SEMANTICS),
        interpret=interpret,
        name="kda_segment_states" if emit_states else "kda_segment_fwd",
    )(q, k, v, g, beta_tab, ids_tab, h0)


def _backward_call(q, k, v, g, beta_tab, ids_tab, states, do, dfinal, *, scale, safe_gate, interpret):
    B, H, Tp, K = q.shape
    V = v.shape[-1]
    NT = beta_tab.shape[2]
    C = Tp // NT
    s = _specs(B, H, NT, C, K, V, reverse=True)
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype),
                 jax.ShapeDtypeStruct(beta_tab.shape, f32), jax.ShapeDtypeStruct((B, H, K, V), f32))
    return pl.pallas_call(
        functools.partial(_backward_kernel, scale=scale, safe_gate=safe_gate),
        grid=(B, H, NT),
        in_specs=[s["tile"](K), s["tile"](K), s["tile"](V), s["tile"](K), s["beta"], s["ids"],
                  s["per_chunk_state"], s["tile"](V), s["state"]],
        out_specs=(s["tile"](K), s["tile"](K), s["tile"](V), s["tile"](K), s["beta"], s["state"]),
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
        compiler_params=compiler_params(*SEMANTICS),
        interpret=interpret,
        name="kda_segment_bwd",
    )(q, k, v, g, beta_tab, ids_tab, states, do, dfinal)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def segment_core(q, k, v, g, beta_tab, ids_tab, h0, scale, safe_gate, interpret):
    """Kernel layout in and out: q, k, g [B, H, Tp, K], v [B, H, Tp, V], beta_tab [B, H, NT, C] fp32,
    ids_tab [B, NT, C] int32 (padding filled), h0 [B, H, K, V] fp32 -> (o [B, H, Tp, V], final fp32)."""
    return _forward_call(q, k, v, g, beta_tab, ids_tab, h0, scale=scale, safe_gate=safe_gate, interpret=interpret,
                         emit_states=False)


def _core_fwd(q, k, v, g, beta_tab, ids_tab, h0, scale, safe_gate, interpret):
    out = segment_core(q, k, v, g, beta_tab, ids_tab, h0, scale, safe_gate, interpret)
    return out, (q, k, v, g, beta_tab, ids_tab, h0)


def _core_bwd(scale, safe_gate, interpret, residuals, cotangents):
    q, k, v, g, beta_tab, ids_tab, h0 = residuals
    do, dfinal = cotangents
    static = dict(scale=scale, safe_gate=safe_gate, interpret=interpret)
    states = _forward_call(q, k, v, g, beta_tab, ids_tab, h0, emit_states=True, **static)
    dq, dk, dv, dg, dbeta, dh0 = _backward_call(q, k, v, g, beta_tab, ids_tab, states, do.astype(v.dtype),
                                                dfinal.astype(f32), **static)
    return dq, dk, dv, dg, dbeta, None, dh0.astype(h0.dtype)


segment_core.defvjp(_core_fwd, _core_bwd)


def pallas_segment_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, segment_ids_BT, scale, initial_state_BHKV,
                       chunk_size=64, safe_gate=False, interpret=None):
    """`api.chunk_kda(impl="pallas_segment")`: same arguments and semantics as `chunked.chunked_segment_native`."""
    interpret = resolve_interpret(interpret)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    check_head_dims(K, V, chunk_size)
    NT = -(-T // chunk_size)
    pad = NT * chunk_size - T
    real = segment_ids_BT != 0
    # Padding becomes no-op tokens (k = v = g = beta = 0) and keeps its row's last id, so it continues
    # that segment: the final state is the state after the row's last real token.
    ids = segments.fill_padding_ids(segment_ids_BT.astype(jnp.int32))
    ids_tab = jnp.pad(ids, [(0, 0), (0, pad)], mode="edge").reshape(B, NT, chunk_size)
    zero_pad = lambda x: jnp.where(real[..., None, None], x, jnp.zeros((), x.dtype))
    q, k, v, g = [to_heads(zero_pad(x), pad) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK)]
    beta = jnp.where(real[..., None], beta_BTH.astype(f32), 0.0)   # beta stays fp32 (the erase strength)
    beta_tab = jnp.pad(jnp.moveaxis(beta, 2, 1), [(0, 0), (0, 0), (0, pad)]).reshape(B, H, NT, chunk_size)
    o, final = segment_core(q, k, v, g, beta_tab, ids_tab, initial_state_BHKV.astype(f32), float(scale),
                            bool(safe_gate), interpret)
    return jnp.where(real[..., None, None], from_heads(o, T), 0), final


api.register("pallas_segment", pallas_segment_kda)
