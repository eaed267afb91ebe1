"""The training loop: data -> sharded step -> metrics, with checkpoint/resume and preemption handling.

    result = train(model_cfg, data_cfg, loss_cfg, optim_cfg, parallel_cfg, ckpt_cfg, train_cfg,
                   metrics_callback=None, on_start=None, routing_callback=None)

On start the newest intact checkpoint in `ckpt_cfg.directory` (or `ckpt_cfg.resume_step`) is restored
(state and data position; train/checkpoint.py `Checkpointer.resume`), else the
state is initialised directly in its shardings; `on_start(step)` then hears the step training continues
from (0 or the restored one: a metrics writer drops its records past it). Each step reads one global
batch (this host's rows), runs the jitted step and reports one metrics dict (names in METRIC_NAMES; `mfu`
only when the device's peak FLOP/s is known) to `metrics_callback(step, metrics)` (every step) and to
`TrainResult.history`; the console shows a progress bar and one log line every `log_every` steps.
Every `train.eval_every` steps the valid split is evaluated (evaluate.py; its `val_*` metrics join that
step's record) and, when the run completes, the valid and test splits once more (`TrainResult.final_eval`).
Checkpoints every `save_every` steps, at the end, on SIGTERM/SIGINT (then the loop returns with
`preempted=True`) and before halting on a non-finite loss or (overflow_policy="halt") on documents
beyond the kernel's max_segs, which no update has then included. With `routing_callback`, the step also
returns its MoE routing (step.py `trace_routing`), handed to `routing_callback(step, routing)` as numpy
arrays (the parity harness's routing trace).

`model_cfg` is a `Ling3Config`, or any frozen config with `make_model(rngs) -> nnx.Module` whose call
returns a `Ling3Output` (tests use a small stand-in that way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
import zlib

import jax
import numpy as np
from flax import nnx

from lingpack import distributed
from lingpack.data.pipeline import make_iterator
from lingpack.errors import ConfigError
from lingpack.parallel.context import ContextParallel
from lingpack.parallel.reorder import check_length, reorder_batch
from lingpack.train import flops as flops_lib
from lingpack.train import optim as optim_lib
from lingpack.train import sharding as shard_lib
from lingpack.train.checkpoint import Checkpointer, PreemptionGuard
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.evaluate import batches_note, make_evaluators, megatron_line
from lingpack.train.program import TrainProgram, make_model  # noqa: F401  (make_model: re-exported)

log = logging.getLogger("lingpack.train")

METRIC_NAMES = ("loss", "lm_loss", "mtp_loss", "moe_z_loss", "grad_norm", "lr", "tokens", "tokens_per_s",
                "step_time_s", "mfu", "segments_per_row", "max_segs", "dropped_documents", "dropped_tokens",
                "t_new_over_t", "native_t_over_t", "loss_tokens")


class HaltError(RuntimeError):
    """A halting policy stopped the run; `.history` holds the metrics so far, `.checkpoint_step` the saved step."""

    def __init__(self, message: str, history: list, checkpoint_step: int | None):
        super().__init__(message)
        self.history, self.checkpoint_step = history, checkpoint_step


class NonFiniteLossError(HaltError):
    """Raised by nan_policy="halt"."""


class OverflowHaltError(HaltError):
    """Raised by overflow_policy="halt": a micro-batch held more documents than the kernel's max_segs."""


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


def _check_batch(data_cfg, train_cfg: TrainConfig, loss_cfg: LossConfig, mesh, rules) -> None:
    B, M = data_cfg.global_batch_size, train_cfg.micro_batches
    if B % M:
        raise ConfigError(f"data.global_batch_size={B} is not divisible by train.micro_batches={M}")
    rows, shards = B // M, shard_lib.batch_divisor(mesh, rules)
    if rows % shards:
        raise ConfigError(f"a micro-batch of {rows} rows (data.global_batch_size {B} / train.micro_batches {M}) does "
                          f"not split over the {shards} batch shards of the mesh {dict(mesh.shape)}; make it a "
                          f"multiple of {shards}")
    if rows % loss_cfg.megatron_dp_size:
        raise ConfigError(f"a micro-batch of {rows} rows does not split into loss.megatron_dp_size="
                          f"{loss_cfg.megatron_dp_size} groups")


def _fingerprint(batch: dict) -> int:
    """crc32 of the inputs: lets tests and logs check the data order cheaply."""
    return zlib.crc32(np.ascontiguousarray(batch["inputs"]).tobytes())


def _scalar(x):
    x = np.asarray(x)
    return int(x) if np.issubdtype(x.dtype, np.integer) else float(x)


