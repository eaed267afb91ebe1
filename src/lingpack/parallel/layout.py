"""Where arrays live on the mesh: logical axis names -> mesh axes, for parameters and for activations.

Parameters carry logical names (models/ling3.py's docstring lists them); activations get them where the
model pins them with `constrain`:

    batch    rows of every [B, T, ...] activation   (default rule: data x fsdp x expert)
    length   tokens                                  (default rule: context)
    heads    flattened or per-head features of attention / KDA projections (tensor)
    mlp      SwiGLU hidden features (tensor)
    vocab    logits' vocabulary axis (tensor)
    None     replicated: the model width D of the residual stream

`ParallelConfig.rules` maps each name to mesh axes (one table for weights and activations, so a projection's
output is split like the weight columns that make it). The train step makes the mesh and rules ambient
while it traces the model and the loss, as `parallel/context.py` does for context parallelism:

    with activation_layout(Layout(mesh, rules)):     # train/step.py
        ...
    x = constrain(x_BTD, ("batch", "length", None))  # in a layer: pinned under a layout, unchanged otherwise

Outside a layout (tests, evaluation, conversion) `constrain` returns its input and `current_layout()` is
None, so single-device code never changes. Pinning the rows at every layer boundary is what keeps FSDP's
all-gathers on the weights: without it XLA's propagation follows the fsdp-sharded weight dimension onto
the activations and gathers every row onto every device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def axis_tuple(axes) -> tuple:
    """Mesh axes of a rule or PartitionSpec entry (None, one name, or a sequence of names) as a tuple."""
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def logical_to_mesh(logical: tuple, shape: tuple[int, ...], mesh: Mesh, rules, dropped: list | None = None) -> P:
    """PartitionSpec over mesh axes for one array with logical axis names `logical` and `shape`.

    A dimension whose mesh axes do not divide it, or whose mesh axis an earlier dimension already uses,
    stays replicated and is appended to `dropped` as (name, size, axes) when a list is given.
    """
    table = dict(rules)
    used, spec = set(), []
    for dim, name in enumerate(tuple(logical) + (None,) * (len(shape) - len(logical))):
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}. Add it to "
                             "ParallelConfig.logical_axis_rules")
        axes = tuple(a for a in axis_tuple(table.get(name)) if mesh.shape[a] > 1)
        size = math.prod(mesh.shape[a] for a in axes)
        if axes and (used & set(axes) or shape[dim] % size):
            if dropped is not None:
                dropped.append((name, shape[dim], axes))
            axes = ()
        used |= set(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*spec)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the logical axis rules (`ParallelConfig.rules`) that place arrays on it."""

    mesh: Mesh
    rules: tuple

    def spec(self, logical: tuple, shape: tuple[int, ...]) -> P:
        return logical_to_mesh(logical, shape, self.mesh, self.rules)

    def sharding(self, logical: tuple, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))

    def axes(self, name: str) -> tuple:
        """Mesh axes of size > 1 that the rule for `name` maps to."""
        return tuple(a for a in axis_tuple(dict(self.rules).get(name)) if self.mesh.shape[a] > 1)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("lingpack_activation_layout", default=None)


@contextlib.contextmanager
def activation_layout(layout: Layout | None):
    """Makes `layout` what `current_layout()` returns while tracing the enclosed code (None: no constraints)."""
    token = _ACTIVE.set(layout)
    try:
        yield layout
    finally:
        _ACTIVE.reset(token)


def current_layout() -> Layout | None:
    """The active Layout when its mesh has more than one device, else None."""
    layout = _ACTIVE.get()
    return layout if layout is not None and layout.mesh.size > 1 else None


def constrain(x: jax.Array, logical: tuple) -> jax.Array:
    """`x` pinned to the sharding its logical axis names give under the active layout; `x` itself without one."""
    layout = current_layout()
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, layout.sharding(logical, x.shape))


BTD = ("batch", "length", None)   # the residual stream and every [B, T, D] activation
