"""Orbax checkpoints of the whole training state, and a preemption guard for SIGTERM / SIGINT.

A checkpoint at step s holds the TrainState (master params, optimizer state, expert biases, step,
update count, RNG key data) and the Grain iterator state (a small JSON dict) positioned at batch s, so a
restore continues with exactly the batch an uninterrupted run would have read next. Saves are async
by default: Orbax copies the arrays to host memory before `save` returns (so the next step may donate
them) and writes in a background thread; `wait()` blocks until the write is durable. The newest
`keep` checkpoints survive.

Resume (`Checkpointer.resume`) restores the newest step that restores: a step that cannot be read back (a file
deleted or truncated, its metadata gone) is named in one warning line, moved aside whole into
`<directory>.damaged/<step>` (never deleted: Orbax's keep-N cleanup sees only `directory`, and the run can
save that step number afresh) and the next older step is tried. `checkpoint.resume_step=N` restores exactly
step N or stops with one line.

On multi-host runs every host's iterator is at the same batch number, so the primary host's JSON
stands for all (each host re-derives its own rows from it, see data/pipeline.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading

import jax
import orbax.checkpoint as ocp
from etils import epath

from lingpack.distributed import local_or_url
from lingpack.errors import ConfigError
from lingpack.train.configs import CheckpointConfig
from lingpack.train.step import TrainState

log = logging.getLogger("lingpack.train")


def _state_dict(state: TrainState) -> dict:
    return {"step": state.step, "updates": state.updates, "params": state.params, "rest": state.rest,
            "opt_state": state.opt_state, "rng": state.rng}


def _shapes(tree) -> dict:
    """{"a/b/c": shape} of every array (or Orbax ArrayMetadata) leaf."""
    def name(key):
        return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {"/".join(name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager` with items `state` (pytree) and `data` (JSON)."""

    def __init__(self, cfg: CheckpointConfig):
        self.cfg = cfg
        self.directory = local_or_url(cfg.directory)  # gs://... for pods without a shared disk
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True,
                                               enable_async_checkpointing=cfg.async_save)
        # Each item with its handler, so that reading a checkpoint's metadata (latest step, shapes) knows how to
        # read what it holds: with item names alone Orbax warns that it "could not restore" every item.
        handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, data_state: dict, *, wait: bool = False) -> None:
        """Save `state` (at `step`) and the iterator state; `wait=True` blocks until it is on disk."""
        if step in self.manager.all_steps():
            return  # already saved at this step (e.g. a periodic save right before a preemption save)
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state_dict(state)),
                                                        data=ocp.args.JsonSave(dict(data_state))), force=True)
        if wait:
            self.wait()

    def restore(self, step: int, abstract_state: TrainState, shardings: TrainState) -> tuple[TrainState, dict]:
        """(TrainState placed in `shardings`, iterator state) from the checkpoint at `step`."""
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              _state_dict(abstract_state), _state_dict(shardings))
        self._check_shapes(step, target["params"])
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                      data=ocp.args.JsonRestore()))
        return TrainState(**restored["state"]), dict(restored["data"])

    def resume(self, abstract_state: TrainState, shardings: TrainState,
               resume_step: int | None = None) -> tuple[int, TrainState, dict] | None:
        """(step, state, iterator state) of the newest step that restores, or of `resume_step`; None when the
        directory holds no checkpoint. Damaged newer steps are set aside (see the module docstring)."""
        steps = self.all_steps()
        if resume_step is not None:
            return resume_step, *self._restore_chosen(resume_step, steps, abstract_state, shardings)
        damaged = []
        for step in reversed(steps):
            try:
                with _orbax_quiet():
                    state, data_state = self.restore(step, abstract_state, shardings)
            except ConfigError:  # another model's checkpoint: the user's config, not damage
                raise
            except Exception as error:  # noqa: BLE001  whatever Orbax raises for a file it cannot read
                damaged.append((step, _reason(error)))
                continue
            if damaged:
                names = ", ".join(str(s) for s, _ in damaged)
                try:
                    aside = [self._set_aside(s) for s, _ in damaged]
                except OSError as error:  # e.g. a bucket without renames: nothing deleted, the user decides
                    raise ConfigError(f"checkpoint step {names} in {self.directory} cannot be restored "
                                      f"({damaged[0][1]}) nor moved aside ({error}); move it out of the directory "
                                      f"to resume from step {step}, the newest intact one") from None
                log.warning("checkpoint step %s in %s cannot be restored (%s): resuming from step %d, the newest "
                            "intact one; the damaged %s kept in %s (move it back and set checkpoint.resume_step "
                            "to retry it)", names, self.directory, damaged[0][1], step,
                            "step is" if len(damaged) == 1 else "steps are", ", ".join(aside))
            return step, state, data_state
        if damaged:
            raise ConfigError(f"no checkpoint in {self.directory} can be restored (steps "
                              f"{', '.join(str(s) for s, _ in damaged)}; step {damaged[0][0]}: {damaged[0][1]}); "
                              "nothing was moved or deleted: move the directory away to train from step 0")
        return None

    def _restore_chosen(self, step: int, steps: list[int], abstract_state, shardings) -> tuple[TrainState, dict]:
        if step not in steps:
            raise ConfigError(f"checkpoint.resume_step={step}: no such step in {self.directory} (it holds "
                              f"{steps or 'none'}); set one of them, or null for the newest intact one")
        newer = [s for s in steps if s > step]
        if newer:
            raise ConfigError(f"checkpoint.resume_step={step}, but {self.directory} also holds the newer steps "
                              f"{newer}, which training on from step {step} would save over: move them out of "
                              "the directory first")
        try:
            with _orbax_quiet():
                return self.restore(step, abstract_state, shardings)
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001
            raise ConfigError(f"checkpoint.resume_step={step}: the checkpoint at step {step} in {self.directory} "
                              f"cannot be restored ({_reason(error)}); choose another of {steps}") from None

    def _set_aside(self, step: int) -> str:
        """Move step `step`'s directory, untouched, out of Orbax's view into `<directory>.damaged/`."""
        source = epath.Path(self.directory) / str(step)
        target = source.parent.parent / f"{source.parent.name}.damaged" / str(step)
        if jax.process_index() == 0:
            suffix = 0
            while target.exists():  # the same step damaged again: keep both
                suffix += 1
                target = target.parent / f"{step}.{suffix}"
            target.parent.mkdir(parents=True, exist_ok=True)
            source.rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"lingpack set aside checkpoint {step}")
        self.manager.reload()
        return str(target)

    def _check_shapes(self, step: int, params: dict) -> None:
        """ConfigError naming the parameters whose stored shapes differ from this run's model (Orbax's own
        error names neither the array nor the cause). Any shape may restore into any sharding."""
        try:
            stored = self.manager.item_metadata(step)["state"]
            stored = getattr(stored, "tree", stored)["params"]
        except Exception:  # noqa: BLE001  metadata in another layout: Orbax's restore still checks
            return
        have, want = _shapes(stored), _shapes(params)
        missing, unknown = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if missing or unknown:
            raise ConfigError(
                f"the checkpoint at step {step} in {self.directory} holds another model layout: this run's"
                f" {missing[:3]} ({len(missing)} in all) are not in it, its {unknown[:3]} ({len(unknown)}) are not"
                " in this run. Resume with the model config it was written with (num_layers, first_dense_layers,"
                " mtp_num_layers, scan_layers: scanned layers are stored stacked under stack/ (kda, mla, ffn),"
                " checkpoints older than the layer stack under cycles/)")
        diff = [f"{k}: checkpoint {have[k]}, this run {want[k]}" for k in sorted(want) if have[k] != want[k]]
        if diff:
            raise ConfigError(
                f"the checkpoint at step {step} in {self.directory} holds another model: {'; '.join(diff[:3])}"
                f"{f' (and {len(diff) - 3} more)' if len(diff) > 3 else ''}. Resume with the model config it was "
                "written with; the padded vocabulary also follows parallel.tensor (model.vocab_size_divisible_by x "
                "tensor, as Megatron), so keep parallel.tensor or set model.vocab_size explicitly")

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


