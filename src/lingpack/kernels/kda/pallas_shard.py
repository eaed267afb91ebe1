"""Where the Pallas KDA kernels keep batch rows and heads, for `kernels/shard.py`'s `over_mesh`.

`over_mesh(fn)` wraps an implementation `fn(q, k, v, g, beta, **kwargs) -> (o, final_state)` so that it
runs per shard inside `jax.shard_map` over the row axes (`data, fsdp, expert`) and heads (`tensor`); the
sequence stays local (KDA is a recurrence over it; context parallelism passes states in its own code).
"""

from __future__ import annotations

from lingpack.kernels.shard import Dims
from lingpack.kernels.shard import over_mesh as _over_mesh

TILE = Dims(rows=0, heads=2)   # q, k, v, g [B, T, H, *]; beta [B, T, H]; o [B, T, H, V]
over_mesh = _over_mesh(
    args=(TILE, TILE, TILE, TILE, TILE),
    kwargs={"segment_ids_BT": Dims(rows=0), "initial_state_BHKV": Dims(rows=0, heads=1),
            "A_log": Dims(heads=0), "dt_bias": Dims(heads=0)},   # dt_bias [H*K] is head-major: split by heads
    out=(TILE, Dims(rows=0, heads=1)),                             # (o, final_state [B, H, K, V])
    kernel="Pallas KDA")
