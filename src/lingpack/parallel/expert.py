"""Expert parallelism by token all-to-all: each device computes only its own experts.

Inside the MoE's shard_map (models/moe.py) every device has routed its own tokens and sorted its M = N*k
(token, expert) assignments by expert. With the experts split over the `ep` mesh axes (R devices, L = E / R
consecutive experts each), `dispatch` then

1. all-gathers the per-expert assignment counts (an [R, E] int32 table: the only global routing state, so
   every device knows every device's load),
2. sends every assignment row to the device that holds its expert, one slice per (device, local expert),
   written straight into the receiver's expert-major order (experts, then senders in device order),
3. runs the local experts' grouped matmuls on what arrived,
4. sends each result row back into the sender's sorted order, where the MoE combines as on one device.

Rows travel in units of `unit` rows (`UNIT` in the MoE, models/moe.py): each expert's group of sorted rows is padded
with rows to whole units (`unit_layout`), and the exchanges move [units, unit, D] arrays. A ragged
all-to-all's operands must keep their leading dimension row-contiguous; for [rows, D] XLA:TPU then lays
them out in (2, 128) tiles and copies them to and from the (16, 128) tiles of the kernels on both sides of
every exchange (8 to 10 ms a step each for the flagship's 81,920 x 1,536 buffers), while a [units, 16, D]
array is row-contiguous by unit in the kernels' own layout (docs/parallelism.md). Padding rows hold copies of
real rows (finite values); their outputs are never read back and their cotangents are zeros, so they add
nothing to a weight gradient.

Receive buffers are sized by a capacity factor over the balanced load, not for the worst case: balanced
routing sends every device M rows, M / R from each sender. Two exchanges:

- `ragged` (XLA's ragged all-to-all; on CPU its exact stand-in): a device receives at most
  `window = capacity x M` rows per round, in the order they land (its expert-major order).
- `dense` (one `all_to_all` of fixed-size buffers, where a TPU refuses the ragged one; backend.py): a sender
  sends at most `window = capacity x M / R` rows to each device per round; the receiver holds R windows.

Nothing is dropped. Rows past the window wait for another round: round r carries the rows whose position in
their window stream (the order rows arrive at their receiver, or among the rows one sender sends one receiver)
lies in [r w, (r + 1) w).
The first round is always taken; the others (a `while_loop`, skipped unless some device overflows: every
device reads the same counts table, so all take the same number) only when routing is that skewed. The
rounds count comes back beside the outputs (the MoE's `dispatch_rounds` statistic).
Buffers are never zero-filled (`_scratch`: uninitialised on TPU and GPU, zeros on CPU, allocated per layer). The
rows a round does not receive are masked to zero around `experts_fn` (`_on_received`; `masked=False` where the
experts never let them reach another row or a gradient), and every row of the [M, ...] outputs is written by
some round.
Each row visits the same expert with the same weights as on one device, so outputs agree with one device
exactly and gradients up to the summation order of the expert-weight gradients. The backward is written out
(`jax.custom_vjp`): round 0 keeps its expert residuals, a further round recomputes its exchange and experts
(a while_loop has no reverse-mode derivative of its own).

XLA:CPU has no ragged all-to-all: on CPU (`lingpack.backend.current()`) `dense_ragged_all_to_all` computes
the ragged one's result exactly with one `all_to_all` of per-destination buffers. `backend.target("tpu")`
traces the ragged program from a CPU host (for export).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from lingpack import backend
from lingpack.errors import ConfigError
from lingpack.parallel.layout import axis_tuple

RAGGED_ALL_TO_ALL = "ragged_all_to_all"   # its StableHLO custom-call target (jax.export waives its check by name)
EXCHANGES = ("ragged", "dense")
ALIGN = 8   # window rows are a multiple of this (the sublane count); of 128 (the MXU edge) from 1024 rows on,
            # of 512 (Megablox's row tile: no pad of the buffer before its kernels) from 8192 on
UNIT = 16   # rows an exchange unit holds under expert parallelism: the rows of one bf16 (16, 128) tile


def padded_rows(M: int, E: int, unit: int) -> int:
    """Rows of M sorted rows once each of E groups is padded to whole units: a static bound, since the sum of
    ceil(size / unit) over the groups is at most (M + E (unit - 1)) / unit."""
    return (M + E * (unit - 1)) // unit * unit


def unit_layout(expert_M: jax.Array, inverse_M: jax.Array, sizes_E: jax.Array, unit: int):
    """(to_M, from_P, padded sizes [E]) for M rows of experts `expert_M` whose place in the expert-sorted
    order is `inverse_M`, each expert's group padded with rows to a multiple of `unit`: to_M is each row's
    place in the padded order, from_P the row at each of the padded_rows(M, E, unit) places (M where it is
    padding). With unit 1 these are the sort's own inverse and order."""
    M, E = expert_M.shape[0], sizes_E.shape[0]
    padded_E = -(-sizes_E // unit) * unit
    to_M = (_exclusive_cumsum(padded_E) - _exclusive_cumsum(sizes_E))[expert_M] + inverse_M
    from_P = jnp.full((padded_rows(M, E, unit),), M, inverse_M.dtype).at[to_M].set(jnp.arange(M, dtype=inverse_M.dtype))
    return to_M, from_P, padded_E


def ep_axes(expert_spec_entry, token_axes: set):
    """The expert-parallel group: the mesh axes that split the experts (one PartitionSpec entry of the
    expert dimension) when every one of them also splits the tokens; else () (no expert parallelism).
    One axis comes back as its name, several as a tuple (collectives take either)."""
    axes = axis_tuple(expert_spec_entry)
    if not axes or not set(axes) <= set(token_axes):
        return ()
    return axes[0] if len(axes) == 1 else axes


def _exclusive_cumsum(x, axis=-1):
    return jnp.cumsum(x, axis=axis) - x


def dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                            axis_name, capacity: int | None = None):
    """`jax.lax.ragged_all_to_all`'s result, computed with one dense `all_to_all`.

    Every slice bound for one device is packed into a [capacity, ...] buffer together with the row each
    element takes in the receiver's `output`; one all_to_all moves the R buffers and the receiver scatters
    them. `capacity` bounds the rows one device sends to any single device (default: all its operand rows,
    always enough). `recv_sizes` is implied by the senders' sizes and not read.
    """
    del recv_sizes
    R = math.prod(jax.lax.axis_size(a) for a in axis_tuple(axis_name))
    S = send_sizes.shape[0]
    if S % R:
        raise ValueError(f"ragged all-to-all: {S} slices do not divide over {R} devices")
    per_device = S // R
    cap = operand.shape[0] if capacity is None else capacity
    sizes_RS = send_sizes.reshape(R, per_device)
    ends_RS = jnp.cumsum(sizes_RS, axis=1)
    row_C = jnp.arange(cap, dtype=send_sizes.dtype)
    slot_RC = jax.vmap(lambda ends: jnp.searchsorted(ends, row_C, side="right"))(ends_RS)   # slice of each row
    valid_RC = slot_RC < per_device
    slot_RC = jnp.minimum(slot_RC, per_device - 1)
    within_RC = row_C - jnp.take_along_axis(ends_RS - sizes_RS, slot_RC, axis=1)
    src_RC = jnp.take_along_axis(input_offsets.reshape(R, per_device), slot_RC, axis=1) + within_RC
    dst_RC = jnp.take_along_axis(output_offsets.reshape(R, per_device), slot_RC, axis=1) + within_RC
    mask = valid_RC.reshape(R, cap, *(1,) * (operand.ndim - 1))
    rows = jnp.where(mask, operand[jnp.where(valid_RC, src_RC, 0)], jnp.zeros((), operand.dtype))
    dst_RC = jnp.where(valid_RC, dst_RC, output.shape[0])   # unused rows point past the end: dropped below
    rows = jax.lax.all_to_all(rows, axis_name, 0, 0)        # [R senders, cap, ...]
    dst_RC = jax.lax.all_to_all(dst_RC, axis_name, 0, 0)
    return output.at[dst_RC.reshape(-1)].set(rows.reshape(R * cap, *operand.shape[1:]), mode="drop")


