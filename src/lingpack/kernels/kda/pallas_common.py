"""Plumbing shared by the Pallas KDA kernels: interpret-mode choice, grid settings, per-chunk tables,
tile loading with the fused prologue (gate, q/k L2 norm, padding), and the per-step cost model.

Per-token scalars (beta, segment ids) travel as lane-dense tables `[..., NT8, C]` (NT rounded up to a
multiple of 8) fetched 8 chunks per block (`TABLE_ROWS`: the smallest second-minor block Mosaic takes),
so VMEM and per-step work stay O(chunk) at any T; a kernel step picks its chunk's row n % 8 with a
one-hot sublane reduction over 8 rows (no dynamic indexing). A `[C, 1]` column layout would pad every
token to 128 lanes in HBM and VMEM. `vmem_limit_bytes` comes from `vmem_budget` of the actual blocks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lingpack import backend
from lingpack.plan import hlo
from lingpack.kernels.kda import gate
from lingpack.kernels.kda import pallas_chunk as chunk
from lingpack.kernels.kda.pallas_chunk import iota

f32 = jnp.float32

def resolve_interpret(interpret: bool | None) -> bool:
    """Interpret mode for the Pallas KDA kernels: what was asked, else the backend target's side
    (lingpack/backend.py: Mosaic on TPU, interpret on CPU, an error naming `chunked` on GPU)."""
    return backend.pallas_interpret(interpret, kernel="the Pallas KDA kernel (pallas_segment / pallas_varlen)",
                                    alternative="kernel=chunked")


TABLE_ROWS = 8            # chunks per table block
VMEM_DEFAULT = 16 * 2**20  # v5e's default scoped VMEM limit (v6e, v7x: 32 MiB)
VMEM_CAP = 64 * 2**20      # v7x's VMEM per TensorCore (v5e, v6e: 128 MiB)
CHUNK_TEMPS = 48           # live fp32 [C, max(C, K, V)] temporaries of the chunk math (estimate, backward)


def table_rows(n_chunks: int) -> int:
    """Rows of a per-chunk table: NT rounded up to whole blocks."""
    return -(-n_chunks // TABLE_ROWS) * TABLE_ROWS


def blocks_of(specs, arrays) -> list:
    """(block shape, dtype) of each BlockSpec and the array it tiles (what `vmem_budget` counts)."""
    return [(spec.block_shape, x.dtype) for spec, x in zip(specs, arrays)]


def vmem_budget(blocks, scratch, C: int, K: int, V: int) -> int:
    """VMEM bytes of one kernel: every (block shape, dtype) of its in/out BlockSpecs double-buffered by the
    pipeline, the scratch [(shape, dtype)], and room for the chunk math's temporaries."""
    size = lambda shape, dtype: math.prod(d for d in shape if d is not None) * jnp.dtype(dtype).itemsize
    return (2 * sum(size(s, d) for s, d in blocks) + sum(size(s, d) for s, d in scratch)
            + CHUNK_TEMPS * C * max(C, K, V) * 4)


