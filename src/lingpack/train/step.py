"""Train state, sharded initialisation and the jitted train step (gradient accumulation by `lax.scan`).

The state is a pytree of plain dicts (what Orbax saves): master parameters (`OptimConfig.master_dtype`),
the model's non-trainable variables (MoE expert biases), optax state, the step count and an RNG key.
The model is rebuilt inside the step from a static `nnx.GraphDef`; each parameter is cast from its master
dtype to the dtype the model created it in (bf16 compute with fp32 master; fp32 ones like the router stay;
float64 throughout with float64 master and model dtypes, in JAX's x64 mode: `lingpack.precision`).

One step: the global batch [B, T] -> [M, B/M, T] micro-batches; `lax.scan` sums each micro-batch's share of the
objective and its gradient (fp32, or the master dtype when wider), then clip + AdamW, then the MoE expert-bias
update from the summed load counts (outside the gradient). A non-finite loss or gradient norm leaves the state
unchanged except `step` (`metrics['finite'] == 0`), so `step - 1` is exactly the state before the bad batch; the
loop halts or skips on it.

Kernels with `max_segs` cu_seqlens slots (`kernels.kda.api.needs_max_segs`) cannot hold more documents
than that per micro-batch: `drop_overflow` turns the documents that do not fit into padding before the
model runs, so they are out of the kernel, the loss and every gradient (MoE statistics included), and
counted (`dropped_documents`, `dropped_tokens`). With `halt_on_overflow` such a step applies no update
(`metrics['applied'] == 0`), like a non-finite one.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lingpack.kernels.kda import api as kda_api
from lingpack.kernels.kda.segments import fits_max_segs, packing_stats, segment_starts
from lingpack.parallel.context import ContextParallel, context_parallel
from lingpack.parallel.layout import Layout, activation_layout
from lingpack.parallel.reorder import restore_order, zigzag_permutation
from lingpack.precision import as_dtype, at_least_fp32
from lingpack.train import loss as loss_lib
from lingpack.train import sharding as shard_lib
from lingpack.train.configs import LossConfig, OptimConfig
from lingpack.train.optim import global_norm, learning_rate, make_optimizer


@struct.dataclass
class TrainState:
    step: jax.Array          # int32: batches consumed (attempted updates)
    updates: jax.Array       # int32: updates applied (the schedule's count; < step after skipped batches)
    params: dict             # master parameters (pure dict)
    rest: dict               # non-trainable model variables, e.g. MoE expert biases (pure dict)
    opt_state: typing.Any
    rng: jax.Array           # uint32 key data (raw, so Orbax stores it as an array)


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """What the step needs to rebuild a module from pure-dict state (hashable by identity for jit)."""
    graphdef: typing.Any
    params_template: typing.Any    # nnx.State of ShapeDtypeStructs (model dtypes)
    rest_template: typing.Any
    logical_params: typing.Any     # pure dict of logical PartitionSpecs
    logical_rest: typing.Any
    config: typing.Any = None      # the model's config (for MoE / KDA settings), optional

    @classmethod
    def from_constructor(cls, make_model: typing.Callable[[], nnx.Module], config=None) -> "ModelDef":
        abstract = nnx.eval_shape(make_model)
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        return cls(graphdef, params, rest, nnx.get_partition_spec(params).to_pure_dict(),
                   nnx.get_partition_spec(rest).to_pure_dict(), config)

    def merge(self, params: dict, rest: dict) -> nnx.Module:
        """Module from pure dicts; each parameter cast to its model dtype (the master may be wider)."""
        compute = jax.tree.map(lambda p, t: p.astype(t.dtype), params, self.params_template.to_pure_dict())
        p_state, r_state = jax.tree.map(lambda x: x, self.params_template), jax.tree.map(lambda x: x, self.rest_template)
        nnx.replace_by_pure_dict(p_state, compute)
        nnx.replace_by_pure_dict(r_state, rest)
        return nnx.merge(self.graphdef, p_state, r_state)


def split_model(model: nnx.Module) -> tuple[dict, dict]:
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return params.to_pure_dict(), rest.to_pure_dict()


def _master(params: dict, optim_cfg: OptimConfig) -> dict:
    dtype = as_dtype(optim_cfg.master_dtype)
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def init_fn(make_model: typing.Callable[[], nnx.Module], optim_cfg: OptimConfig, seed: int):
    """A function () -> TrainState (jit it with out_shardings for a sharded init)."""
    tx = make_optimizer(optim_cfg)

    def init():
        params, rest = split_model(make_model())
        params = _master(params, optim_cfg)
        return TrainState(step=jnp.int32(0), updates=jnp.int32(0), params=params, rest=rest,
                          opt_state=tx.init(params), rng=jax.random.key_data(jax.random.key(seed)))
    return init


def state_shardings(model_def: ModelDef, abstract_state: TrainState, mesh: Mesh, rules,
                    dropped: list | None = None) -> TrainState:
    """NamedShardings for every leaf of the train state."""
    replicated = NamedSharding(mesh, P())
    params_sh = shard_lib.tree_shardings(abstract_state.params, model_def.logical_params, mesh, rules, dropped)
    rest_sh = shard_lib.tree_shardings(abstract_state.rest, model_def.logical_rest, mesh, rules, dropped)
    opt_sh = shard_lib.like_params_shardings(abstract_state.opt_state, abstract_state.params, params_sh, mesh)
    return TrainState(step=replicated, updates=replicated, params=params_sh, rest=rest_sh, opt_state=opt_sh,
                      rng=replicated)


def init_train_state(model_def: ModelDef, make_model, optim_cfg: OptimConfig, seed: int, mesh: Mesh, rules,
                     dropped: list | None = None) -> tuple[TrainState, TrainState]:
    """(state initialised directly into its shardings, the shardings)."""
    fn = init_fn(make_model, optim_cfg, seed)
    shardings = state_shardings(model_def, jax.eval_shape(fn), mesh, rules, dropped)
    return jax.jit(fn, out_shardings=shardings)(), shardings


def _moe_rate_and_weight(model_cfg) -> tuple[float, float]:
    return loss_lib.moe_weights(getattr(model_cfg, "moe", None))


def kernel_max_segs(model_cfg) -> int | None:
    """The cu_seqlens slots per micro-batch of the model's KDA kernel; None for kernels without phantom segments."""
    if not kda_api.needs_max_segs(getattr(model_cfg, "kda_impl", None)):
        return None
    return getattr(model_cfg, "kda_max_segs", None)


