"""How a layer learns it runs context-parallel, and the softmax-attention entry point under CP.

`ContextParallel` is the one small frozen object that says so: the mesh, the strategy, the Ulysses
degree and the token layout. The train step makes it ambient for the model and loss it traces:

    with context_parallel(cp):          # train/step.py, around model + loss
        ...
    cp = current()                      # in a layer: None unless a `context` axis of size > 1 is active

A layer with order- or length-dependent math asks `current()`; under CP its inputs are the local view
of a row whose T axis is sharded over `cp.axis` in `cp.layout` (see reorder.py). Outside the context
(tests, evaluation, conversion) every layer runs its single-device code, unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from lingpack.kernels.attention.blockwise import Tiling, blockwise_attention
from lingpack.parallel.reorder import check_length, zigzag_permutation
from lingpack.parallel.ring import Ring, ring_attention
from lingpack.parallel.ulysses import ulysses_attention
from lingpack.train.configs import CONTEXT_STRATEGIES, ParallelConfig


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The sequence axis of every [B, T, ...] activation is sharded over `mesh.shape[axis]` devices.

    strategy: softmax attention's exchange (ring | all_gather | ulysses | usp). ulysses: the USP head
    split U (ring degree = size / U). load_balance: the row is zigzag-reordered (device r holds chunks
    r and 2N-1-r of 2N) by the data path; False = contiguous shards. batch_axes / head_axes: mesh axes
    the batch / head dimension may additionally be sharded over inside shard_map (when they divide).
    """

    mesh: Mesh
    strategy: str = "ring"
    ulysses: int = 1
    load_balance: bool = True
    axis: str = "context"
    batch_axes: tuple = ("data", "fsdp", "expert")
    head_axes: tuple = ("tensor",)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, mesh: Mesh) -> "ContextParallel | None":
        """The train loop's CP settings for `mesh` (None when its context axis has one device)."""
        if mesh.shape.get("context", 1) == 1:
            return None
        rules = dict(cfg.rules)
        as_tuple = lambda a: tuple(a) if isinstance(a, (tuple, list)) else ((a,) if a else ())
        return cls(mesh, cfg.context_strategy, cfg.context_ulysses, cfg.load_balance,
                   batch_axes=as_tuple(rules.get("batch")), head_axes=as_tuple(rules.get("heads")))

    def __post_init__(self):
        if self.axis not in self.mesh.shape:
            raise ValueError(f"context parallelism needs a mesh axis {self.axis!r}; the mesh has {dict(self.mesh.shape)}")
        if self.strategy not in CONTEXT_STRATEGIES:
            raise ValueError(f"parallel.context_strategy={self.strategy!r} is not valid; choose one of "
                             f"{CONTEXT_STRATEGIES}")
        if self.strategy == "usp":
            if self.ulysses < 1 or self.size % self.ulysses:
                raise ValueError(f"parallel.context_ulysses={self.ulysses} must divide parallel.context={self.size} "
                                 "(USP runs a ring of context / context_ulysses devices)")
        elif self.ulysses != 1:
            raise ValueError(f"parallel.context_ulysses={self.ulysses} applies only to context_strategy=usp (got "
                             f"{self.strategy!r}); set it to 1 or switch the strategy to usp")

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def degrees(self) -> tuple[int, int]:
        """(Ulysses degree U, ring degree R) with U * R = size."""
        u = {"ring": 1, "all_gather": 1, "ulysses": self.size, "usp": self.ulysses}[self.strategy]
        return u, self.size // u

    def token_index(self, length: int) -> np.ndarray:
        """int32 [T]: the original position of each token of the (reordered) row."""
        perm = zigzag_permutation(length, self.size) if self.load_balance else np.arange(length)
        return perm.astype(np.int32)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("lingpack_context_parallel", default=None)


@contextlib.contextmanager
def context_parallel(cp: ContextParallel | None):
    """Makes `cp` what `current()` returns while tracing the enclosed code (None: single device)."""
    token = _ACTIVE.set(cp)
    try:
        yield cp
    finally:
        _ACTIVE.reset(token)


def current() -> ContextParallel | None:
    """The active ContextParallel when its axis has more than one device, else None."""
    cp = _ACTIVE.get()
    return cp if cp is not None and cp.size > 1 else None


def dividing_axes(mesh: Mesh, axes, size: int):
    """The PartitionSpec entry that splits a dimension of `size` over `axes` (those of size > 1 in `mesh`):
    one axis name, a tuple of them, or None (replicated) when there are none or their product does not
    divide `size` (e.g. B=1 rows over a data axis stay whole)."""
    axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
    if not axes or size % math.prod(mesh.shape[a] for a in axes):
        return None
    return axes[0] if len(axes) == 1 else axes


