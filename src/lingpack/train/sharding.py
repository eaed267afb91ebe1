"""Device mesh, logical-axis rules and shardings for the train state and batches.

Mesh axes are always `data, fsdp, tensor, expert, context` (size-1 axes cost nothing). Parameters
carry logical axis names (`vocab, embed, mlp, heads, ...`, see models/ling3.py); `ParallelConfig.rules`
maps each to mesh axes. Activations: the batch axis goes over `batch` (data x fsdp x expert by
default), the sequence axis over `length` (context). A dimension that does not divide by its mesh axes,
or whose mesh axis is already used by an earlier dimension of the same array, stays replicated and is
listed by `sharding_report` (nothing is dropped silently). Sharding never changes the numbers: XLA inserts
the collectives, so every layout computes the single-device loss.
"""

from __future__ import annotations

import logging
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lingpack.parallel.layout import axis_tuple, logical_to_mesh  # noqa: F401  (logical_to_mesh re-exported)
from lingpack.train.configs import MESH_AXES, ParallelConfig


def mesh_shape(cfg: ParallelConfig, num_devices: int) -> dict[str, int]:
    """Axis sizes with the -1 axis resolved; raises when they do not multiply to `num_devices`."""
    sizes = cfg.axis_sizes()
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = [k for k, v in sizes.items() if v == -1]
    if rest:
        if num_devices % fixed:
            raise ValueError(f"mesh axes {sizes} leave {num_devices} devices / {fixed} = not an integer for "
                             f"{rest[0]!r}; make the fixed axes' product divide {num_devices}")
        sizes[rest[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh axes {sizes} multiply to {math.prod(sizes.values())}, but there are {num_devices} "
                         "devices; set one axis to -1 ('the rest') or make the product match")
    return sizes


def make_mesh(cfg: ParallelConfig, devices=None) -> Mesh:
    """A Mesh over `devices` (default: all) with axes MESH_AXES in that order."""
    if devices is None:
        devices = jax.devices()
        wanted = math.prod(cfg.axis_sizes().values())
        if wanted > 0 and wanted < len(devices):  # every axis fixed (no -1) and smaller: an explicit sub-mesh
            logging.getLogger("lingpack.train").warning(
                "parallel config uses %d of %d devices (set an axis to -1 to use them all)", wanted, len(devices))
            devices = devices[:wanted]
    devices = list(devices)
    sizes = mesh_shape(cfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    grid = expert_boxes(devices, sizes)
    if grid is None:
        try:
            from jax.experimental import mesh_utils
            grid = mesh_utils.create_device_mesh(shape, devices=devices)  # topology-aware on TPU
        except Exception:  # CPU / unusual device sets: plain order is as good as any
            grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


def expert_boxes(devices, sizes: dict[str, int]):
    """On a 2D TPU torus (v5e, v6e), a device grid whose every `expert` group is a compact box, or None.

    JAX's `create_device_mesh` gives each mesh axis whole torus dimensions there: an `expert` group of 8 on an
    8x8 slice is a line of 8, whose all-to-all crosses the one link at its middle; a 2x4 box crosses two
    (docs/planning.md#collectives-on-the-torus). So the torus is tiled with bx x by boxes of `expert` devices
    (bx x by = expert, as square as the sides allow, bx <= by) and the outer axes (data, fsdp) count the boxes,
    in a snake: their groups take one device from each box (JAX gives v5p's 3D cube this shape itself: the
    expert group a 2x2x2 cube, FSDP strided over cubes). Applies when `expert` > 1 is the only inner axis
    (tensor and context 1) and the devices fill a 2D rectangle; None otherwise (JAX's layout stands).
    """
    expert = sizes["expert"]
    if expert < 2 or sizes["tensor"] > 1 or sizes["context"] > 1 or not all(hasattr(d, "coords") for d in devices):
        return None
    coords = np.asarray([list(d.coords)[:3] for d in devices])
    if coords.shape[1] > 2 and (coords[:, 2] != coords[0, 2]).any():   # a 3D torus: JAX's layout is compact
        return None
    sides = coords[:, :2].max(axis=0) - coords[:, :2].min(axis=0) + 1
    X, Y = int(sides[0]), int(sides[1])
    if X * Y != len(devices) or len({tuple(c[:2]) for c in coords}) != len(devices):
        return None
    fits = [(bx, expert // bx) for bx in range(1, expert + 1)
            if expert % bx == 0 and X % bx == 0 and Y % (expert // bx) == 0]
    if not fits:
        return None
    bx, by = min(fits, key=lambda b: (max(b), b[0] > b[1]))
    if min(bx, by) == 1:
        return None   # a line either way: JAX's layout is as good
    at = {tuple(c[:2] - coords[:, :2].min(axis=0)): d for c, d in zip(coords, devices)}
    snake = [(i, j) for i in range(X // bx) for j in (range(Y // by) if i % 2 == 0 else reversed(range(Y // by)))]
    # boxes in a snake (each next to the one before), then each box's devices
    order = [at[(i * bx + a, j * by + b)] for i, j in snake for a in range(bx) for b in range(by)]
    return np.asarray(order, dtype=object).reshape(tuple(sizes[a] for a in MESH_AXES))


def tree_shardings(abstract_tree, logical_tree, mesh: Mesh, rules, dropped: list | None = None):
    """NamedShardings for `abstract_tree` (arrays / ShapeDtypeStructs) from a same-shaped tree of logical specs."""
    return jax.tree.map(lambda x, logical: NamedSharding(mesh, logical_to_mesh(tuple(logical or ()), x.shape, mesh,
                                                                               rules, dropped)),
                        abstract_tree, logical_tree, is_leaf=lambda x: isinstance(x, P) or x is None)


def like_params_shardings(abstract_tree, params_abstract, params_shardings, mesh: Mesh):
    """Shardings for an optimizer state: every sub-tree shaped like the params gets the params' shardings."""
    structure = jax.tree.structure(params_abstract)
    replicated = NamedSharding(mesh, P())

    def assign(sub):
        if jax.tree.structure(sub) == structure:
            return params_shardings
        return jax.tree.map(lambda _: replicated, sub)
    return jax.tree.map(assign, abstract_tree, is_leaf=lambda sub: jax.tree.structure(sub) == structure)


def batch_spec(mesh: Mesh, rules) -> P:
    """[B, T] batch arrays: rows over the `batch` rule's axes, tokens over the `length` rule's axes."""
    table = dict(rules)
    spec = []
    for name in ("batch", "length"):
        axes = tuple(a for a in axis_tuple(table.get(name)) if mesh.shape[a] > 1)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*spec)


def batch_divisor(mesh: Mesh, rules) -> int:
    """The number of row shards: micro-batch rows must be a multiple of it."""
    return math.prod(mesh.shape[a] for a in axis_tuple(dict(rules).get("batch")))


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh, rules))


def shard_batch(batch: dict, mesh: Mesh, rules, global_rows: int | None = None) -> dict:
    """This process's numpy rows (`distributed.process_rows` of `batch_sharding`) -> global sharded jax arrays.

    `global_rows` defaults to the local rows times the process count (equal contiguous blocks).
    """
    from lingpack import distributed
    if global_rows is None:
        global_rows = len(next(iter(batch.values()))) * jax.process_count()
    return distributed.global_batch(batch, batch_sharding(mesh, rules), global_rows)


def sharding_report(dropped: list) -> list[str]:
    """Readable lines for dimensions left replicated (from the `dropped` lists above), deduplicated."""
    return sorted({f"logical axis {name!r} (size {size}) not sharded over {axes}: not divisible or axis reused"
                   for name, size, axes in dropped})