def drop_overflow(batch: dict, max_segs: int | None, context: ContextParallel | None = None) -> tuple[dict, dict]:
    """(batch with the documents beyond `max_segs` made padding, their counts) for [..., B, T] arrays.

    Each leading index is one micro-batch (the unit the kernel flattens). Dropped documents get segment
    id 0 in `inputs_segmentation` (no kernel slot, no MoE statistics, no attention) and in
    `targets_segmentation` (no loss); they are the tail of the flattened micro-batch, so the ids stay valid.
    Under zigzag context parallelism (`context.load_balance`) the tail is found in token order.
    Counts: `dropped_documents` (segments: a document crossing a row boundary counts once per row) and
    `dropped_tokens` (their real tokens), int32 sums over every micro-batch.
    """
    seg = batch["inputs_segmentation"]
    if max_segs is None:
        return batch, {"dropped_documents": jnp.int32(0), "dropped_tokens": jnp.int32(0)}
    zigzag = context is not None and context.load_balance
    ordered = restore_order(seg, context.size, axis=seg.ndim - 1) if zigzag else seg
    rows_BT = ordered.reshape(-1, *seg.shape[-2:])
    keep = jax.vmap(lambda s: fits_max_segs(s, max_segs))(rows_BT).reshape(seg.shape)
    starts = jax.vmap(segment_starts)(rows_BT).reshape(seg.shape)
    counts = {"dropped_documents": jnp.sum(starts & ~keep).astype(jnp.int32),
              "dropped_tokens": jnp.sum((ordered != 0) & ~keep).astype(jnp.int32)}
    if zigzag:  # back to the batch's layout
        keep = keep.take(zigzag_permutation(seg.shape[-1], context.size), axis=seg.ndim - 1)
    out = dict(batch, inputs_segmentation=jnp.where(keep, seg, 0),
               targets_segmentation=jnp.where(keep, batch["targets_segmentation"], 0))
    return out, counts


