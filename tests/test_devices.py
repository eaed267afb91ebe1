"""Fake CPU devices from the config (`parallel.cpu_devices`) and the mesh checked against the device count."""
import pytest

from lingpack import devices
from lingpack.errors import ConfigError
from lingpack.train.configs import ParallelConfig


def test_mesh_that_does_not_fit_names_the_exact_fix(monkeypatch):
    # pytest runs with 8 CPU devices, set through XLA_FLAGS (tests/conftest.py)
    with pytest.raises(ConfigError, match=r"mesh data=1 x fsdp=1 x tensor=16 x expert=1 x context=1 needs 16 devices, "
                                          r"but this run has 8 cpu devices; XLA_FLAGS sets "
                                          r"--xla_force_host_platform_device_count=8: raise it to 16 \(or drop it and "
                                          r"set parallel.cpu_devices=16\)"):
        devices.check_mesh(ParallelConfig(data=1, tensor=16))
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")  # as a user's shell: no device count
    with pytest.raises(ConfigError, match=r"needs a multiple of 3 devices, but this run has 8 cpu devices; set "
                                          r"parallel.cpu_devices=3 \(fake CPU devices\), or make the other axes' "
                                          r"product divide 8"):
        devices.check_mesh(ParallelConfig(data=-1, context=3))
    devices.check_mesh(ParallelConfig(data=-1, tensor=2))   # fits: 4 x 2
    devices.check_mesh(ParallelConfig(data=1, tensor=2))    # fewer than all: an explicit sub-mesh


def test_request_reads_and_writes_xla_flags(monkeypatch):
    monkeypatch.setattr(devices, "backends_started", lambda: False)
    environ = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}
    line = devices.request_cpu_devices(4, environ)
    assert environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4"
    assert line == "parallel.cpu_devices=4: 4 fake CPU devices on this host (XLA_FLAGS " \
                   "--xla_force_host_platform_device_count=4)"
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}   # a launcher's choice for this process
    line = devices.request_cpu_devices(4, environ)
    assert "not applied: XLA_FLAGS sets --xla_force_host_platform_device_count=2" in line
    assert environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert devices.request_cpu_devices(None, environ) is None


def test_request_after_jax_started():
    assert devices.request_cpu_devices(8) is None   # already what this process has
    with pytest.raises(ConfigError, match="parallel.cpu_devices=4, but JAX already runs in this process with 8 CPU"):
        devices.request_cpu_devices(4)
