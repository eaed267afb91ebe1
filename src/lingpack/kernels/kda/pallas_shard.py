"""Pallas KDA kernels on a sharded mesh: `shard_map` over batch rows and heads, the sequence local.

XLA cannot partition a Mosaic custom call ("Mosaic kernels cannot be automatically partitioned"), so a
Pallas implementation registered through `over_mesh` runs per shard inside `jax.shard_map`. The mesh is
the ambient one (`jax.set_mesh`, `use_abstract_mesh`, an enclosing `shard_map`) or else the one the
inputs' sharding carries (a jit's in_shardings and committed arrays both put it on the avals), so callers
pass nothing extra. Mapped axes:
  rows   the mesh axes of q's batch dim when the sharding names them (explicit mode), else the project's
         row axes `data, fsdp, expert` (train/sharding.py's `batch` rule) that divide B, in mesh order;
  heads  likewise from q's head dim, else `tensor` when it divides H.
Every other free axis (e.g. `context`) is manual too but unmapped (Mosaic needs all axes manual): the
kernels see whole rows, replicated over it (KDA is a recurrence over the sequence; context parallelism
hands per-shard states around in its own code). Axes already manual (inside an enclosing shard_map)
are left alone. Each shard runs the whole wrapper on its local
rows, so `pallas_varlen` builds its cu_seqlens and chunk tables per shard (a shard holds no more
segments than the batch, so `max_segs` still bounds it).
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import PartitionSpec as P

ROW_AXES = ("data", "fsdp", "expert")
HEAD_AXES = ("tensor",)
ARRAY_KWARGS = {  # keyword arrays of the implementations: (rows dim, heads dim) or None where absent
    "segment_ids_BT": (0, None), "initial_state_BHKV": (0, 1), "A_log": (None, 0), "dt_bias": (None, 0)}


def _mesh(x):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", mesh)
    return mesh


def _as_tuple(axes) -> tuple:
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _free_axes(mesh) -> tuple:
    return tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)


def _pick(mesh, declared, defaults, size: int, taken: set) -> tuple:
    """Mesh axes for one dim: the declared ones if any, else the defaults (mesh order) whose product divides size."""
    free = [a for a in _free_axes(mesh) if mesh.shape[a] > 1 and a not in taken]
    if declared:
        return tuple(a for a in declared if a in free)
    axes, product = [], 1
    for a in free:
        if a in defaults and size % (product * mesh.shape[a]) == 0:
            axes.append(a)
            product *= mesh.shape[a]
    return tuple(axes)


def mapped_axes(q_BTHK) -> tuple:
    """(mesh, row axes, head axes) that `over_mesh` maps for q's shape and sharding."""
    mesh = _mesh(q_BTHK)
    if mesh.empty:
        return mesh, (), ()
    spec = tuple(getattr(getattr(jax.typeof(q_BTHK), "sharding", None), "spec", None) or ()) + (None,) * 4
    B, _, H, _ = q_BTHK.shape
    rows = _pick(mesh, _as_tuple(spec[0]), ROW_AXES, B, set())
    heads = _pick(mesh, _as_tuple(spec[2]), HEAD_AXES, H, set(rows))
    for dim, axes in ((B, rows), (H, heads)):
        if dim % math.prod(mesh.shape[a] for a in axes):
            raise ValueError(f"Pallas KDA: a dim of size {dim} is sharded over mesh axes {axes} of sizes "
                             f"{[mesh.shape[a] for a in axes]}, which do not divide it; reshard q/k/v so they do")
    return mesh, rows, heads


def _spec(rows, heads, layout) -> P:
    """PartitionSpec from `layout` = ((rows dim, heads dim), rank); a None dim is not mapped."""
    dims, rank = layout
    spec = [None] * rank
    for dim, axes in zip(dims, (rows, heads)):
        if dim is not None and axes:
            spec[dim] = axes if len(axes) > 1 else axes[0]
    return P(*spec)


def over_mesh(fn):
    """Wrap a Pallas implementation `fn(q, k, v, g, beta, **kwargs) -> (o, final_state)` to run per shard."""
    @functools.wraps(fn)
    def wrapped(q, k, v, g, beta, **kwargs):
        mesh, rows, heads = mapped_axes(q)
        if not _free_axes(mesh):   # no mesh, or inside a shard_map that made every axis manual
            return fn(q, k, v, g, beta, **kwargs)
        arrays = {name: kwargs.pop(name) for name in ARRAY_KWARGS if kwargs.get(name) is not None}
        tile = _spec(rows, heads, ((0, 2), 4))
        array_specs = {name: _spec(rows, heads, (ARRAY_KWARGS[name], x.ndim)) for name, x in arrays.items()}

        def local(q, k, v, g, beta, arrays):
            return fn(q, k, v, g, beta, **arrays, **kwargs)
        return jax.shard_map(local, mesh=mesh, axis_names=set(_free_axes(mesh)), check_vma=False,
                             in_specs=(tile, tile, tile, tile, _spec(rows, heads, ((0, 2), 3)), array_specs),
                             out_specs=(tile, _spec(rows, heads, ((0, 1), 4))))(q, k, v, g, beta, arrays)
    return wrapped
