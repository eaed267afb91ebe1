"""Repeated layer cycles run by a scan, so compile time does not grow with depth.

A Ling3 cycle is `interval - 1` KDA layers then one MLA layer (all MoE). `LayerCycles` holds n such cycles
with every parameter stacked: the KDA layers' as `[n, interval - 1, ...]`, the MLA layer's as `[n, ...]`.
Its call is a scan over cycles whose body is a scan over the KDA run and then the MLA layer, so XLA
compiles ONE KDA layer and ONE MLA layer whatever n is. Logical sharding names get `None` (replicated)
for the stack axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lingpack.models.block import DecoderLayer

STACKED_AXES = {"kda": 2, "mla": 1}  # leading stack axes of `LayerCycles.<name>` parameters


def stack_modules(modules: list[nnx.Module]) -> nnx.Module:
    """One module of the same structure whose every variable stacks the modules' values on a new axis 0."""
    graphdef, first = nnx.split(modules[0])
    states = [first] + [nnx.split(m)[1] for m in modules[1:]]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    for _, var in nnx.to_flat_state(stacked):
        names = var.get_metadata().get("out_sharding")
        if names is not None:
            var.set_metadata(out_sharding=(None,) + tuple(names))
    return nnx.merge(graphdef, stacked)


class LayerCycles(nnx.Module):
    """n cycles of (interval - 1) KDA layers + 1 MLA layer, built from unrolled layers (same weights)."""

    def __init__(self, layers: list[DecoderLayer], interval: int):
        if len(layers) % interval or any(l.ffn != "moe" for l in layers):
            raise ValueError(f"LayerCycles needs whole cycles of {interval} MoE layers; got {len(layers)} layers")
        cycles = [layers[c:c + interval] for c in range(0, len(layers), interval)]
        if any([l.mixer for l in c] != ["kda"] * (interval - 1) + ["mla"] for c in cycles):
            raise ValueError(f"each cycle must be {interval - 1} KDA layers then one MLA layer")
        self.num_cycles, self.interval = len(cycles), interval
        self.kda = stack_modules([stack_modules(c[:-1]) for c in cycles]) if interval > 1 else None
        self.mla = stack_modules([c[-1] for c in cycles])

    def __call__(self, x_BTD, segment_ids_BT, positions_BT, run):
        """-> (x_BTD, moe aux dict of arrays stacked in layer order [n * interval, ...]).

        `run(layer, x, segment_ids, positions)` applies one layer (the caller's remat wrapper). The scans
        are `lax.scan`s over the split (pure) stacked state: a layer call mutates nothing, so there is
        nothing for NNX to write back.
        """
        mla_def, mla_state = nnx.split(self.mla)

        def one(graphdef, x, state):
            return run(nnx.merge(graphdef, state), x, segment_ids_BT, positions_BT)

        if self.kda is None:  # interval 1: every layer is MLA
            return jax.lax.scan(lambda x, s: one(mla_def, x, s), x_BTD, mla_state)
        kda_def, kda_state = nnx.split(self.kda)

        def cycle(x, states):
            kda_cycle, mla_layer = states
            x, kda_aux = jax.lax.scan(lambda x, s: one(kda_def, x, s), x, kda_cycle)
            x, mla_aux = one(mla_def, x, mla_layer)
            return x, (kda_aux, mla_aux)

        x_BTD, (kda_aux, mla_aux) = jax.lax.scan(cycle, x_BTD, (kda_state, mla_state))
        # [n, I-1, ...] and [n, ...] -> [n * I, ...]: layer order inside each cycle, cycles in order
        aux = jax.tree.map(lambda k, m: jnp.concatenate([k, m[:, None]], axis=1), kda_aux, mla_aux)
        return x_BTD, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux)

    def layer(self, index: int) -> tuple[DecoderLayer, tuple[int, ...]]:
        """(stacked module, index into its stack axes) of the cycles' `index`-th layer."""
        c, p = divmod(index, self.interval)
        return (self.mla, (c,)) if p == self.interval - 1 else (self.kda, (c, p))
