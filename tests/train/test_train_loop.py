"""The loop: exact resume (bitwise per-step losses and data order), SIGTERM, NaN guard, keep-N."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from train_helpers import TinyConfig

from lingpack.data import DataConfig
from lingpack.train import loop as loop_lib
from lingpack.train.checkpoint import Checkpointer
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig

N = 6
DATA = DataConfig(source="synthetic", seq_length=32, global_batch_size=16, synthetic_mean_length=12,
                  synthetic_num_documents=400, read_threads=1, prefetch_buffer_size=1)
OPTIM = OptimConfig(lr=3e-2, min_lr=3e-3, warmup_steps=2, decay_steps=N)
PARALLEL = ParallelConfig(data=2, fsdp=2, tensor=2)
TRAIN = TrainConfig(steps=N, micro_batches=2, log_every=2, progress_bar=False)


def _train(tmp_path, ckpt=True, train=TRAIN, callback=None, loss=LossConfig(), name="ckpt", **ckpt_kw):
    ckpt_cfg = CheckpointConfig(directory=str(tmp_path / name), save_every=2, keep=2, enabled=ckpt, **ckpt_kw)
    return loop_lib.train(TinyConfig(), DATA, loss, OPTIM, PARALLEL, ckpt_cfg, train, metrics_callback=callback)


def _losses(history):
    return [(h["step"], h["loss"], h["lm_loss"], h["grad_norm"], h["data_fingerprint"]) for h in history]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("straight"), ckpt=False)


def test_metrics_contract(straight):
    assert len(straight.history) == N and straight.last_step == N and not straight.preempted
    assert set(loop_lib.METRIC_NAMES) - {"mfu"} <= set(straight.final_metrics)
    assert "mfu" not in straight.final_metrics     # the stand-in model has no FLOP count: no made-up mfu
    first = straight.history[0]
    assert first["lr"] == 0.0 and straight.history[2]["lr"] == pytest.approx(OPTIM.lr)   # Megatron warmup from 0
    assert first["tokens"] == DATA.global_batch_size * DATA.seq_length
    assert 0 < first["loss_tokens"] <= first["tokens"] and first["segments_per_row"] > 1
    assert straight.history[-1]["loss"] < straight.history[0]["loss"]


def test_sigterm_then_resume_is_bitwise_identical(tmp_path, straight):
    def kill_at_half(step, metrics):
        if step == N // 2:
            os.kill(os.getpid(), signal.SIGTERM)
    previous = signal.getsignal(signal.SIGTERM)
    first = _train(tmp_path, callback=kill_at_half)
    assert first.preempted and first.last_step == N // 2
    assert Checkpointer(CheckpointConfig(directory=str(tmp_path / "ckpt"))).latest_step() == N // 2
    assert signal.getsignal(signal.SIGTERM) is previous          # the handler in place before training is back

    second = _train(tmp_path)                                     # restores step N/2, data position included
    assert second.start_step == N // 2 and second.last_step == N
    assert _losses(first.history + second.history) == _losses(straight.history)   # bitwise, same batches
    steps = Checkpointer(CheckpointConfig(directory=str(tmp_path / "ckpt"))).all_steps()
    assert steps == [4, 6]                                         # keep=2 of the saves at 2, 3, 4, 6


def test_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path, straight, caplog):
    first = _train(tmp_path, train=dataclasses.replace(TRAIN, steps=4))           # saves steps 2 and 4
    chunk = max((p for p in (tmp_path / "ckpt" / "4" / "state").rglob("*") if p.parent.name == "d"),
                key=lambda p: p.stat().st_size)
    chunk.unlink()                                                                  # one data file of step 4 lost
    with caplog.at_level("WARNING"):
        second = _train(tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "checkpoint step 4" in warnings[0] and "resuming from step 2" in warnings[0]
    assert second.start_step == 2 and second.last_step == N
    assert _losses(first.history[:2] + second.history) == _losses(straight.history)   # steps 3-4 redone exactly
    assert (tmp_path / "ckpt.damaged" / "4" / "state").is_dir()                     # kept, beside the directory


GUARDED = """
import logging, sys, threading
from lingpack.train.checkpoint import PreemptionGuard
logging.basicConfig(stream=sys.stderr, format="%(message)s", force=True)
with PreemptionGuard() as guard:
    guard.step, guard.compiling, guard.saved = 7, True, lambda: "the checkpoint of step 6 is saved"
    print("ready", flush=True)
    blocked = threading.Lock()
    blocked.acquire()
    blocked.acquire()  # the main thread stuck in C (as in an XLA compile): Python's own handler cannot stop it
