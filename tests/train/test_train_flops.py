"""The CPU MFU ceiling: a matmul throughput measured once per process, shared by the fake CPU devices."""
import jax

from lingpack.train import flops


def test_cpu_peak_is_the_measured_matmul_ceiling_per_device():
    measured = flops.measured_matmul_flops()
    assert measured > 1e8 and flops.measured_matmul_flops() == measured  # measured once, then cached
    assert jax.devices()[0].platform == "cpu"
    n = len(jax.local_devices(backend="cpu"))
    assert n == 8 and flops.peak_flops_per_device() == measured / n  # conftest's 8 fake devices share the cores
