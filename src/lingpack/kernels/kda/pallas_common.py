"""Plumbing shared by the Pallas KDA kernels: interpret-mode choice, grid settings, per-chunk tables.

Per-token scalars (beta, segment ids) travel as lane-dense tables `[..., NT, C]` whose whole block stays
in VMEM for a (row, head); a kernel step picks its chunk's row with a one-hot sublane reduction (no
dynamic indexing). A `[C, 1]` column layout would pad every token to 128 lanes in HBM and VMEM.
"""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from lingpack.kernels.kda.pallas_chunk import iota

log = logging.getLogger(__name__)
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


def to_heads(x_BTHK, n_pad: int):
    """[B, T, H, K] -> [B, H, T + n_pad, K] (zero tail): the kernels' layout, one (C, K) tile per chunk."""
    x = jnp.moveaxis(x_BTHK, 2, 1)
    return jnp.pad(x, [(0, 0), (0, 0), (0, n_pad), (0, 0)]) if n_pad else x


def from_heads(x_BHTV, T: int):
    return jnp.moveaxis(x_BHTV[:, :, :T], 1, 2)


def check_head_dims(K: int, V: int, chunk_size: int) -> None:
    if chunk_size % 16 or chunk_size < 16:
        raise ValueError(f"Pallas KDA kernels need chunk_size a multiple of 16 (64 is the tuned value); got {chunk_size}")
    for name, d in (("K", K), ("V", V)):
        if d % 8:
            raise ValueError(f"Pallas KDA kernels need the {name} head dim to be a multiple of 8 (64 or 128 on TPU);"
                             f" got {d}")
