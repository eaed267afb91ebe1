"""Plumbing shared by the Pallas KDA kernels: interpret-mode choice, grid settings, per-chunk tables,
tile loading with the fused prologue (gate, q/k L2 norm, padding), and the per-step cost model.

Per-token scalars (beta, segment ids) travel as lane-dense tables `[..., NT, C]` whose whole block stays
in VMEM for a (row, head); a kernel step picks its chunk's row with a one-hot sublane reduction (no
dynamic indexing). A `[C, 1]` column layout would pad every token to 128 lanes in HBM and VMEM.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lingpack.kernels.kda import gate
from lingpack.kernels.kda import pallas_chunk as chunk
from lingpack.kernels.kda.pallas_chunk import iota

f32 = jnp.float32

_warned = False


def resolve_interpret(interpret: bool | None) -> bool:
    """None -> interpret unless the default backend is a TPU (warned once per process)."""
    global _warned
    if interpret is not None:
        return bool(interpret)
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not _warned:
        _warned = True
        warnings.warn(f"Pallas KDA kernels run in interpret mode on backend {jax.default_backend()!r} (slow; "
                      "for tests and debugging only)", stacklevel=3)
    return not on_tpu


def compiler_params(*semantics: str):
    return pltpu.CompilerParams(dimension_semantics=tuple(semantics))


def table_row(table, n):
    """Row n of an in-kernel table [NT, C] as [1, C]; n is a traced scalar."""
    return jnp.sum(jnp.where(iota(table.shape, 0) == n, table, 0.0), axis=0, keepdims=True)


def set_table_row(table_ref, n, row):
    """table_ref[n, :] = row, as a full-block select (a dynamic sublane store avoided on purpose)."""
    table_ref[...] = jnp.where(iota(table_ref.shape, 0) == n, jnp.broadcast_to(row, table_ref.shape),
                               table_ref[...])


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


def fusion_inputs(H, K, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_qk_l2norm_in_kernel, safe_gate):
    """(Fusion, gate table [H, 2, K] = (dt_bias, exp(A_log)) fp32, safe_gate) for the kernels' prologue."""
    if not use_gate_in_kernel:
        return chunk.Fusion(qk_l2norm=bool(use_qk_l2norm_in_kernel)), jnp.zeros((H, 2, K), f32), safe_gate
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
                          qk_l2norm=bool(use_qk_l2norm_in_kernel))
    # The lower-bound gate keeps g >= lower_bound >= -5: the sub-block factoring cannot overflow.
    return fusion, table, bool(safe_gate) or lower_bound is not None


# --- cost of one grid step, counted from the chunk math's own jaxpr --------------------------------------
TRANSCENDENTAL = {"exp", "exp2", "log", "log1p", "logistic", "rsqrt", "tanh", "sqrt"}
NOT_COMPUTE = {"get", "swap", "addupdate", "program_id", "num_programs"}   # VMEM loads/stores, grid queries


def jaxpr_cost(jaxpr) -> dict:
    """{'mxu_flops', 'vpu_ops', 'transcendentals'} of a jaxpr: 2*M*N*K per dot_general, one op per output
    element of every other array-valued equation; cond branches count their most expensive branch."""
    cost = {"mxu_flops": 0, "vpu_ops": 0, "transcendentals": 0}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = [p.jaxpr if hasattr(p, "jaxpr") else p for p in eqn.params.values()
                if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns")]
        branches = eqn.params.get("branches")
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs_shape = eqn.invars[0].aval.shape
            contracted = math.prod(lhs_shape[d] for d in lhs_contract)
            cost["mxu_flops"] += 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
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


@functools.lru_cache(maxsize=None)
def step_cost(kind: str, C: int, K: int, V: int, safe_gate: bool, masked: bool, fusion: chunk.Fusion) -> dict:
    """Cost of one grid step of a `kind` in {forward, states, backward} kernel, from the traced chunk math."""
    t = lambda *shape: jax.ShapeDtypeStruct(shape, f32)

    def step(q, k, v, g, beta_row, S, dO, dS, gate_params, ids_row, prev_last):
        masks = chunk.segment_masks(ids_row, prev_last) if masked else chunk.NO_MASKS
        qn, kn, g, saved = chunk.prologue(q, k, g, gate_params, fusion)
        if kind != "backward":
            return chunk.chunk_forward(qn, kn, v, g, beta_row, S, masks, safe_gate)
        grads = chunk.chunk_backward(qn, kn, v, g, beta_row, S, dO, dS, masks, safe_gate)
        return chunk.prologue_backward(qn, kn, grads[0], grads[1], grads[3], gate_params, saved, fusion), grads
    jaxpr = jax.make_jaxpr(step)(t(C, K), t(C, K), t(C, V), t(C, K), t(1, C), t(K, V), t(C, V), t(K, V), t(2, K),
                                 t(1, C), t(1, 1))
    return jaxpr_cost(jaxpr.jaxpr)


def cost_estimate(kind, steps, C, K, V, safe_gate, masked, fusion, args, out_shapes) -> pl.CostEstimate:
    """What XLA's scheduler is told about a kernel: per-step cost x grid steps, every operand moved once."""
    c = step_cost(kind, C, K, V, bool(safe_gate), masked, fusion)
    nbytes = lambda x: math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    moved = sum(nbytes(x) for x in args) + sum(nbytes(x) for x in jax.tree.leaves(out_shapes))
    return pl.CostEstimate(flops=int(steps * (c["mxu_flops"] + c["vpu_ops"])),
                           transcendentals=int(steps * c["transcendentals"]), bytes_accessed=int(moved))