def _scratch(shape, dtype, after):
    """A buffer that is written before it is read, or masked: no fill on TPU or GPU (a fill of a row-contiguous
    ragged all-to-all buffer costs XLA:TPU 3 ms per 240 MiB), zeros on CPU: `lax.empty`, taking `after` as an
    input it does not read. A bare `lax.empty` depends on nothing, so JAX's scan hoists it out of the layer
    loop, and XLA:TPU then copies the one hoisted buffer in every layer before an exchange writes into it
    (0.47 ms a layer for the flagship's v5p receive buffer)."""
    return _scratch_p.bind(jax.lax.stop_gradient(after), shape=tuple(shape), dtype=np.dtype(dtype))


def _empty(after, *, shape, dtype):
    return jax.lax.empty(shape, dtype)


_scratch_p = Primitive("lingpack_scratch")   # `_empty` with an input that pins it to its loop iteration
_scratch_p.def_impl(_empty)
_scratch_p.def_abstract_eval(lambda after, *, shape, dtype: jax.core.ShapedArray(shape, dtype))
mlir.register_lowering(_scratch_p, mlir.lower_fun(_empty, multiple_results=False))


def _on_received(experts_fn, masked: bool, params, x_RD, sizes_L):
    """`experts_fn` on a receive buffer whose rows past sum(sizes_L) were never written: they enter as zeros and
    leave as zeros (so their cotangents, also unwritten in the backward, are masked by this where's VJP);
    unmasked where `experts_fn` keeps them from every other row's result and from the parameter gradients."""
    if not masked:
        return experts_fn(params, x_RD, sizes_L)
    live_R1 = (jnp.arange(x_RD.shape[0]) < jnp.sum(sizes_L))[:, None]
    y_RF = experts_fn(params, jnp.where(live_R1, x_RD, jnp.zeros((), x_RD.dtype)), sizes_L)
    return jnp.where(live_R1, y_RF, jnp.zeros((), y_RF.dtype))