_OVERFLOW_FIX = ("Raise kernel.max_segs (`python -m lingpack.data.stats` with this run's overrides recommends one) "
                 "or use a kernel without max_segs (kernel=chunked)")


def _log_line(metrics: dict) -> str:
    """The one console line of a logged step."""
    parts = [f"step {metrics['step']}", f"loss {metrics['loss']:.5f}", f"lm loss {metrics['lm_loss']:.5f}",
             f"grad norm {metrics['grad_norm']:.3f}", f"lr {metrics['lr']:.3e}", f"{metrics['tokens_per_s']:.0f} tok/s"]
    if "mfu" in metrics:
        parts.append(f"mfu {metrics['mfu']:.3f}")
    if metrics["dropped_documents"]:
        parts.append(f"dropped {metrics['dropped_documents']} docs / {metrics['dropped_tokens']} tokens")
    return " | ".join(parts)


def _progress(train_cfg: TrainConfig, start: int):
    if not train_cfg.progress_bar or jax.process_index() != 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: plain log lines then
        return None
    return tqdm(total=train_cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _log_above(bar):
    """While the bar shows, console log lines print above it (tqdm.write) instead of into its line."""
    console = [h for h in logging.root.handlers if isinstance(h, logging.StreamHandler)
               and getattr(h, "stream", None) in (sys.stdout, sys.stderr)]
    if bar is None or not console:  # nobody prints log lines to the terminal (a library caller, tests)
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm
    return logging_redirect_tqdm()


class _Profiler:
    """`train.profile_steps=[a, b]`: a jax.profiler trace of loop steps a <= step < b in `train.profile_dir`."""

    def __init__(self, train_cfg: TrainConfig):
        self.steps, self.directory, self.active = train_cfg.profile_steps, train_cfg.profile_dir, False

    def before(self, step: int) -> None:
        if self.steps and not self.active and self.steps[0] <= step < self.steps[1]:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True
            log.info("profiling steps %d-%d into %s", step + 1, self.steps[1], self.directory)

    def after(self, step: int) -> None:
        if self.active and step + 1 >= self.steps[1]:
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            log.info("profile written to %s (TensorBoard / xprof: its plugins/profile; Perfetto: perfetto_trace.json.gz)",
                     self.directory)


def train(model_cfg, data_cfg, loss_cfg: LossConfig, optim_cfg: OptimConfig, parallel_cfg: ParallelConfig,
          ckpt_cfg: CheckpointConfig, train_cfg: TrainConfig, *, metrics_callback=None, on_start=None,
          routing_callback=None, data_state_on_resume=None) -> TrainResult:
    """`data_state_on_resume(step, data_state) -> data_state` may move the restored data position (the
    context schedule does at a stage change, where the data pipeline's sequence length changes)."""
    optim_cfg = optim_lib.resolve(optim_cfg, train_cfg.steps)
    program = TrainProgram.build(model_cfg, loss_cfg, optim_cfg, parallel_cfg, train_cfg,
                                 trace_routing=routing_callback is not None)
    mesh, rules, context, model_def = program.mesh, parallel_cfg.rules, program.context, program.model_def
    _check_batch(data_cfg, train_cfg, loss_cfg, mesh, rules)
    if context is not None:
        check_length(data_cfg.seq_length, context.size, context.load_balance)
    init, abstract, shardings, step_fn = program.init, program.abstract_state, program.shardings, program.step
    for line in shard_lib.sharding_report(list(program.dropped)):
        log.info(line)

    batch_sharding, B = shard_lib.batch_sharding(mesh, rules), data_cfg.global_batch_size
    iterator = make_iterator(data_cfg, split="train", rows=distributed.process_rows(batch_sharding, B))
    ckpt = Checkpointer(ckpt_cfg) if ckpt_cfg.enabled else None
    resumed = ckpt.resume(abstract, shardings, ckpt_cfg.resume_step) if ckpt else None
    latest = resumed[0] if resumed else None
    if resumed is not None:
        state, data_state = resumed[1:]
        if data_state_on_resume is not None:
            data_state = data_state_on_resume(latest, data_state)
        iterator.set_state(data_state)
        log.info("resumed from step %d (%s)", latest, ckpt.directory)
        if getattr(model_cfg, "init_from", None):
            log.info("model.init_from=%s not read: the run resumes from its own checkpoint", model_cfg.init_from)
    else:
        state = jax.jit(init, out_shardings=shardings)()
        if getattr(model_cfg, "init_from", None):   # a transformers directory (export/importer.py)
            from lingpack.export.importer import initial_state
            state = initial_state(state, shardings, model_cfg, model_cfg.init_from)
    start = int(jax.device_get(state.step))
    if on_start is not None:
        on_start(start)
    evaluators = make_evaluators(model_def, data_cfg, loss_cfg, train_cfg, mesh=mesh, rules=rules, context=context)

    peak = train_cfg.peak_flops_per_device or flops_lib.peak_flops_per_device()
    step_flops = flops_lib.flops_per_token(model_cfg, data_cfg.seq_length) * data_cfg.global_batch_size * data_cfg.seq_length
    log.info("mesh %s over %d %s device(s)%s", dict(mesh.shape), jax.device_count(), jax.devices()[0].device_kind,
             "" if peak else "; peak FLOP/s unknown, no mfu (set train.peak_flops_per_device)")
    if peak and not train_cfg.peak_flops_per_device and jax.devices()[0].platform == "cpu":
        log.info("mfu on CPU is approximate: against a matmul ceiling measured at start, %.1f GFLOP/s per device (it "
                 "varies up to ~2x between processes on a shared machine; train.peak_flops_per_device sets a fixed "
                 "one)", peak / 1e9)

    history, saved, skipped, preempted, final_eval, warned_overflow = [], [], 0, False, {}, False
    profiler = _Profiler(train_cfg)
    bar = _progress(train_cfg, start)
    last_saved = latest

    def save(step_number, state_, data_state_, wait=False):
        nonlocal last_saved
        if ckpt is not None and step_number != last_saved:
            ckpt.save(step_number, state_, data_state_, wait=wait)
            saved.append(step_number)
            last_saved = step_number
            log.info("checkpoint: step %d", step_number)

    def halt(error_cls, step, state_, data_state_, reason, fix):
        # The step left params/optimizer/rng untouched: step-1 + the pre-batch data state is exact.
        save(step, state_.replace(step=state_.step - 1), data_state_, wait=True)
        where = f"saved at step {step} in {ckpt.directory}" if ckpt else "not saved (checkpointing disabled)"
        raise error_cls(f"step {step + 1}: {reason}; no update was applied, the state before this batch is {where}. "
                        f"{fix}", history, step if ckpt else None)

    try:
        with PreemptionGuard(train_cfg.handle_signals) as guard, _log_above(bar):
            guard.saved = lambda: _saved_now(ckpt, last_saved, guard.step)
            for step in range(start, train_cfg.steps):
                guard.step = step + 1
                data_state = iterator.get_state()
                try:
                    local = next(iterator)
                except StopIteration:
                    raise ConfigError(f"the data ran out after {step} batches (train.steps={train_cfg.steps}); raise "
                                      "data.num_samples or data.num_epochs (or set both to null: as many epochs as "
                                      "the run needs), or lower train.steps") from None
                fingerprint = _fingerprint(local)
                if context is not None and context.load_balance:  # once per batch, every array (parallel/)
                    local = reorder_batch(local, context.size)
                batch = distributed.global_batch(local, batch_sharding, B)
                if step == start:  # compiled here (its call then hits jit's cache), so the console says how long
                    _compile_step(step_fn, state, batch, guard)
                profiler.before(step)
                t0 = time.perf_counter()
                state, metrics = step_fn(state, batch)
                metrics = jax.device_get(metrics)  # waits for the step
                profiler.after(step)
                guard.compiling = False
                if routing_callback is not None:
                    routing_callback(step + 1, metrics.pop("routing"))
                metrics = {k: _scalar(v) for k, v in metrics.items()}
                dt = time.perf_counter() - t0
                metrics.update(step=step + 1, step_time_s=dt, tokens_per_s=metrics["tokens"] / dt,
                               data_fingerprint=fingerprint)
                if peak and step_flops:  # no mfu without a peak or without the model's FLOP count
                    metrics["mfu"] = step_flops / dt / (peak * jax.device_count())
                evaluated = {}
                if evaluators and (step + 1) % train_cfg.eval_every == 0:  # Megatron's eval_interval
                    index = (step + 1) // train_cfg.eval_every - 1
                    evaluated = evaluators["valid"].evaluate(state, index)
                    log.info(megatron_line(f"iteration {step + 1}", evaluated,
                                           note=batches_note("periodic", "valid", index, train_cfg.eval_batches)))
                    metrics.update(evaluated)
                history.append(metrics)
                if metrics_callback is not None:
                    metrics_callback(step + 1, {**{k: metrics[k] for k in METRIC_NAMES if k in metrics}, **evaluated})
                if bar is not None:  # the postfix first: update(1) draws the bar with this step's figures
                    bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                    tok_s=f"{metrics['tokens_per_s']:.0f}", refresh=False)
                    bar.update(1)
                if (step + 1) % train_cfg.log_every == 0:
                    log.info(_log_line(metrics))

                dropped = metrics["dropped_documents"]
                if dropped and train_cfg.overflow_policy == "halt":
                    halt(OverflowHaltError, step, state, data_state,
                         f"{dropped} documents ({metrics['dropped_tokens']} tokens) do not fit kernel.max_segs="
                         f"{metrics['max_segs']} (train.overflow_policy=halt)", _OVERFLOW_FIX)
                if dropped and not warned_overflow:
                    warned_overflow = True
                    log.warning("step %d: %d documents (%d tokens) do not fit kernel.max_segs=%d and were left out "
                                "of this step (no loss, no gradient); the run counts them per step "
                                "(dropped_documents, dropped_tokens). %s", step + 1, dropped,
                                metrics["dropped_tokens"], metrics["max_segs"], _OVERFLOW_FIX)
                if metrics["invalid_rows"]:
                    log.warning("step %d: %d rows have decreasing segment ids or padding before real tokens; "
                                "check the data pipeline", step + 1, metrics["invalid_rows"])
                if not metrics["finite"]:
                    if train_cfg.nan_policy == "halt":
                        halt(NonFiniteLossError, step, state, data_state,
                             f"non-finite loss (loss={metrics['loss']}, grad_norm={metrics['grad_norm']})",
                             "Lower the lr, check the data, or set train.nan_policy='skip' to drop such steps")
                    skipped += 1
                    log.warning("step %d: non-finite loss %s, update skipped", step + 1, metrics["loss"])

                if guard.should_stop():
                    save(step + 1, state, iterator.get_state(), wait=True)
                    preempted = True
                    log.warning("stopped by signal after step %d%s", step + 1, "; checkpoint saved" if ckpt else "")
                    break
                if (step + 1) % ckpt_cfg.save_every == 0:
                    save(step + 1, state, iterator.get_state())
            else:
                save(int(jax.device_get(state.step)), state, iterator.get_state())
                final_eval = _final_evaluation(evaluators, state, train_cfg)
    finally:
        profiler.stop()
        if bar is not None:
            bar.close()
        if ckpt is not None:
            ckpt.close()

    dropped_steps = sum(1 for h in history if h["dropped_documents"])
    if dropped_steps:
        log.warning("%d of %d steps left out documents beyond kernel.max_segs: %d documents, %d tokens in all",
                    dropped_steps, len(history), sum(h["dropped_documents"] for h in history),
                    sum(h["dropped_tokens"] for h in history))
    final = {k: history[-1][k] for k in METRIC_NAMES if k in history[-1]} if history else {}
    last = history[-1]["step"] if history else start
    return TrainResult(final, history, start, last, preempted, skipped, saved, state, model_def, final_eval)


