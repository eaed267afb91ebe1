"""Validation like Megatron-LM: its split sizes and samples, its token-weighted eval reduction, resume-exact."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))

from train_helpers import TinyConfig, synthetic_batch, tiny_model_def, to_jnp

from lingpack.data.config import DataConfig
from lingpack.train import loss as loss_lib
from lingpack.train.configs import LossConfig, TrainConfig
from lingpack.train.step import split_model
from lingpack.train.evaluate import eval_dataset, eval_metrics, make_eval_step, megatron_line, split_sample_counts
from tests.optional import require


def test_split_sizes_follow_megatron():
    # Megatron: valid = (train_iters // eval_interval + 1) * eval_iters * gbs; test = eval_iters * gbs.
    cfg = TrainConfig(steps=50, eval_every=20, eval_batches=3)
    assert split_sample_counts(cfg, 8) == {"valid": 3 * 3 * 8, "test": 3 * 8}
    assert split_sample_counts(dataclasses.replace(cfg, steps=40), 4)["valid"] == 3 * 3 * 4  # 40//20 + 1


def test_valid_and_test_batches_are_megatron_samples(tmp_path, monkeypatch):
    require("megatron.core.datasets.gpt_dataset")
    import torch.distributed
    from data_helpers import EOD, PAD, VOCAB, assert_matches_megatron, megatron_datasets, write_corpus

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)  # BlendedDataset's cache writer asks
    a = write_corpus(tmp_path, "a", seed=0, num_documents=300)
    b = write_corpus(tmp_path, "b", seed=1, num_documents=120)
    seq, gbs = 64, 4
    train_cfg = TrainConfig(steps=30, eval_every=10, eval_batches=2)
    counts = split_sample_counts(train_cfg, gbs)
    data_cfg = DataConfig(paths=("0.4", a, "0.6", b), split="80,15,5", seq_length=seq, global_batch_size=gbs,
                          seed=3, num_samples=30 * gbs, eod_id=EOD, pad_id=PAD, vocab_size=VOCAB,
                          eod_mask_loss=True)
    _, valid, test = megatron_datasets(([a, b], [0.4, 0.6]), split="80,15,5", seq_length=seq, seed=3,
                                       sizes=[30 * gbs, counts["valid"], counts["test"]], cache_dir=None,
                                       eod_mask_loss=True, reset_attention_mask=True, reset_position_ids=True)
    for split, theirs in (("valid", valid), ("test", test)):
        ours = eval_dataset(data_cfg, train_cfg, split)
        assert counts[split] <= len(ours) * gbs <= len(theirs)  # a blend rounds each dataset's share up
        for batch_index in range(len(ours)):
            batch = ours[batch_index]
            for row in range(gbs):
                assert_matches_megatron({k: v[row] for k, v in batch.items()}, theirs[batch_index * gbs + row],
                                        f"{split} batch {batch_index} row {row}")


def test_empty_valid_split_names_the_fix():
    data_cfg = DataConfig(source="synthetic", split="1,0,0", seq_length=32, global_batch_size=2)
    with pytest.raises(ValueError, match=r"valid split of data.split='1,0,0'.*train.eval_every=0"):
        eval_dataset(data_cfg, TrainConfig(steps=4, eval_every=2), "valid")


@pytest.mark.parametrize("loss_cfg", [LossConfig(), LossConfig(calculate_per_token_loss=True),
                                      LossConfig(mode="per_token")], ids=["megatron", "per_token_loss", "per_token"])
def test_eval_loss_is_token_weighted_over_everything(loss_cfg):
    # Megatron's evaluate sums (loss sum, token count) over micro-batches and iterations before dividing.
    model_def, make = tiny_model_def()
    model = make()
    params, rest = split_model(model)
    batches = [to_jnp(synthetic_batch(rows=4, seed=s, mean_length=6.0 + 10 * s)) for s in range(2)]
    for b in batches:  # uneven loss masks so that token weighting and a mean of means differ
        b["targets_segmentation"] = b["targets_segmentation"].at[0, 5:].set(0)
    step = make_eval_step(model_def, loss_cfg, micro_batches=2)
    total = jax.tree.map(jnp.add, *[step(params, rest, b) for b in batches])
    got = eval_metrics(jax.device_get(total), "val")

    sums, counts = [], []  # by hand: per-token cross-entropy of each micro-batch, plain sums
    for b in batches:
        for half in (slice(0, 2), slice(2, 4)):
            mb = {k: v[half] for k, v in b.items()}
            out = model(mb["inputs"], mb["inputs_segmentation"], mb["inputs_position"])
            xent, _ = loss_lib.token_xent(out.logits_BTV, mb["targets"])
            mask = np.asarray(mb["targets_segmentation"] != 0, np.float64)
            sums.append(float(np.sum(np.asarray(xent, np.float64) * mask)))
            counts.append(float(mask.sum()))
    expected = sum(sums) / sum(counts)
    mean_of_means = float(np.mean(np.array(sums) / np.array(counts)))
    assert abs(expected - mean_of_means) > 1e-3  # the test can tell the two reductions apart
    np.testing.assert_allclose(got["val_lm_loss"], expected, rtol=1e-6)
    assert got["val_tokens"] == sum(counts)
    assert got["val_ppl"] == pytest.approx(math.exp(got["val_lm_loss"]), rel=1e-12)
    assert "val_mtp_loss" in got and "val_moe_z_loss" in got  # auxiliary losses reported apart


def test_ppl_capped_and_megatron_line():
    stats = {"lm_sum": np.float32(50.0), "lm_tokens": np.float32(2.0), "mtp_sum": np.zeros(0),
             "mtp_tokens": np.zeros(0), "moe_z_sum": np.zeros(0), "moe_z_tokens": np.zeros(0)}
    got = eval_metrics(stats, "val")
    assert got["val_lm_loss"] == 25.0 and got["val_ppl"] == math.exp(20.0)  # Megatron: exp(min(20, loss))
    line = megatron_line("iteration 20", got)
    assert line == " validation loss at iteration 20 | lm loss value: 2.500000E+01 | lm loss PPL: 4.851652E+08 | "


def test_resumed_run_evaluates_the_same_batches_at_the_same_steps(tmp_path):
    import os
    import signal

    from lingpack.train import loop as loop_lib
    from lingpack.train.configs import CheckpointConfig, OptimConfig, ParallelConfig

    data = DataConfig(source="synthetic", split="90,6,4", seq_length=32, global_batch_size=8, synthetic_mean_length=12,
                      synthetic_num_documents=400, read_threads=1, prefetch_buffer_size=1)
    train = TrainConfig(steps=5, micro_batches=2, progress_bar=False, eval_every=2, eval_batches=2)

    def run(name, callback=None):
        ckpt = CheckpointConfig(directory=str(tmp_path / name), save_every=100)
        return loop_lib.train(TinyConfig(), data, LossConfig(), OptimConfig(lr=3e-2, warmup_steps=1, decay_steps=5),
                              ParallelConfig(data=2), ckpt, train, metrics_callback=callback)

    def kill_at_3(step, metrics):
        if step == 3:  # between the evaluations at 2 and 4
            os.kill(os.getpid(), signal.SIGTERM)

    straight = run("straight")
    first = run("resumed", kill_at_3)
    assert first.preempted and first.final_eval == {}  # a signal stop skips the end-of-run evaluation
    second = run("resumed")
    assert second.start_step == 3
    val = lambda history: [(h["step"], h["val_lm_loss"], h["val_tokens"]) for h in history if "val_lm_loss" in h]
    assert [s for s, _, _ in val(straight.history)] == [2, 4]
    assert val(first.history + second.history) == val(straight.history)  # bitwise: same batches, same weights
    assert second.final_eval == straight.final_eval and {"val_lm_loss", "test_lm_loss"} <= set(straight.final_eval)
    assert straight.final_eval["val_lm_loss"] != straight.history[3]["val_lm_loss"]  # the next valid batches
