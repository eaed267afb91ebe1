"""A run's train step as one object: the mesh, the model, the state's shardings and the jitted step.

`train/loop.py` trains with it; export tests, the planner and memory studies compile the same object
abstractly (nothing allocated), so what they measure is exactly what a run executes:

    program = TrainProgram.build(model_cfg, loss_cfg, optim_cfg, parallel_cfg, train_cfg,
                                 rows=64, seq_length=8192, devices=jax.devices()[:64])
    compiled = program.lower().compile()              # memory_analysis(), as_text() for lingpack.plan.hlo
    exported = program.export("tpu")                   # traced under lingpack.backend.target("tpu")
    exported, kernels = program.export("tpu", with_kernels=True)   # + its Pallas kernels, Mosaic vs interpret
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from lingpack import backend
from lingpack.plan import hlo
from lingpack.parallel import expert
from lingpack.parallel.context import ContextParallel
from lingpack.train import sharding as shard_lib
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.step import ModelDef, TrainState, init_fn, make_train_step, state_shardings

BATCH_KEYS = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position")


def make_model(model_cfg, seed: int):
    """The module for `model_cfg`: a Ling3Config, or any config with `make_model(rngs)`."""
    from flax import nnx

    from lingpack.models.ling3 import Ling3, Ling3Config
    rngs = nnx.Rngs(seed)
    if hasattr(model_cfg, "make_model"):
        return model_cfg.make_model(rngs)
    if not isinstance(model_cfg, Ling3Config):
        raise TypeError(f"model_cfg must be a Ling3Config or have make_model(rngs); got {type(model_cfg).__name__}")
    return Ling3(model_cfg, rngs=rngs)


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    mesh: Mesh
    model_def: ModelDef
    init: typing.Callable[[], TrainState]      # () -> TrainState (unsharded; jit with `shardings`)
    abstract_state: TrainState                 # ShapeDtypeStructs, no sharding
    shardings: TrainState                      # NamedSharding per state leaf
    step: typing.Any                           # jitted (state, batch) -> (state, metrics)
    context: ContextParallel | None
    batch_sharding: NamedSharding
    rows: int | None = None                    # global batch rows / sequence length, for the abstract batch
    seq_length: int | None = None
    dropped: tuple = ()                        # (logical name, size, mesh axes) left replicated

    @classmethod
    def build(cls, model_cfg, loss_cfg: LossConfig, optim_cfg: OptimConfig, parallel_cfg: ParallelConfig,
              train_cfg: TrainConfig, *, rows: int | None = None, seq_length: int | None = None, devices=None,
              donate: bool = True, trace_routing: bool = False) -> "TrainProgram":
        mesh = shard_lib.make_mesh(parallel_cfg, devices)
        rules = parallel_cfg.rules
        context = ContextParallel.from_config(parallel_cfg, mesh)
        build = lambda: make_model(model_cfg, train_cfg.seed)
        model_def = ModelDef.from_constructor(build, model_cfg)
        init = init_fn(build, optim_cfg, train_cfg.seed)
        abstract = jax.eval_shape(init)
        dropped = []
        shardings = state_shardings(model_def, abstract, mesh, rules, dropped)
        step = make_train_step(model_def, loss_cfg, optim_cfg, micro_batches=train_cfg.micro_batches, mesh=mesh,
                               rules=rules, shardings=shardings, context=context, donate=donate,
                               halt_on_overflow=train_cfg.overflow_policy == "halt", trace_routing=trace_routing)
        return cls(mesh, model_def, init, abstract, shardings, step, context, shard_lib.batch_sharding(mesh, rules),
                   rows, seq_length, tuple(dropped))

    def state_specs(self) -> TrainState:
        """The state as sharded ShapeDtypeStructs (what `lower` / `export` trace with)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract_state,
                            self.shardings)

    def batch_specs(self) -> dict:
        if self.rows is None or self.seq_length is None:
            raise ValueError("TrainProgram.build(..., rows=, seq_length=) sets the abstract batch's shape")
        shape = (self.rows, self.seq_length)
        return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding) for k in BATCH_KEYS}

    def lower(self):
        return self.step.lower(self.state_specs(), self.batch_specs())

    def export(self, platform: str, *, with_kernels: bool = False):
        """`jax.export` of the step traced as `platform` runs it ("tpu", "gpu"/"cuda", "cpu").

        with_kernels: return (exported, the traced step's Pallas kernels by mode, `lingpack.plan.hlo.pallas_kernels`);
        the second trace is the export's own, from JAX's trace cache. Triton custom calls (the GPU attention
        kernel) carry Triton IR that jax.export does not promise to load into another jaxlib, so that check is
        waived: the export proves lowering, and it runs under the jaxlib that made it. So is the one of XLA's
        ragged all-to-all (expert parallelism on TPU/GPU), which StableHLO carries as a custom call.
        """
        platforms = {"gpu": "cuda"}.get(platform, platform)
        waived = [jax.export.DisabledSafetyCheck.custom_call(hlo.TRITON_CALL)] if platforms in ("cuda", "rocm") else []
        waived.append(jax.export.DisabledSafetyCheck.custom_call(expert.RAGGED_ALL_TO_ALL))
        with backend.target(platform):
            exported = jax.export.export(self.step, platforms=[platforms], disabled_checks=waived)(
                self.state_specs(), self.batch_specs())
            if not with_kernels:
                return exported
            return exported, hlo.pallas_kernels(self.step.trace(self.state_specs(), self.batch_specs()).jaxpr)
