"""`python run.py data.packing=whole_documents` trains: in process through run.py's config path (cheap), and as
run.py itself with context parallelism and a context schedule, resumed after a stop (slow)."""
import dataclasses
import json

import numpy as np
import pytest

from lingpack import config as config_lib
from lingpack import experiment
from lingpack.data.pipeline import make_iterator

TINY = ["data.packing=whole_documents", "data.seq_length=128", "data.global_batch_size=2", "model.num_layers=1",
        "model.mtp_num_layers=0", "train.steps=2", "train.eval_every=0", "train.eval_test=false",
        "checkpoint.enabled=false", "logger.kind=none", "train.progress_bar=false", "train.log_every=1"]


def test_run_trains_on_whole_document_rows(tmp_path):
    run_dir = str(tmp_path / "run")
    plain = config_lib.compose([*TINY, f"data.cache_dir={tmp_path / 'cache'}"], run_dir=run_dir)
    summary = experiment.run(plain, run_dir)
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert np.isfinite(summary["final_lm_loss"])
    assert summary["packing_parity_rel"] < 1e-6          # each packed row's loss equals its documents alone
    rc = config_lib.build(plain, run_dir)
    batches = make_iterator(rc.data, split="train", process_index=0, process_count=1)
    records = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    rows = [next(batches) for _ in records]
    # the run trained on the packed rows: its loss-token counts are theirs, and they are not Megatron's samples
    assert [r["loss_tokens"] for r in records] == [int((b["targets_segmentation"] != 0).sum()) for b in rows]
    samples = next(make_iterator(dataclasses.replace(rc.data, packing="samples"), split="train", process_index=0,
                                 process_count=1))
    assert not np.array_equal(samples["inputs"], rows[0]["inputs"])


@pytest.mark.slow  # four stage runs of the tiny Ling3 (~2 min of CPU)
def test_context_parallel_schedule_on_whole_documents_equals_one_device(tmp_path):
    """A context schedule (256 then 512 tokens) on whole-document rows: context=2 (zigzag) trains the same
    losses on the same rows as one device."""
    stages = "+schedule.stages=[{seq_length: 256, steps: 2}, {seq_length: 512, steps: 2, rope_theta: 50000.0}]"
    common = [*TINY, "train.steps=4", "checkpoint.enabled=true", "checkpoint.async_save=false", stages,
              "parallel.data=1", "parallel.cpu_devices=null", "model.num_layers=4", f"data.cache_dir={tmp_path}"]
    losses = {}
    for name, overrides in [("one", []), ("cp2", ["parallel=context", "parallel.context=2"])]:
        run_dir = str(tmp_path / name)
        plain = config_lib.compose([*common, *overrides, f"checkpoint.directory={run_dir}/ckpt"], run_dir=run_dir)
        summary = experiment.run(plain, run_dir)
        assert summary["status"] == "completed" and summary["last_step"] == 4
        losses[name] = [(r["step"], r["loss_tokens"], r["lm_loss"])
                        for r in map(json.loads, open(f"{run_dir}/metrics.jsonl"))]
    assert [r[:2] for r in losses["cp2"]] == [r[:2] for r in losses["one"]] and len(losses["one"]) == 4
    np.testing.assert_allclose([r[2] for r in losses["cp2"]], [r[2] for r in losses["one"]], rtol=1e-5)
