"""The training loop: data -> sharded step -> metrics, with checkpoint/resume and preemption handling.

    result = train(model_cfg, data_cfg, loss_cfg, optim_cfg, parallel_cfg, ckpt_cfg, train_cfg,
                   metrics_callback=None)

On start the latest checkpoint in `ckpt_cfg.directory` is restored (state and data position), else the
state is initialised directly in its shardings. Each step reads one global batch (this host's rows),
runs the jitted step and reports one metrics dict (names in METRIC_NAMES) to `metrics_callback(step,
metrics)` (every step) and to `TrainResult.history`; the console shows a progress bar (and a log line
every `log_every` steps). Every `train.eval_every` steps the valid split is evaluated (evaluate.py; its
`val_*` metrics join that step's record) and, when the run completes, the valid and test splits once more
(`TrainResult.final_eval`). Checkpoints every `save_every` steps, at the end, on SIGTERM/SIGINT (then the
loop returns with `preempted=True`) and before halting on a non-finite loss.

`model_cfg` is a `Ling3Config`, or any frozen config with `make_model(rngs) -> nnx.Module` whose call
returns a `Ling3Output` (tests use a small stand-in that way).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib

import jax
import numpy as np
from flax import nnx

from lingpack import distributed
from lingpack.data.pipeline import make_iterator
from lingpack.parallel.context import ContextParallel
from lingpack.parallel.reorder import check_length, reorder_batch
from lingpack.train import flops as flops_lib
from lingpack.train import optim as optim_lib
from lingpack.train import sharding as shard_lib
from lingpack.train.checkpoint import Checkpointer, PreemptionGuard
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.evaluate import make_evaluators, megatron_line
from lingpack.train.step import ModelDef, init_fn, make_train_step, state_shardings

log = logging.getLogger("lingpack.train")

METRIC_NAMES = ("loss", "lm_loss", "mtp_loss", "moe_z_loss", "grad_norm", "lr", "tokens", "tokens_per_s",
                "step_time_s", "mfu", "segments_per_row", "max_segs", "overflow", "t_new_over_t",
                "native_t_over_t", "loss_tokens")


class NonFiniteLossError(RuntimeError):
    """Raised by nan_policy="halt"; `.history` holds the metrics so far, `.checkpoint_step` the saved step."""

    def __init__(self, message: str, history: list, checkpoint_step: int | None):
        super().__init__(message)
        self.history, self.checkpoint_step = history, checkpoint_step


@dataclasses.dataclass
class TrainResult:
    final_metrics: dict
    history: list             # one dict per step run in this call: METRIC_NAMES + step, finite, data_fingerprint
    start_step: int           # 0, or the restored checkpoint's step
    last_step: int
    preempted: bool = False
    skipped_steps: int = 0
    checkpoint_steps: list = dataclasses.field(default_factory=list)
    state: object = None      # the final TrainState (sharded arrays)
    model_def: object = None  # rebuilds the module: `final_model()`
    final_eval: dict = dataclasses.field(default_factory=dict)  # end-of-run val_* / test_* (evaluate.py)

    def final_model(self) -> nnx.Module:
        """The trained model as an NNX module (parameters in their model dtypes)."""
        # Collective on multi-host runs: every process must call it.
        return self.model_def.merge(*distributed.fetch((self.state.params, self.state.rest)))


def make_model(model_cfg, seed: int) -> nnx.Module:
    rngs = nnx.Rngs(seed)
    if hasattr(model_cfg, "make_model"):
        return model_cfg.make_model(rngs)
    from lingpack.models.ling3 import Ling3, Ling3Config
    if not isinstance(model_cfg, Ling3Config):
        raise TypeError(f"model_cfg must be a Ling3Config or have make_model(rngs); got {type(model_cfg).__name__}")
    return Ling3(model_cfg, rngs=rngs)


def _check_batch(data_cfg, train_cfg: TrainConfig, loss_cfg: LossConfig, mesh, rules) -> None:
    B, M = data_cfg.global_batch_size, train_cfg.micro_batches
    if B % M:
        raise ValueError(f"data.global_batch_size={B} is not divisible by train.micro_batches={M}")
    rows, shards = B // M, shard_lib.batch_divisor(mesh, rules)
    if rows % shards:
        raise ValueError(f"a micro-batch of {rows} rows (global_batch_size {B} / micro_batches {M}) does not split "
                         f"over the {shards} batch shards of the mesh {dict(mesh.shape)}; make it a multiple of {shards}")
    if rows % loss_cfg.megatron_dp_size:
        raise ValueError(f"a micro-batch of {rows} rows does not split into loss.megatron_dp_size="
                         f"{loss_cfg.megatron_dp_size} groups")


def _fingerprint(batch: dict) -> int:
    """crc32 of the inputs: lets tests and logs check the data order cheaply."""
    return zlib.crc32(np.ascontiguousarray(batch["inputs"]).tobytes())


def _scalar(x):
    x = np.asarray(x)
    return int(x) if np.issubdtype(x.dtype, np.integer) else float(x)


def _progress(train_cfg: TrainConfig, start: int):
    if not train_cfg.progress_bar or jax.process_index() != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: plain log lines then
        return None
    return tqdm(total=train_cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)


def train(model_cfg, data_cfg, loss_cfg: LossConfig, optim_cfg: OptimConfig, parallel_cfg: ParallelConfig,
          ckpt_cfg: CheckpointConfig, train_cfg: TrainConfig, *, metrics_callback=None) -> TrainResult:
    optim_cfg = optim_lib.resolve(optim_cfg, train_cfg.steps)
    mesh = shard_lib.make_mesh(parallel_cfg)
    rules = parallel_cfg.rules
    _check_batch(data_cfg, train_cfg, loss_cfg, mesh, rules)
    context = ContextParallel.from_config(parallel_cfg, mesh)
    if context is not None:
        check_length(data_cfg.seq_length, context.size, context.load_balance)

    build = lambda: make_model(model_cfg, train_cfg.seed)
    model_def = ModelDef.from_constructor(build, model_cfg)
    init = init_fn(build, optim_cfg, train_cfg.seed)
    abstract = jax.eval_shape(init)
    dropped = []
    shardings = state_shardings(model_def, abstract, mesh, rules, dropped)
    for line in shard_lib.sharding_report(dropped):
        log.info(line)

    batch_sharding, B = shard_lib.batch_sharding(mesh, rules), data_cfg.global_batch_size
    iterator = make_iterator(data_cfg, split="train", rows=distributed.process_rows(batch_sharding, B))
    ckpt = Checkpointer(ckpt_cfg) if ckpt_cfg.enabled else None
    latest = ckpt.latest_step() if ckpt else None
    if latest is not None:
        state, data_state = ckpt.restore(latest, abstract, shardings)
        iterator.set_state(data_state)
        log.info("restored step %d from %s", latest, ckpt.directory)
    else:
        state = jax.jit(init, out_shardings=shardings)()
    start = int(jax.device_get(state.step))
    step_fn = make_train_step(model_def, loss_cfg, optim_cfg, micro_batches=train_cfg.micro_batches, mesh=mesh,
                              rules=rules, shardings=shardings, context=context)
    evaluators = make_evaluators(model_def, data_cfg, loss_cfg, train_cfg, mesh=mesh, rules=rules, context=context)

    peak = train_cfg.peak_flops_per_device or flops_lib.peak_flops_per_device()
    step_flops = flops_lib.flops_per_token(model_cfg, data_cfg.seq_length) * data_cfg.global_batch_size * data_cfg.seq_length
    if not peak:
        log.info("peak FLOP/s of %s unknown: mfu reported as 0 (set train.peak_flops_per_device)",
                 jax.devices()[0].device_kind)

    history, saved, skipped, preempted, final_eval = [], [], 0, False, {}
    bar = _progress(train_cfg, start)
    last_saved = latest

    def save(step_number, state_, data_state_, wait=False):
        nonlocal last_saved
        if ckpt is not None and step_number != last_saved:
            ckpt.save(step_number, state_, data_state_, wait=wait)
            saved.append(step_number)
            last_saved = step_number

    try:
        with PreemptionGuard(train_cfg.handle_signals) as guard:
            for step in range(start, train_cfg.steps):
                data_state = iterator.get_state()
                try:
                    local = next(iterator)
                except StopIteration:
                    raise RuntimeError(f"the data ran out after {step} batches (steps={train_cfg.steps}); raise "
                                       "data.num_samples / num_epochs or lower train.steps") from None
                fingerprint = _fingerprint(local)
                if context is not None and context.load_balance:  # once per batch, every array (parallel/)
                    local = reorder_batch(local, context.size)
                t0 = time.perf_counter()
                state, metrics = step_fn(state, distributed.global_batch(local, batch_sharding, B))
                metrics = {k: _scalar(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
                dt = time.perf_counter() - t0
                metrics.update(step=step + 1, step_time_s=dt, tokens_per_s=metrics["tokens"] / dt,
                               mfu=step_flops / dt / (peak * jax.device_count()) if peak else 0.0,
                               data_fingerprint=fingerprint)
                evaluated = {}
                if evaluators and (step + 1) % train_cfg.eval_every == 0:  # Megatron's eval_interval
                    evaluated = evaluators["valid"].evaluate(state, (step + 1) // train_cfg.eval_every - 1)
                    log.info(megatron_line(f"iteration {step + 1}", evaluated))
                    metrics.update(evaluated)
                history.append(metrics)
                if metrics_callback is not None:
                    metrics_callback(step + 1, {**{k: metrics[k] for k in METRIC_NAMES}, **evaluated})
                if metrics["overflow"]:
                    log.warning("step %d: %d segments beyond kda max_segs=%d were dropped by the kernel; raise "
                                "kernel.max_segs (see `python -m lingpack.data.stats`)", step + 1,
                                metrics["overflow"], metrics["max_segs"])
                    if train_cfg.overflow_policy == "halt":
                        raise RuntimeError(f"step {step + 1}: {metrics['overflow']} segments exceeded kda max_segs="
                                           f"{metrics['max_segs']} (train.overflow_policy=halt); raise kernel.max_segs"
                                           " or use the segment-native kernel (kernel=chunked)")
                if metrics["invalid_rows"]:
                    log.warning("step %d: %d rows have decreasing segment ids or padding before real tokens; "
                                "check the data pipeline", step + 1, metrics["invalid_rows"])
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                    tok_s=f"{metrics['tokens_per_s']:.0f}", refresh=False)
                if (step + 1) % train_cfg.log_every == 0:
                    log.info("step %d | loss %.5f | lm loss %.5f | grad norm %.3f | lr %.3e | %.0f tok/s | mfu %.3f",
                             step + 1, metrics["loss"], metrics["lm_loss"], metrics["grad_norm"], metrics["lr"],
                             metrics["tokens_per_s"], metrics["mfu"])

                if not metrics["finite"]:
                    if train_cfg.nan_policy == "halt":
                        # The step left params/optimizer/rng untouched: step-1 + the pre-batch data state is exact.
                        save(step, state.replace(step=state.step - 1), data_state, wait=True)
                        raise NonFiniteLossError(
                            f"non-finite loss at step {step + 1} (loss={metrics['loss']}, grad_norm="
                            f"{metrics['grad_norm']}); the state before this batch is saved at step {step} in "
                            f"{ckpt.directory if ckpt else '(checkpointing disabled)'}. Lower the lr, check the "
                            "data, or set train.nan_policy='skip' to drop such steps", history,
                            step if ckpt else None)
                    skipped += 1
                    log.warning("step %d: non-finite loss %s, update skipped", step + 1, metrics["loss"])

                if guard.should_stop():
                    save(step + 1, state, iterator.get_state(), wait=True)
                    preempted = True
                    log.warning("stopped by signal after step %d; checkpoint saved", step + 1)
                    break
                if (step + 1) % ckpt_cfg.save_every == 0:
                    save(step + 1, state, iterator.get_state())
            else:
                save(int(jax.device_get(state.step)), state, iterator.get_state())
                final_eval = _final_evaluation(evaluators, state, train_cfg)
    finally:
        if bar is not None:
            bar.close()
        if ckpt is not None:
            ckpt.close()

    final = {k: history[-1][k] for k in METRIC_NAMES} if history else {}
    last = history[-1]["step"] if history else start
    return TrainResult(final, history, start, last, preempted, skipped, saved, state, model_def, final_eval)


def _final_evaluation(evaluators: dict, state, train_cfg: TrainConfig) -> dict:
    """Megatron's end-of-training evaluations: the next valid batches, then the test split's first."""
    out, steps = {}, int(jax.device_get(state.step))
    if "valid" in evaluators:
        out.update(evaluators["valid"].evaluate(state, train_cfg.steps // train_cfg.eval_every))
        log.info(megatron_line(f"iteration {steps} on validation set", out))
    if "test" in evaluators:
        out.update(evaluators["test"].evaluate(state, 0))
        log.info(megatron_line(f"iteration {steps} on test set", out, key="test"))
    return out
