"""The devices a run gets: fake CPU devices from the config, and the mesh checked against the device count.

`parallel.cpu_devices=N` gives this process N CPU devices (XLA's `--xla_force_host_platform_device_count`):
a mesh of several devices on one CPU host, for context parallelism or sharding on a laptop. The flag is read
when JAX starts its backends, so `request_cpu_devices` runs before anything touches a device (experiment.py
calls it first). A count already in `XLA_FLAGS` is left as it is (a launcher or a test set it for this
process) and the line says so. The count is per process; accelerators ignore it.

`check_mesh(parallel_cfg)` runs once JAX is up: a mesh that does not fit the devices is a `ConfigError`
naming the axes, the device count and, on CPU, the exact key to set.
"""

from __future__ import annotations

import math
import os
import re

from lingpack.errors import ConfigError

FLAG = "--xla_force_host_platform_device_count"


def flag_count(xla_flags: str) -> int | None:
    """The host device count set in an XLA_FLAGS string, or None."""
    found = re.findall(rf"{FLAG}=(\d+)", xla_flags)
    return int(found[-1]) if found else None  # XLA reads the last occurrence


def backends_started() -> bool:
    """Whether JAX has started its backends in this process (device counts are fixed from then on)."""
    import sys
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public query; lingpack.distributed asks the same
    return xla_bridge.backends_are_initialized()


def request_cpu_devices(count: int | None, environ=None) -> str | None:
    """Ask XLA for `count` CPU devices before JAX starts; returns the line to log once (None: nothing asked).

    Raises ConfigError when JAX already runs in this process with another CPU device count (e.g. the second
    job of an in-process sweep): the count cannot change without a new process.
    """
    if count is None:
        return None
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    given = flag_count(flags)
    if backends_started():
        import jax
        have = len(jax.local_devices(backend="cpu"))
        if have != count:
            raise ConfigError(f"parallel.cpu_devices={count}, but JAX already runs in this process with {have} CPU "
                              "devices and cannot change them; start a new process (a multirun's jobs share one: "
                              "give them the same parallel.cpu_devices)")
        return None
    if given is not None:
        if given == count:
            return f"parallel.cpu_devices={count}: {count} CPU devices (XLA_FLAGS already asks for them)"
        return (f"parallel.cpu_devices={count} not applied: XLA_FLAGS sets {FLAG}={given}, so this process "
                f"has {given} CPU devices (drop it from XLA_FLAGS to use the config's)")
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={count}".strip()
    return f"parallel.cpu_devices={count}: {count} fake CPU devices on this host (XLA_FLAGS {FLAG}={count})"


def settled(line: str | None, count: int | None) -> str | None:
    """The request's line once JAX runs: on accelerators the CPU device count goes unused, and it says so."""
    if count is None:
        return line
    import jax
    platform = jax.devices()[0].platform
    return line if platform == "cpu" else f"parallel.cpu_devices={count} unused: this run's devices are {platform}"


def needed_devices(sizes: dict[str, int]) -> tuple[int, bool]:
    """(devices the fixed axes multiply to, whether an axis is -1 and takes any multiple of them)."""
    fixed = math.prod(v for v in sizes.values() if v != -1)
    return fixed, any(v == -1 for v in sizes.values())


def check_mesh(parallel_cfg) -> None:
    """ConfigError unless the mesh axes fit the devices JAX sees (all processes together)."""
    import jax
    sizes = parallel_cfg.axis_sizes()
    fixed, has_rest = needed_devices(sizes)
    devices, processes = jax.device_count(), jax.process_count()
    fits = devices % fixed == 0 if has_rest else fixed <= devices  # fewer than all: an explicit sub-mesh
    if fits:
        return
    axes = " x ".join(f"{k}={v}" for k, v in sizes.items())
    want = f"a multiple of {fixed}" if has_rest else str(fixed)
    platform = jax.devices()[0].platform
    here = f"{devices} {platform} device{'s' if devices != 1 else ''}"
    if processes > 1:
        here += f" over {processes} processes"
    fix = (f"make the other axes' product divide {devices}" if has_rest else
           f"set one axis to -1 ('the rest') or make the axes multiply to {devices}")
    if platform == "cpu":
        per_process = max(1, math.ceil(fixed / processes))
        given = flag_count(os.environ.get("XLA_FLAGS", ""))
        if given is not None and given != parallel_cfg.cpu_devices:  # XLA_FLAGS' own count, not the config's
            fix = (f"XLA_FLAGS sets {FLAG}={given}: raise it to {per_process} (or drop it and set "
                   f"parallel.cpu_devices={per_process}), or {fix}")
        else:
            fix = f"set parallel.cpu_devices={per_process} (fake CPU devices), or {fix}"
    raise ConfigError(f"parallel: the mesh {axes} needs {want} devices, but this run has {here}; {fix}")
