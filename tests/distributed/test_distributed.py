"""distributed.py without a second process: launch detection, half-configured errors, the coordinator probe,
per-process rows of the data pipeline; and an unreachable coordinator through run.py."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.subprocess_env import xla_flags
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack import config as config_lib
from lingpack import distributed as dist
from lingpack.distributed import DistributedConfig, DistributedError

ROOT = Path(__file__).resolve().parents[2]
FULL = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_single_process_unless_the_launch_says_otherwise():
    assert dist.plan(DistributedConfig(), {}) is None
    assert dist.plan(DistributedConfig(), {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert dist.plan(DistributedConfig(initialize=False), FULL) is None
    assert dist.plan(DistributedConfig(), dict(FULL, JAX_NUM_PROCESSES="1", JAX_PROCESS_ID="0")) is None


def test_explicit_environment_and_config():
    assert dist.plan(DistributedConfig(), FULL) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                                                    "process_id": 2}
    cfg = DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=1)
    assert dist.plan(cfg, FULL) == {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}


def test_cluster_environments_leave_the_details_to_jax():
    slurm = {"SLURM_NTASKS": "16", "SLURM_PROCID": "3", "SLURM_STEP_NODELIST": "node[01-02]"}
    assert dist.plan(DistributedConfig(), slurm) == {"coordinator_address": None, "num_processes": None,
                                                     "process_id": None}
    assert dist.plan(DistributedConfig(), {"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}) is not None
    assert dist.plan(DistributedConfig(initialize=True), {}) is not None  # GCE TPU pods: JAX asks the metadata server


@pytest.mark.parametrize("env, missing", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1"}, "num_processes, process_id missing"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "coordinator_address missing"),
])
def test_half_configured_names_what_is_missing(env, missing):
    with pytest.raises(DistributedError, match=missing):
        dist.plan(DistributedConfig(), env)


def test_bad_process_id_and_sbatch_without_srun():
    with pytest.raises(DistributedError, match=r"process_id=4 is not in \[0, num_processes=4\)"):
        dist.plan(DistributedConfig(), dict(FULL, JAX_PROCESS_ID="4"))
    with pytest.raises(DistributedError, match="launch with `srun python run.py"):
        dist.plan(DistributedConfig(), {"SLURM_NTASKS": "8", "SLURM_PROCID": "0"})


def test_config_group_validates():
    rc = config_lib.build({"distributed": {"initialize": True, "compilation_cache_dir": "/tmp/x"}, "logger": {"kind": "none"},
                           "data": {"source": "synthetic"}}, "/tmp/run")
    assert rc.distributed.initialize is True and rc.distributed.compilation_cache_dir == "/tmp/x"
    with pytest.raises(config_lib.ConfigError, match="distributed.initialize='maybe' must be auto, true or false"):
        config_lib.build({"distributed": {"initialize": "maybe"}, "data": {"source": "synthetic"}}, "/tmp/run")


def test_wait_for_coordinator_is_bounded_and_clear():
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(DistributedError, match=f"process 1 could not reach the coordinator at 127.0.0.1:{port} "
                                               "within 1 s"):
        dist.wait_for_coordinator(f"127.0.0.1:{port}", 1, process_id=1)
    assert time.monotonic() - start < 30
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        dist.wait_for_coordinator(f"127.0.0.1:{server.getsockname()[1]}", 1, process_id=1)


def test_process_rows_of_a_single_process_are_all_rows():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    assert dist.process_rows(NamedSharding(mesh, P("data")), 8) == tuple(range(8))
    local = {"inputs": np.arange(16, dtype=np.int32).reshape(8, 2)}
    batch = dist.global_batch(local, NamedSharding(mesh, P("data")), 8)
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), local["inputs"])


@pytest.mark.parametrize("data, context", [(1, 8), (2, 4)])
def test_process_rows_of_a_context_sharded_batch(data, context):
    """Rows split over the context axis (tokens over devices): the row axis alone decides the rows read."""
    from lingpack.train import sharding as shard_lib
    from lingpack.train.configs import ParallelConfig
    parallel = ParallelConfig(data=data, context=context)
    sharding = shard_lib.batch_sharding(shard_lib.make_mesh(parallel), parallel.rules)
    assert sharding.spec == P("data" if data > 1 else None, "context")
    assert dist.process_rows(sharding, 8) == tuple(range(8))
    local = {"inputs": np.arange(8 * 16, dtype=np.int32).reshape(8, 16)}
    batch = dist.global_batch(local, sharding, 8)
    assert batch["inputs"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), local["inputs"])


def test_pipeline_reads_exactly_the_given_rows(tmp_path):
    from lingpack.data.config import DataConfig
    from lingpack.data.pipeline import make_dataset
    cfg = DataConfig(source="synthetic", seq_length=16, global_batch_size=8, synthetic_num_documents=200,
                     vocab_size=64, eod_id=63)
    full = make_dataset(cfg, process_index=0, process_count=1)
    for rows in [(2, 3), (1, 5, 6)]:
        host = make_dataset(cfg, rows=rows)
        for batch in range(2):
            for key, value in host[batch].items():
                np.testing.assert_array_equal(value, full[batch][key][list(rows)], err_msg=f"{rows} {key}")
    with pytest.raises(ValueError, match=r"must be a non-empty subset of the global batch's rows \[0, 8\)"):
        make_dataset(cfg, rows=(7, 8))


def test_run_py_unreachable_coordinator_exits_with_one_line(tmp_path):
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1),
               PYTHONPATH=str(ROOT / "src"))  # this checkout's lingpack, whatever the venv has installed
    args = [sys.executable, str(ROOT / "run.py"), f"distributed.coordinator_address=127.0.0.1:{port}",
            "distributed.num_processes=2", "distributed.process_id=1", "distributed.initialization_timeout_s=2",
            "logger=none", "data=synthetic", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"run.py: process 1 could not reach the coordinator at 127.0.0.1:{port} within 2 s")


def test_coordinator_alone_exits_with_one_line_in_bounded_time(tmp_path):
    """Process 0 of 2 when process 1 never comes: one line and status 1 after the timeout, not XLA's abort."""
    port = free_port()
    code = ("from lingpack import distributed as d; d.initialize(d.DistributedConfig(coordinator_address="
            f"'127.0.0.1:{port}', num_processes=2, process_id=0, initialization_timeout_s=2))")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert f"lingpack: process 0 of 2 joining the coordinator at 127.0.0.1:{port}; waiting up to 2 s for every " \
        "process" in lines, lines
    assert lines[-1].startswith(f"lingpack: process 0 of 2: not all 2 processes joined the coordinator at "
                                f"127.0.0.1:{port} within 2 s;"), lines
    assert "Check failure" not in proc.stderr and "DEADLINE_EXCEEDED" not in proc.stderr


def test_initialize_is_idempotent_per_process(monkeypatch):
    """Every Hydra job of a sweep calls initialize again: same plan = no-op, a different one = error."""
    started = {"coordinator_address": "h:1", "num_processes": 2, "process_id": 0}
    monkeypatch.setattr(dist, "_STARTED", started)
    assert dist.initialize(DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=0), {}) is True
    with pytest.raises(DistributedError, match="already started"):
        dist.initialize(DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=1), {})
    monkeypatch.setattr(dist, "_STARTED", None)
    assert dist.initialize(DistributedConfig(), {}) is False  # single process: nothing to start
