"""Multi-host runtime: one `jax.distributed` start per process, one writer, process-local rows -> global arrays.

    initialize(DistributedConfig())          # before anything touches JAX devices; idempotent
    is_writer()                              # process 0: the only process that writes logs, metrics, plots
    rows = process_rows(sharding, B)         # the rows of every global batch this process's devices hold
    batch = global_batch(local, sharding, B) # this process's numpy rows -> global jax.Arrays

When to start the distributed runtime (`DistributedConfig.initialize`):
  "auto"  an explicit coordinator (config, or JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID),
          an `srun` step with more than one task (SLURM_NTASKS > 1), or a multi-host TPU slice whose
          environment names its workers (TPU_WORKER_HOSTNAMES, MEGASCALE_COORDINATOR_ADDRESS);
  true    always (JAX then finds a GCE TPU pod's workers through the metadata server: tpu_pod.sh uses this);
  false   never (one process).
A process that is not the coordinator first waits, in Python and at most `initialization_timeout_s`, until
the coordinator's port answers, so a wrong address or a missing process 0 ends in a one-line error
(`DistributedError`) instead of XLA's abort; a process that never arrives ends every waiting process
(process 0 included) with one line and exit status 1 after the same timeout (a watchdog thread).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import socket
import sys
import threading
import time

log = logging.getLogger("lingpack.distributed")

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
_STARTED: dict | None = None  # the (address, count, id) this process joined with; None = not started
_STARTED_CFG = None  # the DistributedConfig it started with (its timeouts)
WATCHDOG_GRACE_S = 30  # XLA's own deadline comes this much after the watchdog's, so the watchdog speaks first


class DistributedError(RuntimeError):
    """A multi-host launch that cannot work: names what is missing or unreachable and the fix."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-host settings (config group `distributed`); every None falls back to the environment."""
    initialize: bool | str = "auto"        # "auto" | true | false, see the module docstring
    coordinator_address: str | None = None  # host:port of process 0's coordinator
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: int = 300     # how long every process waits for the others
    shutdown_timeout_s: int = 3600          # at exit, how long finished processes wait for process 0's writing
    compilation_cache_dir: str | None = None  # persistent XLA compilation cache (shared by runs and processes)
    compilation_cache_min_compile_s: float = 1.0  # only programs that took longer to compile are cached

    def __post_init__(self):
        if self.initialize not in ("auto", True, False):
            raise ValueError(f"distributed.initialize={self.initialize!r} must be auto, true or false")
        for key in ("initialization_timeout_s", "shutdown_timeout_s"):
            if getattr(self, key) < 1:
                raise ValueError(f"distributed.{key}={getattr(self, key)} must be >= 1")


