"""The loop on whole-document rows: a run stopped mid-epoch and resumed from its checkpoint (the iterator state
saved beside the train state) trains bitwise what an uninterrupted run trains."""
from __future__ import annotations

import numpy as np
import pytest

from train_helpers import TinyConfig

from lingpack.data import DataConfig
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.loop import train

DATA = DataConfig(source="synthetic", seq_length=32, global_batch_size=4, synthetic_mean_length=20,
                  synthetic_num_documents=300, synthetic_max_length=90, packing="whole_documents",
                  packing_open_rows=4, num_samples=40, read_threads=1, prefetch_buffer_size=1)


def run(directory, steps):
    return train(TinyConfig(), DATA, LossConfig(), OptimConfig(lr=1e-2, min_lr=1e-3, decay_steps=6),
                 ParallelConfig(data=1), CheckpointConfig(directory=str(directory), save_every=100, async_save=False),
                 TrainConfig(steps=steps, progress_bar=False))


def records(result):
    return [(h["step"], h["loss"], h["grad_norm"], h["loss_tokens"], h["data_fingerprint"]) for h in result.history]


@pytest.mark.slow  # three short runs of the stand-in model (~15 s)
def test_resume_mid_epoch_equals_an_uninterrupted_run(tmp_path):
    straight = run(tmp_path / "straight", 6)
    first = run(tmp_path / "stopped", 3)
    second = run(tmp_path / "stopped", 6)
    assert second.start_step == 3
    assert records(first) + records(second) == records(straight)
    assert len({r[-1] for r in records(straight)}) == 6             # six different batches, well inside one epoch
    assert min(r[3] for r in records(straight)) < 4 * 32            # padded rows: fewer loss tokens than slots
