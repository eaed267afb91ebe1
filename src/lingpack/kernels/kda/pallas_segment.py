"""Segment-native Pallas TPU KDA ("Alt1" of the seed RFC): segment ids go straight into the kernel.

Rows stay `[B, T]` (any B); T is padded to a chunk multiple, nothing else: no flattening, no phantom
segments, no alignment. Each kernel step reads its chunk's segment ids from a per-row id table
`[B, NT8, C]` (2 * local segment number + real-token bit, fetched 8 chunks per block; the local number
counts segment starts since the token before the chunk, so 0 = the segment the incoming state belongs
to and a chunk needs no other chunk's ids) and builds the masks of `pallas_chunk.segment_masks`
(pairs in the same segment, tokens that continue the incoming state's segment, tokens of the chunk's
last segment), so a document boundary anywhere inside a chunk resets the state exactly; padding tokens
are made no-ops in the kernel (output 0, no decay, no write).

Tiles are `(C, K)`: of the free reshape `[B, T, H*K]` when K and V are multiples of 128 (no transpose
around the kernels), else of `[B, H, T, K]` (transposed in the wrapper; K = 64 is the full block dim).
Kernels (grid `(B, H, NT)`: B and H "parallel", the NT chunks "arbitrary", i.e. sequential):
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

from lingpack.kernels.kda import api, pallas_shard, segments
from lingpack.kernels.kda import pallas_chunk as chunk
from lingpack.kernels.kda.pallas_common import (TABLE_ROWS, check_head_dims, compiler_params,
                                                cost_estimate, from_heads, fusion_inputs, load_tiles,
                                                resolve_interpret, store_chunk_grads, table_row, table_rows, to_heads)

f32 = jnp.float32
SEMANTICS = ("parallel", "parallel", "arbitrary")


def _segment_masks(ids_ref, n):
    """Chunk n's segment masks and real-token row from the table of 2 * (local segment number) + (token is real)."""
    code = ids_ref[...]   # TABLE_ROWS chunks; numbers <= C are exact in fp32 (fp32 reductions lower everywhere)
    ids_row = table_row(jax.lax.div(code, 2).astype(f32), n)
    real_row = table_row(jax.lax.rem(code, 2).astype(f32), n)
    return chunk.segment_masks(ids_row, jnp.zeros((1, 1), f32)), real_row


def _forward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, ids_ref, h0_ref, *refs, scale, safe_gate, fusion,
                    emit_states):
    gate_ref, refs = (refs[0], refs[1:]) if fusion.gate else (None, refs)
    if emit_states:
        states_ref, state_scr = refs
    else:
        o_ref, final_ref, state_scr = refs
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        state_scr[...] = h0_ref[...].astype(f32)

    S = state_scr[...]
    masks, real_row = _segment_masks(ids_ref, n)
    tiles = load_tiles(q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, n, scale, fusion, real_row)
    o, S_next = chunk.chunk_forward(*tiles.inputs, S, masks, safe_gate, fusion.bulk)
    state_scr[...] = S_next
    if emit_states:
        states_ref[...] = S
    else:
        o_ref[...] = tiles.mask_rows(o).astype(o_ref.dtype)   # padding outputs 0

        @pl.when(n == pl.num_programs(2) - 1)
        def _():
            final_ref[...] = S_next


def _backward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, ids_ref, states_ref, do_ref, dfinal_ref, *refs, scale,
                     safe_gate, fusion):
    gate_ref, refs = (refs[0], refs[1:]) if fusion.gate else (None, refs)
    dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dh0_ref, *refs = refs
    dgate_ref, dstate_scr = refs if fusion.gate else (None, refs[0])
    step = pl.program_id(2)
    n_chunks = pl.num_programs(2)
    n = n_chunks - 1 - step  # chunks in reverse

    @pl.when(step == 0)
    def _():
        dstate_scr[...] = dfinal_ref[...]
        dbeta_ref[...] = jnp.zeros(dbeta_ref.shape, dbeta_ref.dtype)   # the last block's rows past NT stay 0
        if dgate_ref is not None:
            dgate_ref[...] = jnp.zeros(dgate_ref.shape, dgate_ref.dtype)

    masks, real_row = _segment_masks(ids_ref, n)
    tiles = load_tiles(q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, n, scale, fusion, real_row)
    grads = chunk.chunk_backward(*tiles.inputs, states_ref[...], tiles.mask_rows(do_ref[...].astype(f32)),
                                 dstate_scr[...], masks, safe_gate, fusion.bulk)
    dq, dk, dv, dg, dbeta_row, dS, d_gate = tiles.backward(*grads)
    dstate_scr[...] = dS
    store_chunk_grads((dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dgate_ref), n, dq, dk, dv, dg, dbeta_row, d_gate)

    @pl.when(step == n_chunks - 1)
    def _():
        dh0_ref[...] = dS


def _specs(B, H, NT, C, K, V, heads_minor, reverse=False):
    """BlockSpecs of the chunk tiles and the per-chunk tables (8 chunks per block).

    heads_minor: tiles of the free reshape [B, T, H*K] (block (C, K), legal when K and V are multiples
    of 128: no transposes around the kernels); else of [B, H, T, K] (block (C, K) with K the full dim).
    """
    chunk_of = (lambda n: NT - 1 - n) if reverse else (lambda n: n)
    table_block = lambda n: jax.lax.div(chunk_of(n), TABLE_ROWS)
    if heads_minor:
        tile = lambda d: pl.BlockSpec((None, C, d), lambda b, h, n: (b, chunk_of(n), h))
    else:
        tile = lambda d: pl.BlockSpec((None, None, C, d), lambda b, h, n: (b, h, chunk_of(n), 0))
    return dict(
        tile=tile,
        beta=pl.BlockSpec((None, None, TABLE_ROWS, C), lambda b, h, n: (b, h, table_block(n), 0)),
        ids=pl.BlockSpec((None, TABLE_ROWS, C), lambda b, h, n: (b, table_block(n), 0)),
        state=pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0)),
        per_chunk_state=pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, chunk_of(n), 0, 0)),
        gate=pl.BlockSpec((None, 2, K), lambda b, h, n: (h, 0, 0)),
        gate_grad=pl.BlockSpec((None, None, 2, K), lambda b, h, n: (b, h, 0, 0)),
    )