def local_or_url(path: str) -> str:
    """An absolute local path, or a URL (gs://...) unchanged."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _explicit(cfg: DistributedConfig, environ) -> dict:
    """The coordinator / count / id given by the config or the JAX_* environment (None where unset)."""
    def pick(value, key, kind):
        if value is not None:
            return value
        raw = environ.get(key)
        return kind(raw) if raw not in (None, "") else None
    return {"coordinator_address": pick(cfg.coordinator_address, ENV_ADDRESS, str),
            "num_processes": pick(cfg.num_processes, ENV_COUNT, int),
            "process_id": pick(cfg.process_id, ENV_ID, int)}


def _cluster(environ) -> str | None:
    """The multi-process cluster this environment announces, if any."""
    if int(environ.get("SLURM_NTASKS", "1")) > 1:
        if "SLURM_STEP_NODELIST" not in environ:
            raise DistributedError(
                f"SLURM_NTASKS={environ['SLURM_NTASKS']} but this process is not an srun step, so the other "
                "tasks will never start: launch with `srun python run.py ...` (see slurm_or_tpu_launch/slurm.sbatch)")
        return "slurm"
    if "," in environ.get("TPU_WORKER_HOSTNAMES", "") or environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    return None


def plan(cfg: DistributedConfig, environ=None) -> dict | None:
    """What `initialize` would pass to `jax.distributed.initialize` (None: stay a single process).

    Raises DistributedError when the launch is half configured (some of address / count / id given).
    """
    environ = os.environ if environ is None else environ
    given = _explicit(cfg, environ)
    if cfg.initialize is False:
        return None
    cluster = _cluster(environ)
    named = [k for k, v in given.items() if v is not None]
    if named and len(named) < 3 and cluster is None and cfg.initialize == "auto":
        missing = [k for k, v in given.items() if v is None]
        raise DistributedError(
            f"multi-process launch half configured: {', '.join(f'{k}={given[k]!r}' for k in named)} given but "
            f"{', '.join(missing)} missing; set all three (distributed.coordinator_address / num_processes / "
            f"process_id, or {ENV_ADDRESS}, {ENV_COUNT}, {ENV_ID}), or none for a single process")
    if len(named) == 3:
        if not 0 <= given["process_id"] < given["num_processes"]:
            raise DistributedError(f"process_id={given['process_id']} is not in [0, num_processes="
                                   f"{given['num_processes']})")
        if given["num_processes"] == 1:
            return None
    elif cluster is None and cfg.initialize == "auto":
        return None
    return given


def _resolve(given: dict, timeout_s: int) -> dict:
    """Fill what the cluster environment knows (SLURM, TPU) the way `jax.distributed.initialize` would."""
    if None not in given.values():
        return given
    try:  # JAX's own cluster detection; private, so a layout change only skips the reachability probe
        from jax._src import clusters
        address, count, pid, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            given["coordinator_address"], given["num_processes"], given["process_id"], None, None, timeout_s)
    except Exception:  # noqa: BLE001
        return given
    return {"coordinator_address": address, "num_processes": count, "process_id": pid}


def wait_for_coordinator(address: str, timeout_s: float, process_id: int) -> None:
    """Block until `address` (host:port) accepts a TCP connection; DistributedError after `timeout_s`."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"process {process_id} could not reach the coordinator at {address} within {timeout_s:g} s "
                    f"({err.strerror or err}); check that process 0 is running and that host and port are "
                    "right and reachable (distributed.coordinator_address / JAX_COORDINATOR_ADDRESS), or raise "
                    "distributed.initialization_timeout_s") from None
            time.sleep(0.5)


def _give_up(address: str, count: int, pid: int, timeout_s: int) -> None:
    """The initialization watchdog: one line, then exit at once (the main thread is stuck inside XLA)."""
    print(f"lingpack: process {pid} of {count}: not all {count} processes joined the coordinator at {address} within "
          f"{timeout_s} s; start every process with the same coordinator address and num_processes (see the other "
          "processes' logs for one that failed), or raise distributed.initialization_timeout_s",
          file=sys.stderr, flush=True)
    os._exit(1)


def initialize(cfg: DistributedConfig | None = None, environ=None) -> bool:
    """Start `jax.distributed` once per process when the launch is multi-process; True when it is.

    Also enables the persistent compilation cache. Safe to call again (every Hydra job of a sweep does):
    later calls only check that they ask for the same processes.
    """
    global _STARTED, _STARTED_CFG
    cfg = cfg or DistributedConfig()
    import jax
    if cfg.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", local_or_url(cfg.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", cfg.compilation_cache_min_compile_s)
    wanted = plan(cfg, environ)
    if _STARTED is not None or jax.distributed.is_initialized():
        if wanted is not None and _STARTED is not None and None not in wanted.values() and wanted != _STARTED:
            raise DistributedError(f"jax.distributed already started as {_STARTED}; this job asks for {wanted}")
        return True
    if wanted is None:
        return False
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise DistributedError("JAX devices were used before the multi-process runtime started; call "
                               "lingpack.distributed.initialize() before anything touches jax.devices()")
    resolved = _resolve(wanted, cfg.initialization_timeout_s)
    address, count, pid = resolved["coordinator_address"], resolved["num_processes"], resolved["process_id"]
    if None in (address, count, pid):
        raise DistributedError(f"distributed.initialize={cfg.initialize} but no cluster was detected and not all of "
                               f"coordinator address / count / id are given ({resolved}); set them (see "
                               "distributed.* or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices of 2+ processes reduce over gloo
    started = time.monotonic()
    if address is not None and pid not in (None, 0):
        wait_for_coordinator(address, cfg.initialization_timeout_s, pid)
    remaining = max(1, math.ceil(cfg.initialization_timeout_s - (time.monotonic() - started)))
    print(f"lingpack: process {pid} of {count} joining the coordinator at {address}; waiting up to {remaining} s "
          "for every process", file=sys.stderr, flush=True)
    # XLA aborts the process (C++ check failure, no Python exception) when a process never arrives; this
    # watchdog exits first with one line. It runs because the blocked connect releases the GIL.
    watchdog = threading.Timer(remaining, _give_up, (address, count, pid, remaining))
    watchdog.daemon = True
    watchdog.start()
    try:  # shutdown_timeout: the exit barrier on process 0's side (the others wait in `wait_for_writer` first)
        jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=pid,
                                   initialization_timeout=remaining + WATCHDOG_GRACE_S,
                                   shutdown_timeout_seconds=cfg.shutdown_timeout_s)
    finally:
        watchdog.cancel()
    _STARTED, _STARTED_CFG = resolved, cfg
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def is_writer() -> bool:
    """True on the one process that writes W&B, metrics, plots, summaries (process 0)."""
    import jax
    return jax.process_index() == 0