def _packing_metrics(seg_MBT: jax.Array, model_cfg, context: ContextParallel | None = None) -> dict:
    """Per micro-batch packing figures (what the KDA kernel is given, before any drop), aggregated over the step."""
    if context is not None and context.load_balance:  # the figures are about rows in token order
        seg_MBT = restore_order(seg_MBT, context.size, axis=2)
    max_segs = kernel_max_segs(model_cfg)
    chunk = getattr(model_cfg, "kda_chunk_size", 64)
    stats = jax.vmap(lambda s: packing_stats(s, max_segs=max_segs, chunk_size=chunk))(seg_MBT)
    out = {
        "segments_per_row": jnp.mean(stats["segments_per_row_mean"]),
        "segments_per_row_max": jnp.max(stats["segments_per_row_max"]),
        "invalid_rows": jnp.sum(stats["invalid_rows"]),
        "native_t_over_t": stats["native_t_over_t"][0],
        "max_segs": jnp.int32(max_segs or 0),
    }
    if max_segs is not None:
        out["t_new_over_t"] = stats["t_new_over_t"][0]
    else:  # segment-native kernels: no phantom segments, the only growth is T rounded up to a chunk
        out["t_new_over_t"] = stats["native_t_over_t"][0]
    return out


ROUTING_KEYS = ("expert_ids", "router_logits", "expert_bias")  # the MoE aux entries of the routing trace


def accumulate_gradients(model_def: ModelDef, loss_cfg: LossConfig, params: dict, rest: dict, batch: dict, *,
                         micro_batches: int, mesh: Mesh | None = None, rules=None, params_shardings=None,
                         context: ContextParallel | None = None, trace_routing: bool = False):
    """(gradient of the step objective w.r.t. params in fp32 or wider, statistics summed over micro-batches,
    micro-batches).

    The [B, T] batch becomes [M, B/M, T] (documents beyond the kernel's max_segs dropped per micro-batch,
    see `drop_overflow`; the returned micro-batches are the originals); `lax.scan` runs forward + backward
    per micro-batch and sums gradients and statistics (each micro-batch's objective share already carries
    its 1/M or 1/N_total). The statistics hold the drop counts.
    `context`: the model and loss are traced under it (parallel/context.py); the batch is in its layout.
    `trace_routing`: statistics also hold `routing`, each micro-batch's MoE routing exactly as the step
    used it (ROUTING_KEYS, stacked [M, L_moe, ...]; see parity/routing.py).
    """
    layout = Layout(mesh, rules) if mesh is not None else None
    with context_parallel(context), activation_layout(layout):
        return _accumulate(model_def, loss_cfg, params, rest, batch, micro_batches, mesh, rules, params_shardings,
                           context, trace_routing)


def _accumulate(model_def, loss_cfg, params, rest, batch, micro_batches, mesh, rules, params_shardings, context,
                trace_routing):
    M = micro_batches
    B = batch["inputs"].shape[0]
    if B % M:
        raise ValueError(f"global batch of {B} rows does not split into micro_batches={M}; choose a divisor of {B}")
    model_cfg = model_def.config
    moe_z_weight, _ = _moe_rate_and_weight(model_cfg)
    spec = shard_lib.batch_spec(mesh, rules) if mesh is not None else P()
    constrain = lambda x, sh: jax.lax.with_sharding_constraint(x, sh) if mesh is not None else x
    micro = {k: constrain(v.reshape(M, B // M, *v.shape[1:]), NamedSharding(mesh, P(None, *spec)) if mesh else None)
             for k, v in batch.items()}
    kept, dropped = drop_overflow(micro, kernel_max_segs(model_cfg), context)
    totals = loss_lib.totals(kept, getattr(model_cfg, "mtp_num_layers", 0) or 0)

    def micro_step(mb):
        def objective(params):
            model = model_def.merge(params, rest)
            out = model(mb["inputs"], mb["inputs_segmentation"], mb["inputs_position"])
            obj, stats = loss_lib.micro_batch_loss(out.head, list(out.mtp_heads), out.moe_aux, mb, loss_cfg,
                                                   totals, num_micro_batches=M, moe_z_loss_weight=moe_z_weight)
            stats["load_counts"] = out.moe_aux["load_counts"].astype(jnp.float32)  # counts: a format, exact in fp32
            if trace_routing and not set(ROUTING_KEYS) <= set(out.moe_aux):
                raise ValueError(f"trace_routing needs the model's moe_aux to hold {ROUTING_KEYS}; it has "
                                 f"{sorted(out.moe_aux)} (lingpack.models.moe.MoE returns them)")
            routing = {k: out.moe_aux[k] for k in ROUTING_KEYS} if trace_routing else {}
            return obj, (stats, routing)
        return jax.value_and_grad(objective, has_aux=True)(params)

    def body(carry, mb):
        grads_acc, stats_acc = carry
        (_, (stats, routing)), grads = micro_step(mb)
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads)  # fp32 (or wider) accumulation
        return (grads_acc, jax.tree.map(jnp.add, stats_acc, stats)), routing

    stats_shape = jax.eval_shape(lambda: micro_step(jax.tree.map(lambda v: v[0], micro))[0][1][0])
    grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, at_least_fp32(p.dtype)), params)
    if params_shardings is not None:
        grads0 = jax.lax.with_sharding_constraint(grads0, params_shardings)
    stats0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape)
    (grads, stats), routing = jax.lax.scan(body, (grads0, stats0), kept)
    stats = dict(stats, **dropped)
    if trace_routing:
        stats["routing"] = routing
    return grads, stats, micro