def _dims(q, v, beta_tab):
    """(B, H, NT, C, K, V, heads_minor) of the kernel operands."""
    B, H, _, C = beta_tab.shape
    heads_minor = q.ndim == 3
    NT = q.shape[-2] // C
    return B, H, NT, C, (q.shape[-1] // H if heads_minor else q.shape[-1]), (
        v.shape[-1] // H if heads_minor else v.shape[-1]), heads_minor


def _forward_call(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, *, scale, safe_gate, fusion, interpret, emit_states):
    B, H, NT, C, K, V, heads_minor = _dims(q, v, beta_tab)
    s = _specs(B, H, NT, C, K, V, heads_minor)
    if emit_states:
        out_shape = jax.ShapeDtypeStruct((B, H, NT, K, V), f32)
        out_specs = s["per_chunk_state"]
    else:
        out_shape = (jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((B, H, K, V), f32))
        out_specs = (s["tile"](V), s["state"])
    in_specs = [s["tile"](K), s["tile"](K), s["tile"](V), s["tile"](K), s["beta"], s["ids"], s["state"]]
    args = [q, k, v, g, beta_tab, ids_tab, h0]
    if fusion.gate:
        in_specs.append(s["gate"])
        args.append(gate_tab)
    name = "kda_segment_states" if emit_states else "kda_segment_fwd"
    return pl.pallas_call(
        functools.partial(_forward_kernel, scale=scale, safe_gate=safe_gate, fusion=fusion, emit_states=emit_states),
        grid=(B, H, NT), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
        compiler_params=compiler_params(SEMANTICS, in_specs, args, out_specs, out_shape, C, K, V),
        cost_estimate=cost_estimate("states" if emit_states else "forward", B * H * NT, C, K, V, safe_gate, True,
                                    fusion, args, out_shape),
        interpret=interpret, name=name,
    )(*args)


def _backward_call(q, k, v, g, beta_tab, ids_tab, states, do, dfinal, gate_tab, *, scale, safe_gate, fusion,
                   interpret):
    B, H, NT, C, K, V, heads_minor = _dims(q, v, beta_tab)
    s = _specs(B, H, NT, C, K, V, heads_minor, reverse=True)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype),
                 jax.ShapeDtypeStruct(beta_tab.shape, f32), jax.ShapeDtypeStruct((B, H, K, V), f32)]
    out_specs = [s["tile"](K), s["tile"](K), s["tile"](V), s["tile"](K), s["beta"], s["state"]]
    in_specs = [s["tile"](K), s["tile"](K), s["tile"](V), s["tile"](K), s["beta"], s["ids"], s["per_chunk_state"],
                s["tile"](V), s["state"]]
    args = [q, k, v, g, beta_tab, ids_tab, states, do, dfinal]
    if fusion.gate:
        in_specs.append(s["gate"])
        args.append(gate_tab)
        out_specs.append(s["gate_grad"])
        out_shape.append(jax.ShapeDtypeStruct((B, H, 2, K), f32))
    return pl.pallas_call(
        functools.partial(_backward_kernel, scale=scale, safe_gate=safe_gate, fusion=fusion),
        grid=(B, H, NT), in_specs=in_specs, out_specs=tuple(out_specs), out_shape=tuple(out_shape),
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
        compiler_params=compiler_params(SEMANTICS, in_specs, args, out_specs, out_shape, C, K, V),
        cost_estimate=cost_estimate("backward", B * H * NT, C, K, V, safe_gate, True, fusion, args, out_shape),
        interpret=interpret, name="kda_segment_bwd",
    )(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def segment_core(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, scale, safe_gate, fusion, interpret):
    """Kernel layout in and out: q, k, g [B, Tp, H*K] (or [B, H, Tp, K]), v likewise, beta_tab [B, H, NT8, C]
    fp32, ids_tab [B, NT8, C] int32 (2 * local segment number + real), h0 [B, H, K, V] fp32, gate_tab [H, 2, K]
    fp32 (used with a fused gate) -> (o in v's layout, final [B, H, K, V] fp32)."""
    return _forward_call(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, scale=scale, safe_gate=safe_gate, fusion=fusion,
                         interpret=interpret, emit_states=False)


def _core_fwd(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, scale, safe_gate, fusion, interpret):
    out = segment_core(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, scale, safe_gate, fusion, interpret)
    return out, (q, k, v, g, beta_tab, ids_tab, h0, gate_tab)


def _core_bwd(scale, safe_gate, fusion, interpret, residuals, cotangents):
    q, k, v, g, beta_tab, ids_tab, h0, gate_tab = residuals
    do, dfinal = cotangents
    static = dict(scale=scale, safe_gate=safe_gate, fusion=fusion, interpret=interpret)
    states = _forward_call(q, k, v, g, beta_tab, ids_tab, h0, gate_tab, emit_states=True, **static)
    dq, dk, dv, dg, dbeta, dh0, *dgate = _backward_call(q, k, v, g, beta_tab, ids_tab, states, do.astype(v.dtype),
                                                        dfinal.astype(f32), gate_tab, **static)
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
