"""Ulysses (all-to-all sequence <-> heads) and USP (Ulysses x ring) attention, on local shards.

Runs inside `shard_map` over the `context` axis of N = U * R devices, local shards `[B, H, T_local, *]`.
Devices are grouped U at a time (group g = devices gU .. gU+U-1, neighbours on the axis, the fast
links). An all-to-all inside each group trades the sequence split for a head split: every device then
holds H/U heads for the U * T_local tokens of its group. Plain Ulysses (U = N, R = 1) attends locally;
USP (R > 1) runs a ring (ring.py, stride U) between the R devices holding the same head group. A second
all-to-all restores the sequence split. Token indices and segment ids are gathered alongside, so masks
stay exact under any layout (load balancing included). The gradient is autodiff's transpose of the
all-to-alls around the local (or ring) custom VJP.
"""

from __future__ import annotations

import jax

from lingpack.kernels.attention.blockwise import Tiling, blockwise_attention
from lingpack.parallel.ring import Ring, ring_attention


def groups(ulysses: int, ring: int) -> list[list[int]] | None:
    """axis_index_groups of the Ulysses collectives (None: one group of the whole axis)."""
    return None if ring == 1 else [[g * ulysses + u for u in range(ulysses)] for g in range(ring)]


def check_heads(heads: int, ulysses: int) -> None:
    if heads % ulysses:
        raise ValueError(f"Ulysses splits the {heads} attention heads (per tensor shard) over "
                         f"{ulysses} devices, which does not divide them; choose parallel.context_ulysses (USP) or "
                         "parallel.context among the divisors of the head count, or use context_strategy=ring")


def ulysses_attention(q_BHTK, k_BHTK, v_BHTV, seg_BT, index_T, *, axis: str, ulysses: int, ring: int,
                      tiling: Tiling):
    """Local shards -> (o [B, H, T_local, V] fp32 or wider, tiles computed on this device)."""
    check_heads(q_BHTK.shape[1], ulysses)
    grp = groups(ulysses, ring)
    to_heads = lambda x: jax.lax.all_to_all(x, axis, 1, 2, tiled=True, axis_index_groups=grp)  # split H, gather T
    to_sequence = lambda x: jax.lax.all_to_all(x, axis, 2, 1, tiled=True, axis_index_groups=grp)
    q, k, v = to_heads(q_BHTK), to_heads(k_BHTK), to_heads(v_BHTV)
    seg = jax.lax.all_gather(seg_BT, axis, axis=1, tiled=True, axis_index_groups=grp)
    index = jax.lax.all_gather(index_T, axis, axis=0, tiled=True, axis_index_groups=grp)
    if ring == 1:
        o, count = blockwise_attention(q, k, v, seg, seg, index, index, tiling), None
    else:
        o, count = ring_attention(q, k, v, seg, seg, index, index, Ring(axis, ring, ulysses, tiling))
    return to_sequence(o), count