def _in_units(experts_fn, masked: bool, params, x_VUD, sizes_L):
    """`_on_received` on a receive buffer of V units of U rows, `sizes_L` counted in units; the result in units.
    The reshapes keep XLA:TPU's tiled layout (a unit is whole tiles): no copy."""
    V, U = x_VUD.shape[:2]
    y_RF = _on_received(experts_fn, masked, params, x_VUD.reshape(V * U, *x_VUD.shape[2:]), sizes_L * U)
    return y_RF.reshape(V, U, *y_RF.shape[1:])


def _move(operand, output, slices, *, axis_name, ragged: bool, pair_rows: int):
    """One exchange of `slices` (input offsets, send sizes, output offsets, receive sizes): XLA's ragged
    all-to-all when `ragged` and not on CPU, else `dense_ragged_all_to_all` with `pair_rows` per device."""
    if ragged and backend.current() != "cpu":
        return jax.lax.ragged_all_to_all(operand, output, *slices, axis_name=axis_name)
    return dense_ragged_all_to_all(operand, output, *slices, axis_name=axis_name, capacity=pair_rows)


def buffer_rows(M: int, R: int, local: int, top_k: int, capacity: float, exchange: str,
                unit: int = 1) -> tuple[int, int, int]:
    """(window, receive buffer, what one device sends one device per round), in units of `unit` rows, for M
    sorted rows a device sends (groups padded to whole units: `padded_rows`), R devices holding `local`
    experts each, a `capacity` factor over the balanced load.

    The worst case caps all three: one device can send one device at most M / top_k * min(top_k, local)
    rows (each token's distinct experts), plus a unit's padding per expert, so no window grows past what can
    ever arrive."""
    units = M // unit
    if unit == 1:
        pair_worst = M // top_k * min(top_k, local)
    else:   # M / unit units bound the tokens' N top_k / unit; the padding adds less than one unit per expert
        pair_worst = min(units, -(-units * min(top_k, local) // top_k) + local)
    step = lambda rows: 512 if rows >= 8192 else 128 if rows >= 1024 else ALIGN
    to_units = lambda rows: -(-(-(-rows // step(rows)) * step(rows)) // unit)
    if exchange == "ragged":
        window = min(to_units(math.ceil(capacity * M)), R * pair_worst)
        return window, window, min(window, pair_worst)
    window = min(to_units(math.ceil(capacity * M / R)), pair_worst)
    return window, R * window, window


class _Plan:
    """Who sends what to whom in each round, from the [R, E] counts table (identical on every device)."""

    def __init__(self, counts_SE, M: int, top_k: int, capacity: float, exchange: str, axis_name, unit: int = 1):
        R, E = counts_SE.shape   # counts in units
        L = E // R
        self.R, self.E, self.L, self.me = R, E, L, jax.lax.axis_index(axis_name)
        self.window, self.rows, self.pair_rows = buffer_rows(M, R, L, top_k, capacity, exchange, unit)
        self.counts_SJL = counts_SE.reshape(R, R, L)                        # sender, holder, holder's expert
        self.start_SE = _exclusive_cumsum(counts_SE)                        # each sender's sorted-row offsets
        if exchange == "ragged":   # position in the order rows arrive at the holder: experts first, then senders
            land_JLS = _exclusive_cumsum(self.counts_SJL.transpose(1, 2, 0).reshape(R, L * R)).reshape(R, L, R)
            self.pos_SJL = land_JLS.transpose(2, 0, 1)
        else:                      # position among the rows one sender sends one holder
            self.pos_SJL = _exclusive_cumsum(self.counts_SJL, axis=2)
        ends = self.pos_SJL + self.counts_SJL
        self.rounds = jnp.maximum(1, jnp.max(-(-ends // self.window)))     # windows the longest stream fills

    def round(self, r):
        """(forward slices, backward slices, local experts' group sizes [L]) of round `r`."""
        R, E, L, me, w = self.R, self.E, self.L, self.me, self.window
        lo = jnp.clip(r * w - self.pos_SJL, 0, self.counts_SJL)            # slice rows sent in earlier rounds
        n_SJL = jnp.clip((r + 1) * w - self.pos_SJL, 0, self.counts_SJL) - lo
        # this round's rows land expert-major (then senders) from the top of the holder's buffer
        land_JLS = _exclusive_cumsum(n_SJL.transpose(1, 2, 0).reshape(R, L * R)).reshape(R, L, R)
        mine_SL = n_SJL[:, me]
        forward = (self.start_SE[me] + lo[me].reshape(E), n_SJL[me].reshape(E),
                   land_JLS[:, :, me].reshape(E), mine_SL.reshape(E))
        back_to_SL = jax.lax.dynamic_slice_in_dim(self.start_SE, me * L, L, axis=1) + lo[:, me]
        backward = (jax.lax.dynamic_index_in_dim(land_JLS, me, 0, keepdims=False).T.reshape(E), mine_SL.reshape(E),
                    back_to_SL.reshape(E), n_SJL[me].reshape(E))
        return forward, backward, mine_SL.sum(0)


OVERFLOW_SCOPE = "expert_overflow_rounds"   # names the overflow loop in HLO metadata (op_name), where a cost
                                            # model counting loops of unknown trip count once can find it


def _rounds_loop(first, rest, rounds, carry):
    """`first(carry)`, then `rest(r, carry)` for r = 1 .. rounds - 1 (a while_loop, usually of no trip)."""
    carry = first(carry)
    with jax.named_scope(OVERFLOW_SCOPE):
        return jax.lax.while_loop(lambda c: c[0] < rounds, lambda c: (c[0] + 1, rest(c[0], c[1])), (1, carry))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def _dispatch(experts_fn, params, x_MUD, counts_SE, static):
    return _forward(experts_fn, params, x_MUD, counts_SE, static)[0]


def _forward(experts_fn, params, x_MUD, counts_SE, static):
    """x_MUD: M units of U rows each; counts_SE and every slice counted in units."""
    axis_name, top_k, capacity, exchange, masked = static
    (M, U), tail = x_MUD.shape[:2], x_MUD.shape[1:]
    plan = _Plan(counts_SE, M * U, top_k, capacity, exchange, axis_name, U)
    move = functools.partial(_move, axis_name=axis_name, ragged=exchange == "ragged", pair_rows=plan.pair_rows)
    experts_fn = functools.partial(_in_units, experts_fn, masked)
    rows_shape = jax.ShapeDtypeStruct((plan.rows, *tail), x_MUD.dtype)
    out_tail = jax.eval_shape(experts_fn, params, rows_shape, jnp.zeros((plan.L,), jnp.int32)).shape[1:]
    kept = []

    def one_round(r, y_MUF, keep=False):
        forward, backward, sizes_L = plan.round(r)
        x_buf = move(x_MUD, _scratch(rows_shape.shape, x_MUD.dtype, x_MUD), forward)
        if keep:   # round 0's residuals serve the backward (no recompute in the common one-round case)
            y_buf, vjp = jax.vjp(lambda p, x: experts_fn(p, x, sizes_L), params, x_buf)
            kept.append(vjp)
        else:
            y_buf = experts_fn(params, x_buf, sizes_L)
        return move(y_buf.astype(x_MUD.dtype), y_MUF, backward)

    y_MUF = _rounds_loop(lambda y: one_round(0, y, keep=True), one_round, plan.rounds,
                         _scratch((M, *out_tail), x_MUD.dtype, x_MUD))
    return y_MUF, (params, x_MUD, counts_SE, kept[0])


def _dispatch_fwd(experts_fn, params, x_MUD, counts_SE, static):
    return _forward(experts_fn, params, x_MUD, counts_SE, static)


def _dispatch_bwd(experts_fn, static, residuals, dy_MUF):
    axis_name, top_k, capacity, exchange, masked = static
    params, x_MUD, counts_SE, vjp0 = residuals
    experts_fn = functools.partial(_in_units, experts_fn, masked)
    plan = _Plan(counts_SE, x_MUD.shape[0] * x_MUD.shape[1], top_k, capacity, exchange, axis_name, x_MUD.shape[1])
    move = functools.partial(_move, axis_name=axis_name, ragged=exchange == "ragged", pair_rows=plan.pair_rows)
    tail, out_tail = x_MUD.shape[1:], dy_MUF.shape[1:]
    dy_MUF = dy_MUF.astype(x_MUD.dtype)   # cotangents travel in the compute dtype, as the outputs did

    def first(carry):
        dx_MUD, dp = carry
        forward, backward, _ = plan.round(0)
        dp_r, dx_buf = vjp0(move(dy_MUF, _scratch((plan.rows, *out_tail), dy_MUF.dtype, dy_MUF), forward))
        return move(dx_buf.astype(x_MUD.dtype), dx_MUD, backward), jax.tree.map(jnp.add, dp, dp_r)

    def rest(r, carry):   # an overflow round: exchange its inputs and cotangents, recompute its experts
        dx_MUD, dp = carry
        forward, backward, sizes_L = plan.round(r)
        # two exchanges, not one of [x, dy]: XLA hoists a loop-invariant concatenation out of the (usually
        # never taken) loop, into every step
        x_buf = move(x_MUD, _scratch((plan.rows, *tail), x_MUD.dtype, x_MUD), forward)
        dy_buf = move(dy_MUF, _scratch((plan.rows, *out_tail), dy_MUF.dtype, dy_MUF), forward)
        _, vjp = jax.vjp(lambda p, x: experts_fn(p, x, sizes_L), params, x_buf)
        dp_r, dx_buf = vjp(dy_buf)
        return move(dx_buf.astype(x_MUD.dtype), dx_MUD, backward), jax.tree.map(jnp.add, dp, dp_r)

    start = (_scratch(x_MUD.shape, x_MUD.dtype, dy_MUF), jax.tree.map(jnp.zeros_like, params))   # every dx row is written
    dx_MUD, dparams = _rounds_loop(first, rest, plan.rounds, start)
    return dparams, dx_MUD, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def dispatch(x_MD: jax.Array, sizes_E: jax.Array, experts_fn, params, *, axis_name, top_k: int = 1, unit: int = 1,
             capacity: float = 1.25, exchange: str = "ragged", masked: bool = True) -> tuple[jax.Array, jax.Array]:
    """(expert outputs of the rows `x_MD`, in x's dtype and order; rounds taken, int32) where `x_MD` is
    sorted by global expert (`sizes_E` rows each) and the experts live on the devices of `axis_name` (the EP
    group; call inside a shard_map over it). Rows travel in units of `unit` (module docstring): every group
    size is then a multiple of `unit` (`unit_layout`), its padding rows finite, their cotangents zeros.

    `experts_fn(params, x_LD, group_sizes_L)` runs this device's E / R local experts (`params`, a pytree)
    on rows sorted by local expert; rows past sum(group_sizes_L) are buffer space, never sent back. `masked`:
    they enter `experts_fn` as zeros and its results there are zeroed; False hands them over as they are
    (any value, NaN included) for an `experts_fn` whose other rows and parameter gradients never read them
    (Megablox, models/moe.py). `top_k`: the rows are M / top_k tokens' distinct experts. `capacity`: receive
    buffers hold `capacity` times the balanced load (module docstring); `exchange`: "ragged" or "dense".
    """
    if exchange not in EXCHANGES:
        raise ConfigError(f"expert exchange {exchange!r} is not one of {EXCHANGES}")
    (M, D), U = x_MD.shape, unit
    if M % U:
        raise ValueError(f"expert dispatch: {M} rows are not whole units of {U} (models/moe.py pads the groups)")
    counts_SE = jax.lax.all_gather(sizes_E.astype(jnp.int32) // U, axis_name)   # [R senders, E] units: row s = s's
    static = (axis_name, top_k, float(capacity), exchange, bool(masked))
    rounds = _Plan(counts_SE, M, top_k, capacity, exchange, axis_name, U).rounds
    y_MUF = _dispatch(experts_fn, params, x_MD.reshape(M // U, U, D), counts_SE, static)
    return y_MUF.reshape(M, -1), rounds.astype(jnp.int32)


def in_rounds(fn, rounds: int, *token_arrays, slices: int = 1):
    """`fn` over `rounds` consecutive slices of the token axis (axis 0), one after another (`lax.map`), each
    round's tokens split again into `slices` side by side.

    `fn` returns (rows [n, ...], a scalar): the rows come back in token order, the scalars' maximum beside
    them. The same rows travel as in one round, but every exchange buffer is 1 / rounds the size; each
    token's result is unchanged. Each round is rematerialised (`jax.checkpoint`): what stays live between
    the forward and the backward is the rounds' inputs, not their buffers.

    Slices are independent dispatches in one program (unrolled, not a loop), so the compiler may run one
    slice's exchange while another's experts compute; each slice's buffers are 1 / slices the size.
    """
    N = token_arrays[0].shape[0]
    if N % (rounds * slices):
        raise ConfigError(f"moe.expert_parallel_chunks={rounds} times moe.expert_parallel_slices={slices} must "
                          f"divide the {N} tokens each device routes (rows x sequence length per device); pick divisors")

    def sliced(*arrays):
        if slices == 1:
            return fn(*arrays)
        n = arrays[0].shape[0] // slices
        outs = [fn(*(a[i * n:(i + 1) * n] for a in arrays)) for i in range(slices)]
        return jnp.concatenate([y for y, _ in outs]), jnp.max(jnp.stack([taken for _, taken in outs]))

    if rounds == 1:
        return sliced(*token_arrays)
    split = [a.reshape(rounds, N // rounds, *a.shape[1:]) for a in token_arrays]
    one_round = jax.checkpoint(sliced)
    y, taken = jax.lax.map(lambda args: one_round(*args), split)
    return y.reshape(N, *y.shape[2:]), jnp.max(taken)
