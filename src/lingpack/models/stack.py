"""The MoE layers run by one scan, so compile time does not grow with depth.

`LayerStack` holds the MoE layers after the dense ones (KDA and MLA mixed, in any pattern), each split at
its residual add: the mixer halves (input norm + KDA or MLA) stacked per mixer, `kda` `[n_kda, ...]` and
`mla` `[n_mla, ...]`, the FFN halves (post-attention norm + MoE) stacked in layer order, `ffn` `[n, ...]`.
Its call is ONE `lax.scan` over the layers: the body takes layer i's mixer weights out of its mixer's stack
by dynamic index and runs the mixer under `lax.cond`, then the MoE with the scanned FFN slice. XLA compiles
one KDA mixer, one MLA mixer and one MoE whatever the depth and the pattern, with no partial cycle left
over. Logical sharding names get `None` (replicated) for the stack axis.

Under remat each mixer is checkpointed inside the cond, and the layer's checkpoint saves the mixer's output
(`MIXED`, one activation a layer): the backward recomputes the mixer inside its own branch. A checkpoint
around the cond alone would have the backward linearise the cond, whose residuals are the union of both
mixers' (the branch taken fills the other's with zeros: activation-sized buffers written every layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lingpack.models.block import FFN_PARTS, MIXER_PARTS, DecoderLayer, feed, mix, parts

MIXERS = ("kda", "mla")
MIXER_SCOPE = "stack_mixer"   # named scope of the scanned layers' mixer cond (op_name in compiled HLO)
MIXED = "stack/mixer_out"     # checkpoint name of a scanned layer's mixer output (x + mixer(norm(x)))
# a layer's weights taken out of its stack: recomputed by the backward pass, never saved per layer (a copy)
_WEIGHT_SLICES = (jax.lax.dynamic_slice_p, jax.lax.squeeze_p)


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


def without_weight_slices(policy):
    """A `jax.checkpoint` policy that saves what `policy` saves, except the weights sliced out of a stack."""
    return lambda prim, *args, **params: prim not in _WEIGHT_SLICES and policy(prim, *args, **params)


class LayerHalf(nnx.Module):
    """Some submodules of a built DecoderLayer (its mixer's or its FFN's half), moved here, and its kinds."""

    def __init__(self, layer: DecoderLayer, names: tuple[str, ...]):
        self.mixer, self.ffn = layer.mixer, layer.ffn
        for name in names:
            setattr(self, name, getattr(layer, name))


class LayerStack(nnx.Module):
    """MoE layers, built from unrolled layers (same weights), stacked in halves and run by one scan."""

    def __init__(self, layers: list[DecoderLayer]):
        if len(layers) < 1 or any(l.ffn != "moe" for l in layers):
            raise ValueError(f"LayerStack takes MoE layers only; got ffns {[l.ffn for l in layers]}")
        self.mixers = tuple(l.mixer for l in layers)
        for mixer in MIXERS:
            same = [LayerHalf(l, MIXER_PARTS) for l in layers if l.mixer == mixer]
            setattr(self, mixer, stack_modules(same) if same else None)
        self.ffn = stack_modules([LayerHalf(l, FFN_PARTS) for l in layers])

    def parts(self, i: int) -> dict:
        """{submodule name: (stacked module, index into its stack axis)} of the stack's `i`-th layer."""
        mixer = self.mixers[i]
        index = (self.mixers[:i].count(mixer),)
        return parts(getattr(self, mixer), index, MIXER_PARTS) | parts(self.ffn, (i,), FFN_PARTS)

    def __call__(self, x_BTD, segment_ids_BT, positions_BT, policy):
        """-> (x_BTD, moe aux dict of arrays stacked in layer order [n_layers, ...]).

        Each layer runs under `jax.checkpoint(policy)` (wrapped by `without_weight_slices`): its residuals are
        its input, its mixer's output (with two mixers) and whatever `policy` saves; the mixer stacks are loop
        constants, not saved per layer.
        """
        present = [m for m in MIXERS if getattr(self, m) is not None]
        graphdefs, states = {}, {}
        for mixer in present:
            graphdefs[mixer], states[mixer] = nnx.split(getattr(self, mixer))
        ffn_def, ffn_state = nnx.split(self.ffn)
        # per layer: its mixer, and its index into each mixer stack (for the other mixer: that mixer's last layer so far)
        is_mla_L = jnp.array([m == "mla" for m in self.mixers])
        n = len(self.mixers)
        index_L = {m: jnp.array([max(0, self.mixers[:i + 1].count(m) - 1) for i in range(n)], jnp.int32) for m in present}

        def layer(x, is_mla, index, ffn_weights, states, segment_ids, positions):
            # mixer weights sliced outside the cond: a slice's gradient then accumulates into its stack in place
            take = lambda m: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index[m], keepdims=False), states[m])
            weights = {m: take(m) for m in present}
            run = {m: lambda x, w, m=m: mix(nnx.merge(graphdefs[m], w[m]), x, segment_ids, positions) for m in present}
            if len(present) == 1:
                x = run[present[0]](x, weights)
            else:
                # each mixer checkpointed inside the cond and its output saved by the layer's checkpoint: the
                # layer's recompute then leaves the cond alone, whose linearisation would return the union of
                # both mixers' residuals, the branch taken filling the other's with zeros
                branch = {m: jax.checkpoint(run[m], policy=policy) for m in present}
                with jax.named_scope(MIXER_SCOPE):   # the planner weighs this cond's branches by this name
                    x = checkpoint_name(jax.lax.cond(is_mla, branch["mla"], branch["kda"], x, weights), MIXED)
            return feed(nnx.merge(ffn_def, ffn_weights), x, segment_ids)

        saving = policy if len(present) == 1 else jax.checkpoint_policies.save_from_both_policies(
            policy, jax.checkpoint_policies.save_only_these_names(MIXED))
        step = jax.checkpoint(layer, policy=without_weight_slices(saving))
        return jax.lax.scan(lambda x, xs: step(x, *xs, states, segment_ids_BT, positions_BT),
                            x_BTD, (is_mla_L, index_L, ffn_state))