def vmem_limit(budget: int) -> int:
    """The scoped VMEM limit for a budget: 1.5x headroom, never below the default, an error above the cap."""
    if budget > VMEM_CAP:
        raise ValueError(f"Pallas KDA kernel needs ~{budget / 2**20:.1f} MiB of VMEM, over {VMEM_CAP >> 20} MiB;"
                         " use a smaller chunk_size or head dim")
    return min(VMEM_CAP, max(VMEM_DEFAULT, -(-3 * budget // 2 // 2**20) * 2**20))


def compiler_params(semantics, in_specs, args, out_specs, out_shape, C: int, K: int, V: int, heads: int = 1):
    """Mosaic params: dimension semantics and the VMEM limit from the kernel's blocks and its [heads, K, V]
    fp32 state scratch (see `vmem_budget`; temporaries counted per head, as if no head's were freed)."""
    blocks = blocks_of(in_specs, args) + blocks_of(jax.tree.leaves(out_specs), jax.tree.leaves(out_shape))
    budget = vmem_budget(blocks, [((heads, K, V), f32)], C, K, V) + (heads - 1) * vmem_budget([], [], C, K, V)
    return pltpu.CompilerParams(dimension_semantics=tuple(semantics), vmem_limit_bytes=vmem_limit(budget))


MAX_HEADS_PER_STEP = 4


def heads_per_step(B: int, H: int) -> int:
    """Heads one grid step processes: the most (up to 4) dividing H that still leave the leading parallel axis
    B * H / heads >= 2, so both TensorCores of a megacore chip get work."""
    for heads in range(min(H, MAX_HEADS_PER_STEP), 0, -1):
        if H % heads == 0 and (B * H // heads >= 2 or heads == 1):
            return heads
    return 1


def table_row(table, n):
    """Chunk n's row of an in-kernel table block [TABLE_ROWS, C] as [1, C]; n is a traced scalar."""
    picked = iota(table.shape, 0) == jax.lax.rem(n, TABLE_ROWS)
    return jnp.sum(jnp.where(picked, table, 0.0), axis=0, keepdims=True)


def set_table_row(table_ref, n, row):
    """Chunk n's row of a table block = row, as a full-block select (a dynamic sublane store avoided on purpose)."""
    picked = iota(table_ref.shape, 0) == jax.lax.rem(n, TABLE_ROWS)
    table_ref[...] = jnp.where(picked, jnp.broadcast_to(row, table_ref.shape), table_ref[...])


def store_chunk_grads(refs, n, dq, dk, dv, dg, dbeta_row, d_gate):
    """Write one chunk's input gradients: refs = (dq, dk, dv, dg, dbeta table, dgate accumulator or None)."""
    dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dgate_ref = refs
    for ref, value in ((dq_ref, dq), (dk_ref, dk), (dv_ref, dv), (dg_ref, dg)):
        ref[...] = value.astype(ref.dtype)
    set_table_row(dbeta_ref, n, dbeta_row)
    if dgate_ref is not None:
        dgate_ref[...] += d_gate


def to_heads(x_BTHK, n_pad: int, fill: float = 0.0):
    """[B, T, H, K] -> [B, H, T + n_pad, K] (tail = fill): the kernels' layout, one (C, K) tile per chunk."""
    x = jnp.moveaxis(x_BTHK, 2, 1)
    return jnp.pad(x, [(0, 0), (0, 0), (0, n_pad), (0, 0)], constant_values=fill) if n_pad else x


def from_heads(x_BHTV, T: int):
    return jnp.moveaxis(x_BHTV[:, :, :T], 1, 2)


def check_head_dims(K: int, V: int, chunk_size: int) -> None:
    gate.check_chunk_size(chunk_size)
    for name, d in (("K", K), ("V", V)):
        if d % 8:
            raise ValueError(f"Pallas KDA kernels need the {name} head dim to be a multiple of 8 (64 or 128 on TPU);"
                             f" got {d}")


class Tiles:
    """One chunk's tiles loaded from their refs (fp32), passed through the fused prologue (L2 norm, gate).

    With `real_row` ([1, C], 1 = real token), padding rows are turned into no-op tokens here (k = v = beta
    = 0, no decay), so the wrapper needs no masking pass over the inputs; gradients get the same mask.
    """

    def __init__(self, q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, n, scale, fusion: chunk.Fusion, real_row=None):
        self.scale, self.fusion = scale, fusion
        self.gate_params = gate_ref[...] if gate_ref is not None else None
        self.real_row = real_row
        self.real_col = None if real_row is None else chunk.row_to_col(real_row)
        mask = lambda x: x if self.real_col is None else x * self.real_col
        g = g_ref[...].astype(f32)
        if self.real_col is not None:
            g = jnp.where(self.real_col > 0, g, chunk.PADDING_GATE_RAW if fusion.gate else 0.0)
        q, k, g, self.saved = chunk.prologue(mask(q_ref[...].astype(f32)), mask(k_ref[...].astype(f32)), g,
                                             self.gate_params, fusion)
        self.q, self.k = q, k
        beta_row = table_row(beta_ref[...].astype(f32), n)
        self.inputs = (q * scale, k, mask(v_ref[...].astype(f32)), g,
                       beta_row if real_row is None else beta_row * real_row)

    def mask_rows(self, x):
        return x if self.real_col is None else x * self.real_col

    def backward(self, dq_scaled, dk, dv, dg, dbeta_row, dS):
        """Chunk gradients -> gradients of the kernel inputs, plus the gate-parameter partial sums (or None)."""
        dq, dk, dg, d_gate = chunk.prologue_backward(self.q, self.k, dq_scaled * self.scale, dk, dg,
                                                     self.gate_params, self.saved, self.fusion)
        if self.real_row is not None:
            dq, dk, dv, dg = [self.mask_rows(x) for x in (dq, dk, dv, dg)]
            dbeta_row = dbeta_row * self.real_row
        return dq, dk, dv, dg, dbeta_row, dS, d_gate


def load_tiles(q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, n, scale, fusion, real_row=None) -> Tiles:
    return Tiles(q_ref, k_ref, v_ref, g_ref, beta_ref, gate_ref, n, scale, fusion, real_row)


PRECISIONS = (None, "default", "highest")


def bulk_dtype(precision: str | None, dtype) -> str | None:
    """Operand dtype of the kernels' bulk matmuls (`pallas_chunk`'s policy): "default" = bf16 operands with
    fp32 accumulation, "highest" = fp32 at HIGHEST everywhere, None = bf16 for 16-bit inputs, else fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if precision == "highest" or (precision is None and jnp.dtype(dtype).itemsize >= 4):
        return None
    return "bfloat16"


def fusion_inputs(H, K, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_qk_l2norm_in_kernel, safe_gate,
                  precision=None, dtype=f32):
    """(Fusion, gate table [H, 2, K] = (dt_bias, exp(A_log)) fp32, safe_gate) for the kernels' prologue."""
    bulk = bulk_dtype(precision, dtype)
    if not use_gate_in_kernel:
        return chunk.Fusion(qk_l2norm=bool(use_qk_l2norm_in_kernel), bulk=bulk), jnp.zeros((H, 2, K), f32), safe_gate
    if lower_bound is None and A_log is None:
        raise ValueError("the softplus gate needs A_log; pass A_log or set lower_bound for the safe gate")
    if lower_bound is not None:
        gate.check_lower_bound(lower_bound)
    if dt_bias is not None and dt_bias.size != H * K:
        raise ValueError(f"dt_bias must have H*K = {H * K} elements (head-major [H, K]); got shape {dt_bias.shape}")
    if A_log is not None and A_log.size != H:
        raise ValueError(f"A_log must have one value per head (H={H}); got shape {A_log.shape}")
    dt = jnp.zeros((H, K), f32) if dt_bias is None else dt_bias.reshape(H, K).astype(f32)
    a = jnp.ones((H,), f32) if A_log is None else jnp.exp(A_log.reshape(H).astype(f32))
    table = jnp.stack([dt, jnp.broadcast_to(a[:, None], (H, K))], axis=1)
    fusion = chunk.Fusion(gate="softplus" if lower_bound is None else "lower_bound",
                          lower_bound=gate.SAFE_GATE_MIN if lower_bound is None else float(lower_bound),
                          qk_l2norm=bool(use_qk_l2norm_in_kernel), bulk=bulk)
    # The lower-bound gate keeps g >= lower_bound >= -5: the sub-block factoring cannot overflow.
    return fusion, table, bool(safe_gate) or lower_bound is not None


# --- cost of one grid step, counted from the chunk math's own jaxpr --------------------------------------
TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "logistic", "rsqrt", "tanh", "sqrt"}
NOT_COMPUTE = {"get", "swap", "addupdate", "program_id", "num_programs"}   # VMEM loads/stores, grid queries


MXU_PASSES = {jax.lax.Precision.HIGHEST: 6, jax.lax.Precision.HIGH: 3}   # bf16 passes of an fp32 product


def mxu_passes(eqn) -> int:
    """bf16 MXU passes of one dot_general: 1 for 16-bit operands, else by precision (fp32 HIGHEST ~ 6)."""
    if all(jnp.dtype(v.aval.dtype).itemsize <= 2 for v in eqn.invars):
        return 1
    precision = eqn.params.get("precision")
    precision = precision[0] if isinstance(precision, tuple) else precision
    return MXU_PASSES.get(precision, 1)


def jaxpr_cost(jaxpr) -> dict:
    """{'mxu_flops', 'mxu_pass_flops', 'vpu_ops', 'transcendentals'} of a jaxpr: 2*M*N*K per dot_general
    (times its bf16 MXU passes for 'mxu_pass_flops'), one op per output element of every other array-valued
    equation; cond branches count their most expensive branch."""
    cost = {"mxu_flops": 0, "mxu_pass_flops": 0, "vpu_ops": 0, "transcendentals": 0}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = [p.jaxpr if hasattr(p, "jaxpr") else p for p in eqn.params.values()
                if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns")]
        branches = eqn.params.get("branches")
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs_shape = eqn.invars[0].aval.shape
            contracted = math.prod(lhs_shape[d] for d in lhs_contract)
            flops = 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
            cost["mxu_flops"] += flops
            cost["mxu_pass_flops"] += flops * mxu_passes(eqn)
        elif branches:
            costs = [jaxpr_cost(b.jaxpr) for b in branches]
            for key in cost:
                cost[key] += max(c[key] for c in costs)
        elif subs:
            for sub in subs:
                for key, value in jaxpr_cost(sub).items():
                    cost[key] += value
        elif name not in NOT_COMPUTE:
            size = sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
            cost["transcendentals" if name in TRANSCENDENTAL else "vpu_ops"] += size
    return cost


def step_function(kind: str, C: int, K: int, V: int, safe_gate: bool, masked: bool, fusion: chunk.Fusion):
    """(the chunk math of one head-chunk of a `kind` (forward, states, backward) kernel, its fp32 argument
    shapes): what `step_cost` counts, and what a test compiles with XLA to count it independently."""
    t = lambda *shape: jax.ShapeDtypeStruct(shape, f32)

    def step(q, k, v, g, beta_row, S, dO, dS, gate_params, ids_row, prev_last, X):
        masks = chunk.segment_masks(ids_row, prev_last) if masked else chunk.NO_MASKS
        qn, kn, g, saved = chunk.prologue(q, k, g, gate_params, fusion)
        if kind == "forward":   # computes (and saves) the WY inverse
            return chunk.chunk_forward(qn, kn, v, g, beta_row, S, masks, safe_gate, fusion.bulk)
        if kind == "states":    # the saved inverse in, only the state out
            return chunk.chunk_forward(qn, kn, v, g, beta_row, S, masks, safe_gate, fusion.bulk, inverse=X)[1]
        grads = chunk.chunk_backward(qn, kn, v, g, beta_row, S, dO, dS, masks, safe_gate, fusion.bulk, inverse=X)
        return chunk.prologue_backward(qn, kn, grads[0], grads[1], grads[3], gate_params, saved, fusion), grads
    return step, (t(C, K), t(C, K), t(C, V), t(C, K), t(1, C), t(K, V), t(C, V), t(K, V), t(2, K), t(1, C), t(1, 1),
                  t(C, C))


@functools.lru_cache(maxsize=None)
def step_cost(kind: str, C: int, K: int, V: int, safe_gate: bool, masked: bool, fusion: chunk.Fusion) -> dict:
    """Cost of one chunk of one head in a `kind` (forward, states, backward) kernel, from the traced chunk math."""
    step, args = step_function(kind, C, K, V, safe_gate, masked, fusion)
    jaxpr = jax.make_jaxpr(step)(*args)
    return jaxpr_cost(pe.dce_jaxpr(jaxpr.jaxpr, [True] * len(jaxpr.out_avals))[0])   # what is computed for the outputs


def cost_estimate(kind, steps, C, K, V, safe_gate, masked, fusion, args, out_shapes) -> pl.CostEstimate:
    """What XLA's scheduler is told about a kernel: per-step cost x grid steps, every operand moved once."""
    c = step_cost(kind, C, K, V, bool(safe_gate), masked, fusion)
    nbytes = lambda x: math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    moved = sum(nbytes(x) for x in args) + sum(nbytes(x) for x in jax.tree.leaves(out_shapes))
    return pl.CostEstimate(flops=int(steps * (c["mxu_flops"] + c["vpu_ops"])),
                           transcendentals=int(steps * c["transcendentals"]), bytes_accessed=int(moved))


def pallas_calls(jaxpr) -> list:
    """Every `pallas_call` equation in a (closed) jaxpr, nested jaxprs included (cost model and budget tests)."""
    return hlo.pallas_call_eqns(jaxpr)


# --- call scaffolding shared by pallas_segment and pallas_varlen ------------------------------------------
# Both designs run the same three kernels (forward, states, backward) with the same operands around their
# own grid and tables: the kernel refs split the same way and the operand lists have the same shape.

SEMANTICS = ("parallel", "arbitrary")   # the leading grid axis (rows / heads) parallel, the chunks sequential


def chunk_order(n_chunks: int, reverse: bool):
    """For index_maps: the chunk grid step n visits (the backward walks the chunks in reverse)."""
    return (lambda n: n_chunks - 1 - n) if reverse else (lambda n: n)


def head_dims(q, v, H: int, heads_minor: bool) -> tuple[int, int]:
    """(K, V) of kernel operands laid out as [..., T, H*K] (heads_minor) or [..., H, T, K]."""
    return (q.shape[-1] // H, v.shape[-1] // H) if heads_minor else (q.shape[-1], v.shape[-1])


def split_forward_refs(refs, fusion: chunk.Fusion, emit: str):
    """A forward / states kernel's refs after its common inputs -> (gate table or None, saved inverses or
    None, output refs, state scratch). emit: "output", "saving" (+ each chunk's WY inverse), "states"."""
    gate_ref, refs = (refs[0], refs[1:]) if fusion.gate else (None, refs)
    inverse_ref = refs[0] if emit == "states" else None
    return gate_ref, inverse_ref, refs[1 if emit == "states" else 0:-1], refs[-1]


def split_backward_refs(refs, fusion: chunk.Fusion):
    """A backward kernel's refs after its inputs -> (gate table or None, (dq, dk, dv, dg, dbeta, dh0) refs,
    dgate accumulator or None, dstate scratch)."""
    gate_ref, refs = (refs[0], refs[1:]) if fusion.gate else (None, refs)
    rest = refs[6:]
    dgate_ref, dstate_scr = rest if fusion.gate else (None, rest[0])
    return gate_ref, tuple(refs[:6]), dgate_ref, dstate_scr


def zero_accumulators(dbeta_ref, dgate_ref) -> None:
    """At the backward's first step: the dbeta table (the last block's rows past NT stay 0) and the dgate sums."""
    dbeta_ref[...] = jnp.zeros(dbeta_ref.shape, dbeta_ref.dtype)
    if dgate_ref is not None:
        dgate_ref[...] = jnp.zeros(dgate_ref.shape, dgate_ref.dtype)


def forward_operands(specs: dict, q, k, v, g, beta_tab, tables, h0, gate_tab, inverse, *, K: int, V: int, emit: str,
                     fusion: chunk.Fusion, states_shape, final_shape, inverse_shape):
    """(in_specs, args, out_specs, out_shape) of a forward or states call.

    specs: "tile" (a function of the head dim), "beta", "initial" (h0), "final", "per_chunk_state", "inverse",
    "gate"; tables: (spec, array) pairs of per-chunk tables read between beta and h0. Outputs: the state
    entering every chunk (emit "states", which reads the saved inverses), else o and the final state, and
    with emit "saving" each chunk's WY inverse too."""
    tile = specs["tile"]
    in_specs = [tile(K), tile(K), tile(V), tile(K), specs["beta"], *(s for s, _ in tables), specs["initial"]]
    args = [q, k, v, g, beta_tab, *(a for _, a in tables), h0]
    if fusion.gate:
        in_specs.append(specs["gate"])
        args.append(gate_tab)
    if emit == "states":
        in_specs.append(specs["inverse"])
        args.append(inverse)
        return in_specs, args, (specs["per_chunk_state"],), (jax.ShapeDtypeStruct(states_shape, f32),)
    out_specs = [tile(V), specs["final"]]
    out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(final_shape, f32)]
    if emit == "saving":
        out_specs.append(specs["inverse"])
        out_shape.append(jax.ShapeDtypeStruct(inverse_shape, f32))
    return in_specs, args, tuple(out_specs), tuple(out_shape)


def backward_operands(specs: dict, q, k, v, g, beta_tab, tables, states, inverse, do, dfinal, gate_tab, *, K: int,
                      V: int, fusion: chunk.Fusion, dh0_shape, dgate_shape):
    """(in_specs, args, out_specs, out_shape) of a backward call: the inputs, the states entering every chunk,
    the saved inverses and the cotangents in; dq, dk, dv, dg (their inputs' dtypes), dbeta (fp32, beta's
    table), dh0 and, with a fused gate, the gate table's gradient (spec "gate_grad") out."""
    tile = specs["tile"]
    in_specs = [tile(K), tile(K), tile(V), tile(K), specs["beta"], *(s for s, _ in tables), specs["per_chunk_state"],
                specs["inverse"], tile(V), specs["final"]]
    args = [q, k, v, g, beta_tab, *(a for _, a in tables), states, inverse, do, dfinal]
    out_specs = [tile(K), tile(K), tile(V), tile(K), specs["beta"], specs["initial"]]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, g)]
    out_shape += [jax.ShapeDtypeStruct(beta_tab.shape, f32), jax.ShapeDtypeStruct(dh0_shape, f32)]
    if fusion.gate:
        in_specs.append(specs["gate"])
        args.append(gate_tab)
        out_specs.append(specs["gate_grad"])
        out_shape.append(jax.ShapeDtypeStruct(dgate_shape, f32))
    return in_specs, args, tuple(out_specs), tuple(out_shape)


def kda_pallas_call(kernel, operands, *, name: str, kind: str, grid, scratch, C: int, K: int, V: int, heads: int,
                    safe_gate: bool, masked: bool, fusion: chunk.Fusion, interpret: bool, prefetch=()):
    """Run one KDA kernel over `grid` with `operands` (from `forward_operands` / `backward_operands`), an fp32
    `scratch` state in VMEM, the VMEM limit from its blocks and XLA's cost estimate; `prefetch` arrays go to
    SMEM as scalar prefetch (first arguments of the kernel and of every index_map)."""
    in_specs, args, out_specs, out_shape = operands
    steps = math.prod(grid) * heads   # head-chunks the call processes
    common = dict(out_shape=out_shape, interpret=interpret, name=name,
                  compiler_params=compiler_params(SEMANTICS, in_specs, args, out_specs, out_shape, C, K, V, heads),
                  cost_estimate=cost_estimate(kind, steps, C, K, V, safe_gate, masked, fusion, args, out_shape))
    scratch_shapes = [pltpu.VMEM(scratch, f32)]
    if prefetch:
        grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs,
                                                 out_specs=out_specs, scratch_shapes=scratch_shapes)
        return pl.pallas_call(kernel, grid_spec=grid_spec, **common)(*prefetch, *args)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch_shapes,
                          **common)(*args)
