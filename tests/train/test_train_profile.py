"""`train.profile_steps=[a, b]`: a jax.profiler trace of those steps in the run directory; validated in one line."""

from __future__ import annotations

import pytest

from train_helpers import TinyConfig

from lingpack.data import DataConfig
from lingpack.errors import ConfigError
from lingpack.train import loop as loop_lib
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig

DATA = DataConfig(source="synthetic", seq_length=32, global_batch_size=2, synthetic_mean_length=12,
                  synthetic_num_documents=50, read_threads=1, prefetch_buffer_size=1)


def test_profile_steps_write_a_trace(tmp_path):
    train = TrainConfig(steps=3, log_every=1, progress_bar=False, handle_signals=False,
                        profile_steps=[1, 2], profile_dir=str(tmp_path / "profile"))
    result = loop_lib.train(TinyConfig(), DATA, LossConfig(), OptimConfig(decay_steps=3), ParallelConfig(data=1),
                            CheckpointConfig(directory=str(tmp_path / "ckpt"), enabled=False), train)
    assert result.last_step == 3
    xplanes = list((tmp_path / "profile").rglob("*.xplane.pb"))      # TensorBoard / xprof
    perfetto = list((tmp_path / "profile").rglob("perfetto_trace.json.gz"))
    assert len(xplanes) == 1 and xplanes[0].stat().st_size > 0
    assert len(perfetto) == 1 and perfetto[0].stat().st_size > 0


@pytest.mark.parametrize("steps", [[2, 2], [3, 1], [0, 11], [-1, 2], [1], "1-2"])
def test_profile_steps_are_validated(steps):
    with pytest.raises(ConfigError, match=r"train.profile_steps=.* must be \[a, b\] with 0 <= a < b <= train.steps=10"):
        TrainConfig(steps=10, profile_steps=steps)


def test_profiling_is_off_by_default():
    assert TrainConfig().profile_steps is None
