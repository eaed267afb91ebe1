"""Pallas kernels on a sharded mesh: `over_mesh` runs a kernel per shard inside `jax.shard_map`.

XLA cannot partition a Mosaic custom call ("Mosaic kernels cannot be automatically partitioned. Please
wrap the call in a shard_map"), so every Pallas kernel the model calls (the KDA kernels, splash
attention) is wrapped once, where it is defined, by this one helper. The kernel declares where batch
rows and heads sit in each array argument (`Dims`); the helper finds the mesh, picks the mesh axes and
builds the specs, so callers pass nothing extra.

The mesh is the ambient one (`jax.set_mesh`, `use_abstract_mesh`, an enclosing `shard_map`) or else the
one the lead array's sharding carries (a jit's in_shardings and committed arrays both put it on the
avals). Mapped axes, read from the lead array (the first argument):
  rows   the mesh axes of its batch dim when the sharding names them (explicit mode), else the project's
         row axes `data, fsdp, expert` (train/sharding.py's `batch` rule) that divide B, in mesh order;
  heads  likewise from its head dim, else `tensor` when it divides H.
Every other free axis (e.g. `context`) is manual too but unmapped (Mosaic needs all axes manual): the
kernel sees whole rows, replicated over it (context parallelism runs its own shard_map over `context`
around the kernels). Axes already manual (inside an enclosing shard_map) are left alone. Each shard
runs the whole kernel wrapper on its local rows and heads: it sees local shapes (e.g. splash builds its
multi-head mask for the local head count; `pallas_varlen` its cu_seqlens per shard).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.sharding import PartitionSpec as P

ROW_AXES = ("data", "fsdp", "expert")
HEAD_AXES = ("tensor",)


@dataclasses.dataclass(frozen=True)
class Dims:
    """Where one array's batch rows and heads sit (None: that array has no such dim; it is not split there)."""
    rows: int | None = None
    heads: int | None = None


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


def mapped_axes(x, dims: Dims = Dims(0, 2), *, kernel: str = "a Pallas kernel") -> tuple:
    """(mesh, row axes, head axes) that `over_mesh` maps for the lead array `x` (rows and heads at `dims`)."""
    mesh = _mesh(x)
    if mesh.empty:
        return mesh, (), ()
    spec = tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()) + (None,) * x.ndim
    declared = lambda d: _as_tuple(spec[d]) if d is not None else ()
    size = lambda d: x.shape[d] if d is not None else 1
    rows = _pick(mesh, declared(dims.rows), ROW_AXES if dims.rows is not None else (), size(dims.rows), set())
    heads = _pick(mesh, declared(dims.heads), HEAD_AXES if dims.heads is not None else (), size(dims.heads), set(rows))
    for d, axes in ((dims.rows, rows), (dims.heads, heads)):
        if axes and size(d) % math.prod(mesh.shape[a] for a in axes):
            raise ValueError(f"{kernel}: a dim of size {size(d)} is sharded over mesh axes {axes} of sizes "
                             f"{[mesh.shape[a] for a in axes]}, which do not divide it; reshard the inputs so they do")
    return mesh, rows, heads


def _spec(dims: Dims | None, rank: int, rows: tuple, heads: tuple) -> P:
    spec = [None] * rank
    if dims is not None:
        for d, axes in ((dims.rows, rows), (dims.heads, heads)):
            if d is not None and axes:
                spec[d] = axes if len(axes) > 1 else axes[0]
    return P(*spec)


def over_mesh(fn=None, *, args: tuple, kwargs: dict | None = None, out, kernel: str):
    """Wrap a Pallas kernel's entry `fn(*arrays, **kw)` to run per shard of the mesh (a decorator or a call).

    args:   one `Dims` per positional array (the first is the lead array the axes are read from);
    kwargs: `Dims` of the keyword arrays (absent or None at a call: passed through as None); every other
            keyword is static and reaches each shard unchanged;
    out:    `Dims` per output, in the output's tree structure (a None output leaf is fine);
    kernel: the kernel's name for error messages.
    """
    if fn is None:
        return functools.partial(over_mesh, args=args, kwargs=kwargs, out=out, kernel=kernel)
    array_kwargs = dict(kwargs or {})

    @functools.wraps(fn)
    def wrapped(*arrays, **kw):
        if len(arrays) != len(args):
            raise TypeError(f"{kernel}: expected {len(args)} positional arrays, got {len(arrays)}")
        mesh, rows, heads = mapped_axes(arrays[0], args[0], kernel=kernel)
        if not _free_axes(mesh):   # no mesh, or inside a shard_map that made every axis manual
            return fn(*arrays, **kw)
        named = {name: kw.pop(name) for name in array_kwargs if kw.get(name) is not None}
        in_specs = (tuple(_spec(d, x.ndim, rows, heads) for d, x in zip(args, arrays)),
                    {name: _spec(array_kwargs[name], x.ndim, rows, heads) for name, x in named.items()})
        out_specs = jax.tree.map(lambda d: _spec(d, _rank(d), rows, heads), out,
                                 is_leaf=lambda d: isinstance(d, Dims))

        def local(arrays, named):
            return fn(*arrays, **named, **kw)
        return jax.shard_map(local, mesh=mesh, axis_names=set(_free_axes(mesh)), check_vma=False,
                             in_specs=in_specs, out_specs=out_specs)(tuple(arrays), named)
    return wrapped


def _rank(dims: Dims) -> int:
    """A PartitionSpec may be shorter than its array: it must only reach the last mapped dim."""
    return 1 + max(d for d in (dims.rows, dims.heads, -1) if d is not None)