"""


def test_second_signal_exits_at_once_with_one_line(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", GUARDED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGINT)
        first = child.stderr.readline()
        assert first.startswith("received SIGINT: stopping after step 7 (it is still being compiled"), first
        child.send_signal(signal.SIGINT)
        rest = child.communicate(timeout=120)[1]
    finally:
        child.kill()
    assert child.returncode == 128 + signal.SIGINT
    assert [line for line in rest.splitlines() if line.strip()] == [
        "second SIGINT: exiting now, without waiting for the step to finish; the checkpoint of step 6 is saved"]


def _poison_iterator(monkeypatch, bad_step):
    real = loop_lib.make_iterator

    class Poisoned:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            index = self.it.get_state()["next_index"]
            batch = next(self.it)
            if index + 1 == bad_step:   # an out-of-vocabulary target makes the cross-entropy NaN
                batch = dict(batch, targets=np.where(np.arange(batch["targets"].size).reshape(batch["targets"].shape)
                                                     == 0, 10**6, batch["targets"]).astype(np.int32))
            return batch

        def get_state(self):
            return self.it.get_state()

        def set_state(self, state):
            self.it.set_state(state)
    monkeypatch.setattr(loop_lib, "make_iterator", lambda *a, **k: Poisoned(real(*a, **k)))


def test_nan_halts_after_checkpoint(tmp_path, monkeypatch, straight):
    _poison_iterator(monkeypatch, bad_step=4)
    with pytest.raises(loop_lib.NonFiniteLossError, match="step 4: non-finite loss") as err:
        _train(tmp_path, train=dataclasses.replace(TRAIN, nan_policy="halt"))
    assert err.value.checkpoint_step == 3
    assert [h["finite"] for h in err.value.history] == [1, 1, 1, 0]
    ckpt = Checkpointer(CheckpointConfig(directory=str(tmp_path / "ckpt")))
    assert ckpt.latest_step() == 3
    ckpt.close()
    monkeypatch.undo()
    resumed = _train(tmp_path)            # clean data now: resuming from the saved state reproduces the run
    assert resumed.start_step == 3
    assert _losses(resumed.history) == _losses(straight.history[3:])


def test_nan_skip_keeps_training(tmp_path, monkeypatch, caplog):
    _poison_iterator(monkeypatch, bad_step=2)
    with caplog.at_level("INFO", logger="lingpack.train"):
        result = _train(tmp_path, ckpt=False, train=dataclasses.replace(TRAIN, nan_policy="skip", steps=3))
    compile_lines = [r.getMessage() for r in caplog.records if "compil" in r.getMessage()]
    assert compile_lines[0] == "compiling the train step ..." and len(compile_lines) == 2   # once, with its time
    assert compile_lines[1].startswith("compiled the train step in ") and compile_lines[1].endswith(" s")
    assert result.skipped_steps == 1 and [h["finite"] for h in result.history] == [1, 0, 1]
    assert np.isfinite(result.final_metrics["loss"])


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="nan_policy"):
        TrainConfig(nan_policy="ignore")
    with pytest.raises(ValueError, match="does not split over"):
        _train(tmp_path, ckpt=False, train=dataclasses.replace(TRAIN, micro_batches=8))  # 2 rows over 4 shards
