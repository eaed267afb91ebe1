"""Progressive context schedule: 3 stages, stage changes rebuild the data at the new length from the
consumed tokens and switch RoPE theta; a SIGTERM mid-stage resumes in that stage, bitwise."""

from __future__ import annotations

import dataclasses
import os
import signal
import zlib

import numpy as np
import pytest

from train_helpers import TinyConfig

from lingpack.data import DataConfig, make_iterator
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.schedule import ContextSchedule, Stage, train_with_schedule

SCHEDULE = ContextSchedule(stages=(Stage(16, 2, 1e4), Stage(32, 3, 5e4), Stage(64, 2, 1e6)))
DATA = DataConfig(source="synthetic", seq_length=16, global_batch_size=4, synthetic_mean_length=12,
                  synthetic_num_documents=400, read_threads=1, prefetch_buffer_size=1)


@dataclasses.dataclass(frozen=True)
class RopeTinyConfig(TinyConfig):
    rope_theta: float = 1e4   # recorded only: the stand-in LM has no attention


def run(directory, callback=None):
    return train_with_schedule(SCHEDULE, RopeTinyConfig(), DATA, LossConfig(), OptimConfig(lr=1e-2, min_lr=1e-3),
                               ParallelConfig(data=1), CheckpointConfig(directory=str(directory), save_every=100),
                               TrainConfig(steps=1, progress_bar=False), metrics_callback=callback)


def records(results):
    return [(h["step"], h["loss"], h["grad_norm"], h["tokens"], h["data_fingerprint"]) for r in results for h in r.history]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return run(tmp_path_factory.mktemp("straight"))


def test_stages_switch_length_theta_and_continue_from_consumed_tokens(straight):
    assert [r.last_step for r in straight] == [2, 5, 7]
    assert [h["tokens"] for r in straight for h in r.history] == [64] * 2 + [128] * 3 + [256] * 2
    assert [r.model_def.config.rope_theta for r in straight] == [1e4, 5e4, 1e6]
    assert [h["lr"] for h in straight[-1].history][-1] < straight[0].history[1]["lr"]   # one LR decay over all stages
    # stage 2 (64 tokens) starts after 2 x 16 x 4 + 3 x 32 x 4 = 512 consumed tokens: batch 512 / (4 x 64) = 2
    assert SCHEDULE.start_batch(2, 4) == 2 and SCHEDULE.start_batch(1, 4) == 1
    it = make_iterator(dataclasses.replace(DATA, seq_length=64))
    it.set_state({"next_index": 2})
    assert zlib.crc32(np.ascontiguousarray(next(it)["inputs"]).tobytes()) == straight[2].history[0]["data_fingerprint"]


@pytest.mark.slow  # two more runs (~20 s of CPU)
def test_sigterm_mid_stage_resumes_in_that_stage_bitwise(tmp_path, straight):
    def kill(step, metrics):
        if step == 4:   # inside stage 1 (global steps 3..5)
            os.kill(os.getpid(), signal.SIGTERM)
    first = run(tmp_path, kill)
    assert len(first) == 2 and first[-1].preempted and first[-1].last_step == 4
    second = run(tmp_path)
    assert second[0].start_step == 4 and [r.last_step for r in second] == [5, 7]
    assert second[0].model_def.config.rope_theta == 5e4
    assert records(first + second) == records(straight)


def test_bad_stage_names_the_value():
    with pytest.raises(ValueError, match="steps >= 1"):
        Stage(16, 0)
