"""Expert parallelism by token all-to-all: each device computes only its own experts.

Inside the MoE's shard_map (models/moe.py) every device has routed its own tokens and sorted its N*k
(token, expert) assignments by expert. With the experts split over the `ep` mesh axes (R devices, E / R
consecutive experts each), `dispatch` then

1. all-gathers the per-expert assignment counts (an [R, E] int32 table: the only global routing state),
2. sends every assignment row to the device that holds its expert, one slice per (device, local expert),
   written straight into the receiver's expert-major order (experts, then senders in device order),
3. runs the local experts' grouped matmuls on what arrived,
4. sends each result row back into the sender's sorted order, where the MoE combines as on one device.

Nothing is dropped: the receive buffer holds R * N * min(k, E / R) rows, the case where every device sends
all it can to one device (the dropless worst case; AI-Hypercomputer/maxtext:src/MaxText/layers/moe.py sizes
it R * N * k).
Each row visits the same expert with the same weights as on one device, so outputs and gradients agree with
one device up to the summation order of the expert-weight gradients.

The exchange is `jax.lax.ragged_all_to_all` on TPU and GPU. XLA:CPU has no ragged all-to-all, so on CPU
(chosen by `lingpack.backend.current()`) `dense_ragged_all_to_all` computes the same result exactly with one
`all_to_all` of per-destination buffers sized for the worst case. `backend.target("tpu")` traces the ragged
program from a CPU host (for export).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lingpack import backend
from lingpack.errors import ConfigError
from lingpack.parallel.layout import axis_tuple

RAGGED_ALL_TO_ALL = "ragged_all_to_all"   # its StableHLO custom-call target (jax.export waives its check by name)


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
    """`jax.lax.ragged_all_to_all`'s result, computed with one dense `all_to_all` (for XLA:CPU).

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


def exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
             capacity: int | None = None):
    """The platform's ragged all-to-all: XLA's on TPU/GPU, `dense_ragged_all_to_all` on CPU."""
    if backend.current() == "cpu":
        return dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                       axis_name=axis_name, capacity=capacity)
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis_name)


def dispatch(x_MD: jax.Array, sizes_E: jax.Array, experts_fn, *, axis_name, top_k: int = 1) -> jax.Array:
    """Expert outputs of the rows `x_MD` (sorted by global expert, `sizes_E` rows each), computed where the
    experts live; returned in the same order. Call inside a shard_map over `axis_name` (the EP group).

    `experts_fn(x_LD, group_sizes_L)` runs this device's E / R local experts on rows sorted by local expert
    (rows past sum(group_sizes_L) are buffer space: their results are never sent back). `top_k`: the rows
    are M / top_k tokens' distinct experts, so one device's L experts get at most min(top_k, L) rows of a
    token: the buffers hold R * M / top_k * min(top_k, L) received rows, never fewer than can arrive.
    """
    M, _ = x_MD.shape
    E = sizes_E.shape[0]
    me = jax.lax.axis_index(axis_name)
    counts_SE = jax.lax.all_gather(sizes_E.astype(jnp.int32), axis_name)   # [R senders, E]: row s = s's counts
    R = counts_SE.shape[0]
    local = E // R
    per_peer = M // top_k * min(top_k, local)     # rows one device can send to (and get back from) one device
    counts_SJL = counts_SE.reshape(R, R, local)                            # sender, holder, holder's expert
    # where sender s's rows for expert (j, l) land on holder j: experts first, then senders in device order
    land_JLS = _exclusive_cumsum(counts_SJL.transpose(1, 2, 0).reshape(R, local * R)).reshape(R, local, R)
    start_SE = _exclusive_cumsum(counts_SE)                                # each sender's sorted-row offsets
    mine_SL = counts_SJL[:, me]                                            # what each sender sends me
    to_me = jax.lax.dynamic_index_in_dim(land_JLS, me, axis=0, keepdims=False)     # [L, S]
    x_LD = exchange(x_MD, jnp.zeros((R * per_peer, x_MD.shape[1]), x_MD.dtype),
                    start_SE[me], counts_SE[me], land_JLS[:, :, me].reshape(E), mine_SL.reshape(E),
                    axis_name=axis_name, capacity=per_peer)
    y_LD = experts_fn(x_LD, mine_SL.sum(0))
    back_to = jax.lax.dynamic_slice_in_dim(start_SE, me * local, local, axis=1)    # [S, L] in senders' order
    return exchange(y_LD, jnp.zeros((M, y_LD.shape[1]), y_LD.dtype),
                    to_me.T.reshape(E), mine_SL.reshape(E), back_to.reshape(E), counts_SE[me],
                    axis_name=axis_name, capacity=per_peer)


def in_rounds(fn, rounds: int, *token_arrays):
    """`fn` over `rounds` consecutive slices of the token axis (axis 0), one after another (`lax.map`).

    The same rows travel as in one round, but every exchange buffer (and the worst-case receive buffer
    the grouped matmuls run over) is 1 / rounds the size; each token's result is unchanged. Each round is
    rematerialised (`jax.checkpoint`): the backward recomputes its exchange and experts, so what stays
    live between the forward and the backward is the rounds' inputs, not their buffers.
    """
    N = token_arrays[0].shape[0]
    if rounds == 1:
        return fn(*token_arrays)
    if N % rounds:
        raise ConfigError(f"moe.expert_parallel_chunks={rounds} must divide the {N} tokens each device routes "
                          "(rows x sequence length per device); pick a divisor")
    split = [a.reshape(rounds, N // rounds, *a.shape[1:]) for a in token_arrays]
    one_round = jax.checkpoint(fn)
    y = jax.lax.map(lambda args: one_round(*args), split)
    return y.reshape(N, *y.shape[2:])