def attention_block(cp: ContextParallel, length: int, block: int) -> int:
    """Tile size: `block`, capped at the length of one layout chunk, which it must divide."""
    check_length(length, cp.size, cp.load_balance)
    chunk = length // (2 * cp.size if cp.load_balance else cp.size)
    tile = min(block, chunk)
    if chunk % tile:
        raise ValueError(f"attention block {block} does not divide the context-parallel chunk of {chunk} tokens "
                         f"(T={length} over {'2 x ' if cp.load_balance else ''}context={cp.size}); set "
                         "model.attention_block_size to a divisor of it")
    return tile


def context_attention(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT, *, cp: ContextParallel, scale: float,
                      block: int = 128, return_stats: bool = False, impl: str = "flash",
                      interpret: bool | None = None, residual_name: str | None = None):
    """Causal segment-masked attention of global [B, T, H, *] arrays whose T axis is in `cp`'s layout.

    The same mask as kernels/attention (`masks.allowed`) on the ORIGINAL token order. Output in q's dtype,
    [B, T, H, V] in the same layout. `return_stats`: also the tiles each device computed ([devices] int32;
    ring / usp only; zeros otherwise). `impl`: the attention implementation the model resolved
    (kernels/attention/api.py `resolve`); "splash" runs the ring strategy's tiles in splash
    (ring_splash.py; `interpret` as for splash), every other case the XLA tiles of blockwise.py.
    `residual_name`: the name the custom VJP's kept output and logsumexp carry (blockwise.name_residuals).
    """
    B, T, H, K = q_BTHK.shape
    tiling = Tiling(float(scale), True, *(attention_block(cp, T, block),) * 2, residual_name)
    U, R = cp.degrees
    in_splash = impl == "splash" and cp.strategy == "ring"
    if in_splash and jnp.float64 in (q_BTHK.dtype, k_BTHK.dtype, v_BTHV.dtype):
        raise ValueError("impl='splash' is a Pallas kernel computing in fp32: float64 inputs would be rounded; use "
                         "model.attention_impl=flash or auto")
    if in_splash and tiling.block_q % 128:
        raise ValueError(f"the splash ring's tile is {tiling.block_q} tokens (model.attention_block_size={block}, capped "
                         f"at one context-parallel chunk of T={T}); splash needs a multiple of 128: set "
                         "model.attention_block_size to one and keep T / (2 x context) at least that long")
    if in_splash:   # Pallas imports only when used
        from lingpack.kernels.attention.splash import resolve_interpret
        from lingpack.parallel import ring_splash
        ring = ring_splash.SplashRing(cp.axis, cp.size, cp.load_balance, float(scale), tiling.block_q,
                                      resolve_interpret(interpret), residual_name)
    batch = dividing_axes(cp.mesh, cp.batch_axes, B)
    heads = dividing_axes(cp.mesh, cp.head_axes, H)
    x_spec, seg_spec = P(batch, cp.axis, heads, None), P(batch, cp.axis)
    flat = lambda a: a if isinstance(a, tuple) else ((a,) if a else ())
    used = flat(batch) + (cp.axis,) + flat(heads)

    def local(q, k, v, seg, index):
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))        # [B, H, T_local, *]
        if in_splash:
            o = ring_splash.splash_ring_attention(q, k, v, seg, ring)
            o = jnp.where((seg != 0)[:, None, :, None], o, 0.0)   # padding outputs 0, as the XLA tiles give
            count = ring_splash.computed_tiles(ring, q.shape[2], jax.lax.axis_index(cp.axis))
        elif cp.strategy == "ring":
            o, count = ring_attention(q, k, v, seg, seg, index, index, Ring(cp.axis, R, 1, tiling))
        elif cp.strategy == "all_gather":                           # q stays, the whole K/V row is gathered
            gather = lambda x, dim: jax.lax.all_gather(x, cp.axis, axis=dim, tiled=True)
            o = blockwise_attention(q, gather(k, 2), gather(v, 2), seg, gather(seg, 1), index, gather(index, 0), tiling)
            count = None
        else:
            o, count = ulysses_attention(q, k, v, seg, index, axis=cp.axis, ulysses=U, ring=R, tiling=tiling)
        o = jnp.swapaxes(o, 1, 2).astype(q_BTHK.dtype)
        return (o, jnp.reshape(jnp.int32(0) if count is None else count, (1,))) if return_stats else o

    out_specs = (x_spec, P(used)) if return_stats else x_spec
    fn = jax.shard_map(local, mesh=cp.mesh, in_specs=(x_spec, x_spec, x_spec, seg_spec, P(cp.axis)),
                       out_specs=out_specs, check_vma=False)
    return fn(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT.astype(jnp.int32), jnp.asarray(cp.token_index(T)))