def _compile_step(step_fn, state, batch, guard) -> None:
    """Compile the step ahead of its first call, with one line before and one after (above the progress bar);
    multi-process: every process compiled before any runs a collective."""
    guard.compiling = True
    log.info("compiling the train step ...")
    t0 = time.perf_counter()
    step_fn.lower(state, batch).compile()
    log.info("compiled the train step in %.1f s", time.perf_counter() - t0)
    distributed.compile_then_wait(step_fn, state, batch)  # the barrier (compiled already: a cache hit)


def _saved_now(ckpt, last_saved: int | None, step: int | None) -> str:
    """What is on disk right now, for the line a second signal prints before the process exits."""
    if ckpt is None:
        return "nothing is saved (checkpoint.enabled=false)"
    if last_saved is None:
        return f"nothing is saved: {ckpt.directory} holds no checkpoint of this run yet"
    writing = ckpt.manager.is_saving_in_progress()
    done = (f"the checkpoint of step {last_saved} in {ckpt.directory} is "
            + ("still being written and is lost if incomplete (a rerun then resumes from the one before)"
               if writing else "saved"))
    lost = ""
    if step is not None and step > last_saved:
        lost = f"; step {step} is not" if step == last_saved + 1 else f"; steps {last_saved + 1}-{step} are not"
    return done + lost


def _final_evaluation(evaluators: dict, state, train_cfg: TrainConfig) -> dict:
    """Megatron's end-of-training evaluations: the next valid batches, then the test split's first."""
    out, steps, batches = {}, int(jax.device_get(state.step)), train_cfg.eval_batches
    if "valid" in evaluators:
        index = train_cfg.steps // train_cfg.eval_every  # the valid batches after the last periodic evaluation's
        out.update(evaluators["valid"].evaluate(state, index))
        log.info(megatron_line(f"iteration {steps} on validation set", out,
                               note=batches_note("end of training, after the periodic ones", "valid", index,
                                                  batches)))
    if "test" in evaluators:
        out.update(evaluators["test"].evaluate(state, 0))
        log.info(megatron_line(f"iteration {steps} on test set", out, key="test",
                               note=batches_note("end of training", "test", 0, batches)))
    return out