def make_train_step(model_def: ModelDef, loss_cfg: LossConfig, optim_cfg: OptimConfig, *, micro_batches: int,
                    mesh: Mesh | None = None, rules=None, shardings: TrainState | None = None, donate: bool = True,
                    context: ContextParallel | None = None, halt_on_overflow: bool = False,
                    trace_routing: bool = False):
    """Jitted `step(state, batch) -> (state, metrics)`; `batch` holds global [B, T] int32 arrays (in
    `context`'s token layout when context parallelism is on).

    The update is applied when the loss and gradient norm are finite and, with `halt_on_overflow`, no
    document was dropped; otherwise only `step` advances (`metrics['applied'] == 0`).
    `trace_routing`: metrics also hold `routing` (see `accumulate_gradients`).
    """
    tx = make_optimizer(optim_cfg)
    lr_fn = learning_rate(optim_cfg)
    model_cfg = model_def.config
    _, bias_rate = _moe_rate_and_weight(model_cfg)
    M = micro_batches

    def step(state: TrainState, batch: dict):
        grads, stats, micro = accumulate_gradients(
            model_def, loss_cfg, state.params, state.rest, batch, micro_batches=M, mesh=mesh, rules=rules,
            params_shardings=None if shardings is None else shardings.params, context=context,
            trace_routing=trace_routing)
        grad_norm = global_norm(grads)
        loss_metrics = loss_lib.metrics(stats, loss_cfg, num_micro_batches=M)
        finite = jnp.isfinite(loss_metrics["loss"]) & jnp.isfinite(grad_norm)
        applied = finite & (stats["dropped_documents"] == 0) if halt_on_overflow else finite

        def update(params, opt_state):
            updates, new_opt = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt

        # a bad step leaves params and moments unchanged: a cond, not where(applied, new, old) per leaf, so the
        # update's elementwise fusions may overwrite the donated buffers (the where kept old and new of each alive)
        new_params, new_opt = jax.lax.cond(applied, update, lambda p, o: (p, o), state.params, state.opt_state)
        new_rest = state.rest
        if bias_rate > 0 and stats["load_counts"].size:
            from lingpack.models.moe import update_expert_bias
            model = model_def.merge(new_params, state.rest)
            update_expert_bias(model, stats["load_counts"], bias_rate)  # global-batch loads, outside the gradient
            new_rest = nnx.split(model, nnx.Param, ...)[2].to_pure_dict()

        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)  # bad step: no change
        new_state = TrainState(step=state.step + 1, updates=state.updates + applied.astype(jnp.int32),
                               params=new_params, rest=keep(new_rest, state.rest), opt_state=new_opt,
                               rng=keep(jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1)),
                                        state.rng))
        metrics = dict(loss_metrics, grad_norm=grad_norm, lr=lr_fn(state.updates), finite=finite.astype(jnp.int32),
                       applied=applied.astype(jnp.int32), tokens=jnp.int32(batch["inputs"].size),
                       dropped_documents=stats["dropped_documents"], dropped_tokens=stats["dropped_tokens"],
                       **_packing_metrics(micro["inputs_segmentation"], model_cfg, context))
        if trace_routing:
            metrics["routing"] = stats["routing"]
        return new_state, metrics

    kwargs = {}
    if shardings is not None:
        kwargs = dict(in_shardings=(shardings, NamedSharding(mesh, shard_lib.batch_spec(mesh, rules))),
                      out_shardings=(shardings, None))
    return jax.jit(step, donate_argnums=(0,) if donate else (), **kwargs)