_BARRIER_NUMBERS = itertools.count(1)  # every process passes the same barriers in the same order


def wait_for_everyone(label: str, timeout_s: int) -> None:
    """Block (at most `timeout_s`, then raise) until every process got here; a no-op in one process.

    A barrier of the coordination service, not a device collective (CPU collectives give a late peer 30 s).
    """
    import jax
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed
    name = f"lingpack-{next(_BARRIER_NUMBERS)}-{label.replace(' ', '-')}"
    jax_distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1000))


def compile_then_wait(jitted, *args) -> None:
    """Compile `jitted` for `args` (its call then hits jit's cache) and wait, at most
    `initialization_timeout_s`, until every process has; a no-op in one process.

    Compile times differ by minutes between processes on a loaded machine, and the first CPU collective
    (gloo) gives a late peer only 30 s.
    """
    import jax
    if jax.process_count() > 1:
        jitted.lower(*args).compile()
        wait_for_everyone("compiled", (_STARTED_CFG or DistributedConfig()).initialization_timeout_s)


def wait_for_writer() -> None:
    """The end of a run: every process waits here, at most `shutdown_timeout_s`, until process 0 has
    written its summary, plots and parity (JAX's own exit barrier gives up after 5 minutes)."""
    wait_for_everyone("run end", (_STARTED_CFG or DistributedConfig()).shutdown_timeout_s)


def check_same_everywhere(label: str, value: str) -> None:
    """Raise on every process when processes disagree on `value` (e.g. the run directory)."""
    import jax
    if jax.process_count() == 1:
        return
    import zlib

    import numpy as np
    from jax.experimental import multihost_utils
    digests = multihost_utils.process_allgather(np.array([zlib.crc32(value.encode())], np.uint32))
    if len(set(np.asarray(digests).ravel().tolist())) > 1:
        raise DistributedError(f"the {jax.process_count()} processes disagree on the {label} (this one: {value!r}); "
                               f"give every process the same one (the launch scripts pass hydra.run.dir)")


def process_rows(sharding, global_rows: int) -> tuple[int, ...]:
    """Rows (of `global_rows`) that this process's devices hold under `sharding` of a [B, ...] array, sorted.

    `jax.make_array_from_process_local_data` takes exactly these rows, in this order, as the local data.
    Only the row axis counts: a process holding some of a row's tokens (context axis) reads the whole row.
    """
    from jax.sharding import NamedSharding, PartitionSpec
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > 1:
        sharding = NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0]))
    indices = sharding.addressable_devices_indices_map((global_rows,)).values()
    rows = set()
    for index in indices:
        rows.update(range(*index[0].indices(global_rows)))
    return tuple(sorted(rows))


def global_batch(local: dict, sharding, global_rows: int) -> dict:
    """This process's rows (numpy, `process_rows` order) of every key -> global jax.Arrays of `global_rows`."""
    import jax
    import numpy as np
    out = {}
    for key, value in local.items():
        value = np.asarray(value)
        out[key] = jax.make_array_from_process_local_data(sharding, value, (global_rows,) + value.shape[1:])
    return out


def fetch(tree):
    """Host numpy copies of a pytree of (possibly multi-process sharded) arrays; collective when sharded."""
    import jax
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True)
                        if isinstance(x, jax.Array) and not x.is_fully_addressable else jax.device_get(x), tree)