@contextlib.contextmanager
def _orbax_quiet():
    """Orbax warns on its own (absl) about a step it cannot read; the one line about it is ours."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


def _reason(error: BaseException) -> str:
    """The innermost cause of an Orbax / TensorStore error, its first line cut short for a one-line message."""
    seen = [error]
    while (error.__cause__ or error.__context__) is not None and len(seen) < 20:
        error = error.__cause__ or error.__context__
        seen.append(error)
    text = (str(error).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0]
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class PreemptionGuard:
    """Context manager: SIGTERM / SIGINT set `triggered` instead of killing the process.

    The loop checks `should_stop()` after each step, saves a checkpoint and returns. Each signal is read at
    once by a watcher thread (`signal.set_wakeup_fd`), even while the main thread is inside a compile that
    Python cannot interrupt: the first is answered with one line saying when the run will stop (after the
    step in `step` and its checkpoint); a second exits the process at once (status 128 + signal) with one line
    saying what is saved (`saved()`, set by the loop) and what is not. Nothing is ever raised into the main
    thread's code (a KeyboardInterrupt raised inside JAX's tracing printed its whole stack, once per press).
    Handlers are installed only in the main thread (Python's rule) and restored on exit.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.triggered: int | None = None
        self.signals = 0
        self.step: int | None = None   # the step being run (1-based), kept current by the loop
        self.compiling = False         # the loop's first step: compiled on its first call
        self.saved = lambda: "nothing is saved"   # what a second signal's line says is on disk
        self._previous = {}
        self._wakeup = None

    def _handle(self, signum, frame):  # the main thread, whenever Python next runs there: only a flag
        if self.triggered is None:
            self.triggered = signum

    def _watch(self, reader) -> None:
        while True:
            try:
                received = reader.recv(64)
            except OSError:
                return
            if not received:  # closed by __exit__
                return
            for signum in received:  # one byte per signal: its number
                if signum in self.SIGNALS:
                    self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        self.signals += 1
        if self.signals == 1:
            if self.triggered is None:
                self.triggered = signum
            log.warning("received %s: %s", name, self._stop_plan())
            return
        line = f"second {name}: exiting now, without waiting for the step to finish; {self.saved()}"
        try:
            sys.stdout.flush()
            sys.stderr.write(f"\n{line}\n")  # a new line: the progress bar may hold the current one
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)

    def _stop_plan(self) -> str:
        again = "press Ctrl-C again (or send a second signal) to exit at once without it"
        if self.step is None:
            return f"stopping before the first step; {again}"
        compiling = " (it is still being compiled, which can take minutes)" if self.compiling else ""
        return f"stopping after step {self.step}{compiling} and its checkpoint; {again}"

    def __enter__(self):
        if self.enabled:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            try:
                previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            except ValueError:  # not the main thread after all: the flag alone
                reader.close()
                writer.close()
            else:
                self._wakeup = (reader, writer, previous_fd)
                threading.Thread(target=self._watch, args=(reader,), name="lingpack-signals", daemon=True).start()
        return self

    def __exit__(self, *exc):
        if self._wakeup is not None:
            reader, writer, previous_fd = self._wakeup
            signal.set_wakeup_fd(previous_fd)
            writer.close()
            reader.shutdown(socket.SHUT_RDWR)
            reader.close()
            self._wakeup = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        return False

    def should_stop(self) -> bool:
        """True once any host got a signal (all hosts agree, so they save the same step)."""
        local = self.triggered is not None
        if jax.process_count() == 1:
            return local
        import numpy as np
        from jax.experimental import multihost_utils
        return bool(np.any(multihost_utils.process_allgather(np.array([local]))))
