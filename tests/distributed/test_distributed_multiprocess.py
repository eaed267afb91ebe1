"""Two JAX processes on 127.0.0.1 (4 fake CPU devices each) train exactly like one process with 8.

Each process runs tests/distributed/mp_worker.py (-> `experiment.run`) with the coordinator on a free local
port; the reference is the same worker as one process. Equality is per step (rel <= 1e-6) on the losses
process 0 wrote to metrics.jsonl: the global batch, the sharded step and the reductions are the same for
any process count.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import xla_flags

WORKER = Path(__file__).with_name("mp_worker.py")
TINY = ["data.seq_length=64", "data.global_batch_size=8", "parallel=data", "logger=none",
        "train.progress_bar=false", "train.log_every=1", "checkpoint.save_every=100", "train.eval_every=0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(num_processes: int, devices: int, run_dir: Path, overrides: list[str], cache: Path) -> list[subprocess.Popen]:
    """Start `num_processes` workers on `run_dir` (not waited for)."""
    port = free_port()
    procs = []
    for pid in range(num_processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices),
                   PYTHONUNBUFFERED="1")
        for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            env.pop(key, None)
        if num_processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes),
                       JAX_PROCESS_ID=str(pid))
        out = run_dir.parent / f"{run_dir.name}.process{pid}.json"
        log = open(run_dir.parent / f"{run_dir.name}.process{pid}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(run_dir), str(out), *TINY,
                                       f"data.cache_dir={cache}", *overrides], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def finish(procs: list[subprocess.Popen], run_dir: Path, timeout: float = 1500) -> list[dict]:
    """Wait for the workers; their OUT_JSON records (asserting every one succeeded)."""
    for pid, proc in enumerate(procs):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        log = (run_dir.parent / f"{run_dir.name}.process{pid}.log").read_text()
        assert proc.returncode == 0, f"process {pid} of {run_dir.name} failed:\n{log[-4000:]}"
    return [json.loads((run_dir.parent / f"{run_dir.name}.process{pid}.json").read_text())
            for pid in range(len(procs))]


def losses(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_losses(ours: list[dict], reference: list[dict], steps: list[int], keys=("loss", "lm_loss")) -> None:
    assert [r["step"] for r in ours] == steps, [r["step"] for r in ours]
    by_step = {r["step"]: r for r in reference}
    for record in ours:
        for key in keys:
            ref = by_step[record["step"]][key]
            assert abs(record[key] - ref) <= 1e-6 * abs(ref), (record["step"], key, record[key], ref)


def check_processes(records: list[dict], count: int, local_devices: int) -> None:
    assert sorted(r["process_index"] for r in records) == list(range(count))
    assert all(r["process_count"] == count and r["local_devices"] == local_devices for r in records)


def run_both(tmp_path: Path, overrides: list[str], steps: int) -> tuple[Path, Path, list[dict]]:
    """(2-process run dir, 1-process run dir, the 2 processes' records), both runs in parallel."""
    cache = tmp_path / "cache"
    two, one = tmp_path / "two", tmp_path / "one"
    xla_cache = tmp_path / "xla_cache"
    procs = launch(2, 4, two, [*overrides, f"train.steps={steps}", f"distributed.compilation_cache_dir={xla_cache}",
                               "distributed.compilation_cache_min_compile_s=0", "distributed.initialization_timeout_s=600"],
                   cache)
    reference = launch(1, 8, one, [*overrides, f"train.steps={steps}"], cache)
    records = finish(procs, two)
    check_processes(finish(reference, one), 1, 8)
    check_processes(records, 2, 4)
    assert any(xla_cache.iterdir()), "the persistent compilation cache stayed empty"
    return two, one, records


@pytest.mark.slow  # three run.py processes (~70 s of CPU); the default suite checks the runtime's config paths
def test_two_processes_train_like_one(tmp_path):
    small = ["model.num_layers=2", "train.eval_test=false"]  # a dense and an MoE layer; the slow test evaluates
    two, one, _ = run_both(tmp_path, small, steps=2)
    assert_same_losses(losses(two), losses(one), [1, 2])  # one line per step: process 0 alone writes
    assert json.loads((two / "summary.json").read_text())["steps"] == 2
    assert (two / "checkpoints" / "2").is_dir()  # the final save, written by both processes


@pytest.mark.slow
def test_two_processes_fsdp_tensor_train_and_evaluate_like_one(tmp_path):
    evaluation = ["train.eval_every=1", "train.eval_batches=1", "train.eval_test=false"]
    two, one, _ = run_both(tmp_path, ["parallel=fsdp_tensor", "checkpoint.enabled=false", *evaluation], steps=2)
    assert_same_losses(losses(two), losses(one), [1, 2], keys=("loss", "lm_loss", "val_lm_loss"))


@pytest.mark.slow
def test_two_process_checkpoint_restores_in_two_and_in_one_process(tmp_path):
    """Steps 1-2 in 2 processes with every parameter split over both (fsdp=8), saved by both; resumed for
    steps 3-4 in 2 processes and in 1 process with 8 devices as data 2 x fsdp 4 (Orbax reshards each
    parameter from 8 shards to 4 on restore): both equal an uninterrupted 4-step run."""
    schedule = ["optim.warmup_steps=1", "optim.decay_steps=4"]  # the same schedule for 2- and 4-step runs
    fsdp = ["parallel.data=1", "parallel.fsdp=-1", *schedule]
    cache = tmp_path / "cache"
    first = launch(2, 4, tmp_path / "two", [*fsdp, "train.steps=2"], cache)
    full = launch(1, 8, tmp_path / "full", [*fsdp, "train.steps=4"], cache)
    check_processes(finish(first, tmp_path / "two"), 2, 4)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    shutil.copytree(tmp_path / "two", tmp_path / "one_resumed")
    for run in ("two", "one_resumed"):
        (tmp_path / run / "metrics.jsonl").unlink()
    resumed_two = launch(2, 4, tmp_path / "two", [*fsdp, "train.steps=4"], cache)
    resumed_one = launch(1, 8, tmp_path / "one_resumed", ["parallel.data=2", "parallel.fsdp=-1", *schedule,
                                                          "train.steps=4"], cache)
    check_processes(finish(resumed_two, tmp_path / "two"), 2, 4)
    check_processes(finish(resumed_one, tmp_path / "one_resumed"), 1, 8)
    finish(full, tmp_path / "full")
    reference = losses(tmp_path / "full")
    assert_same_losses(losses(tmp_path / "two"), reference, [3, 4])
    assert_same_losses(losses(tmp_path / "one_resumed"), reference, [3, 4])
