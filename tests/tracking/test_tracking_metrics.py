"""metrics.jsonl round trip, CSV export, the fan-out logger, summary_table, and the offline W&B run."""

import io
import json
import math
import struct
import time

import jax.numpy as jnp
import numpy as np
import pytest

from lingpack.tracking.metrics import MetricsLogger, read_metrics, to_record, write_csv
from lingpack.tracking.table import summary_table
from lingpack.tracking.wandb_logger import WandbLogger


def test_to_record_converts_numpy_and_jax_scalars():
    record = to_record(np.int64(3), {"lm_loss": jnp.float32(2.5), "tokens": np.int32(4096),
                                     "lr": np.float64(1e-4), "grad_norm": jnp.array([1.5]),
                                     "finite": np.bool_(True), "nan": float("nan")})
    assert record["step"] == 3 and type(record["step"]) is int
    assert record["lm_loss"] == 2.5 and type(record["lm_loss"]) is float
    assert record["tokens"] == 4096 and type(record["tokens"]) is int
    assert type(record["lr"]) is float and record["grad_norm"] == 1.5 and record["finite"] == 1
    with pytest.raises(TypeError, match=r"'logits' has shape \(2, 3\)"):
        to_record(1, {"logits": np.zeros((2, 3))})
    with pytest.raises(TypeError, match="'name'"):
        to_record(1, {"name": "abc"})


def test_jsonl_round_trip_and_csv(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(tmp_path, console_every=2, stream=stream, main_process=True)
    for step in range(1, 5):
        logger(step, {"lm_loss": jnp.float32(10.0 / step), "tokens": 1024 * step})
    logger.log(5, {"lm_loss": float("nan"), "tokens": 5120, "grad_norm": np.float32(0.5)})
    logger.summary({"final_lm_loss": 2.5})
    csv_path = logger.export_csv()
    logger.finish()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[1] == {"step": 2, "lm_loss": 5.0, "tokens": 2048}
    assert math.isnan(records[4]["lm_loss"]) and records[4]["grad_norm"] == 0.5
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]  # the file itself
    lines = stream.getvalue().splitlines()
    assert lines == ["step 2 | lm_loss 5.0000 | tokens 2048", "step 4 | lm_loss 2.5000 | tokens 4096"]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final_lm_loss": 2.5}
    csv_lines = open(csv_path).read().splitlines()
    assert csv_lines[0] == "step,lm_loss,tokens,grad_norm" and csv_lines[1] == "1,10.0,1024,"
    assert csv_lines[5].startswith("5,nan,5120,0.5")
    assert write_csv(records, tmp_path / "sub" / "x.csv", columns=["step", "tokens"])


def test_read_metrics_errors_name_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path)
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "lm_loss": 2.0}\n{"step": 2, "lm_lo')  # killed mid-write
    assert read_metrics(tmp_path) == [{"step": 1, "lm_loss": 2.0}]
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON object"):
        read_metrics(tmp_path)
    path.write_text('{"loss": 1}\n')
    with pytest.raises(ValueError, match="'step' key"):
        read_metrics(tmp_path)


def test_resume_drops_records_past_the_restored_step(tmp_path):
    """A try killed after logging steps 1-5 (checkpoint at 3): the rerun keeps 1-3, then logs 4-5 once."""
    first = MetricsLogger(tmp_path, console_every=0, main_process=True)
    for step in range(1, 6):
        first(step, {"lm_loss": 1.0})
    first.finish()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "lm_lo')  # killed mid-write
    stream = io.StringIO()
    second = MetricsLogger(tmp_path, console_every=0, stream=stream, main_process=True)
    second.resume(3)
    for step in (4, 5):
        second(step, {"lm_loss": 2.0})
    assert [(r["step"], r["lm_loss"]) for r in second.records()] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]
    assert "dropped 2 records past step 3" in stream.getvalue()
    second.resume(0)  # a fresh start in the same directory (no checkpoint): nothing of the old run stays
    assert second.records() == []
    second.finish()
    assert MetricsLogger(tmp_path, main_process=False).records() == []


def test_persistent_wandb_run_id(tmp_path):
    from lingpack.tracking.wandb_logger import persistent_run_id
    run_id = persistent_run_id(tmp_path / "run")
    assert persistent_run_id(tmp_path / "run") == run_id and len(run_id) == 8
    assert persistent_run_id(tmp_path / "other") != run_id


def test_non_main_process_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "rank1", main_process=False)
    logger(1, {"lm_loss": 1.0})
    logger.finish()
    assert not (tmp_path / "rank1" / "metrics.jsonl").exists()


def test_summary_table():
    text = summary_table([{"name": "tiny", "loss": 2.34567, "steps": 100},
                          {"name": "small-long", "loss": 1e-5}], ["name", "loss", "steps"], title="runs")
    assert text.splitlines() == [
        "runs",
        "name        loss       steps",
        "----------  ---------  -----",
        "tiny           2.3457    100",
        "small-long  1.000e-05      -",
    ]
    assert summary_table([(1, 2.0)], ["a", "b"], formats={"b": ".2f"}).splitlines()[-1] == "1  2.00"
    assert "(no rows)" in summary_table([], ["a"])
    with pytest.raises(ValueError, match="2 columns"):
        summary_table([(1, 2, 3)], ["a", "b"])


def _read_wandb_records(path):
    """Decode a `.wandb` transaction log (LevelDB-style 32 KiB blocks of protobuf `Record`s)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:16]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wait_for_exit_record(path, timeout_s=30.0):
    """wandb-core flushes the offline transaction log asynchronously after `finish()` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _read_wandb_records(path) if path.stat().st_size > 7 else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _key(item):
    return item.key or "/".join(item.nested_key)  # wandb-core writes either form


def test_wandb_offline_run_holds_logged_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"model": {"name": "ling3_tiny", "layers": 2}, "seed": 0}
    wandb = WandbLogger(project="lingpack-test", group="g1", job_type="train", name="tiny",
                        tags=["ci"], dir=tmp_path, mode="offline", config=config, main_process=True)
    with MetricsLogger(tmp_path / "run", wandb=wandb, console_every=0, main_process=True) as logger:
        for step in (1, 2, 3):
            logger(step, {"lm_loss": 10.0 - step, "tokens": 4096 * step, "lr": 3e-4})
        logger.summary({"final_lm_loss": 7.0})
    assert wandb.run is None  # finished by the MetricsLogger
    files = list(wandb.local_dir.glob("run-*.wandb"))
    assert wandb.local_dir.name.startswith("offline-run-") and len(files) == 1
    records = _wait_for_exit_record(files[0])
    history = [{_key(i): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["step"], h["lm_loss"], h["tokens"]) for h in history] == [(1, 9, 4096), (2, 8, 8192),
                                                                          (3, 7, 12288)]
    metrics = {r.metric.name: r.metric.step_metric for r in records if r.WhichOneof("record_type") == "metric"}
    assert metrics["lm_loss"] == "tokens" and metrics["lr"] == "tokens"
    summary = {_key(i) for r in records if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    assert "final_lm_loss" in summary
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_group, run.job_type, list(run.tags)) == ("g1", "train", ["ci"])
    assert "ling3_tiny" in str(run.config)


def test_wandb_disabled_and_bad_mode(tmp_path):
    logger = WandbLogger(mode="disabled", dir=tmp_path / "never")
    logger.log(1, {"lm_loss": 1.0})
    logger.summary({"x": 1})
    logger.finish()
    assert not logger.active and not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match="wandb mode 'offlne'"):
        WandbLogger(mode="offlne")
