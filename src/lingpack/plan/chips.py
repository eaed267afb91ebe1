"""Accelerator figures the planner and the MFU estimate use: one row per chip, each figure with its public source.

    peak_flops    dense bf16 FLOP/s per chip (NVIDIA quotes "with sparsity": dense is half of that)
    hbm_bytes     HBM capacity per chip (bytes; the vendor's unit: GB = 1e9, GiB = 2**30)
    hbm_bw        HBM bandwidth per chip (bytes/s)
    link_bw       chip-to-chip bandwidth per chip, bidirectional (bytes/s): TPU ICI, NVIDIA NVLink
    platform      what `lingpack.backend.target` traces for it ("tpu" or "gpu")
    links         ICI links per chip (TPU: 2 per torus dimension, so 4 on a 2D torus, 6 on v5p's 3D one)
    cycle_hz      XLA:TPU's cost-model cycles per second: the `estimated_cycles` it writes for a [8192, 8192]
                  bf16 matmul (libtpu 0.0.42.1) times the chip's peak over that matmul's FLOPs, so a cycle count
                  converts to seconds at the rate that puts XLA's own matmul estimate at the datasheet peak

Sources (vendor pages, read 2025):
  v5e   Google Cloud, cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16; HBM2 16 GB, 819 GBps; ICI 400 GBps
        bidirectional per chip
  v5p   Google Cloud, cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16; HBM2e 95 GiB, 2765 GBps; ICI 1200 GBps
        bidirectional per chip
  v6e   Google Cloud, cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16; HBM 32 GB, 1638 GBps; ICI 800 GBps
        bidirectional per chip
  h100  NVIDIA, nvidia.com/en-us/data-center/h100/ (H100 SXM): 1,979 TFLOPS bf16 with sparsity; HBM3 80 GB,
        3.35 TB/s; NVLink 900 GB/s
  h200  NVIDIA, nvidia.com/en-us/data-center/h200/ (H200 SXM): 1,979 TFLOPS bf16 with sparsity; HBM3e 141 GB,
        4.8 TB/s; NVLink 900 GB/s
"""

from __future__ import annotations

import dataclasses

from lingpack.errors import ConfigError

GB, GiB = 1e9, 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    platform: str
    peak_flops: float
    hbm_bytes: float
    hbm_bw: float
    link_bw: float
    links: int = 0
    cycle_hz: float = 0.0


CHIPS = {c.name: c for c in (
    Chip("v5e", "tpu", 197e12, 16 * GB, 819 * GB, 400 * GB, links=4, cycle_hz=1.712e9),
    Chip("v5p", "tpu", 459e12, 95 * GiB, 2765 * GB, 1200 * GB, links=6, cycle_hz=1.942e9),
    Chip("v6e", "tpu", 918e12, 32 * GB, 1638 * GB, 800 * GB, links=4, cycle_hz=2.486e9),
    Chip("h100", "gpu", 1979e12 / 2, 80 * GB, 3350 * GB, 900 * GB),
    Chip("h200", "gpu", 1979e12 / 2, 141 * GB, 4800 * GB, 900 * GB),
)}

# `jax.Device.device_kind` substrings (lower-cased) of each chip, most specific first.
DEVICE_KINDS = (("v6", "v6e"), ("v5p", "v5p"), ("v5 lite", "v5e"), ("v5e", "v5e"), ("h200", "h200"),
                ("h100", "h100"))


def chip(name: str) -> Chip:
    """The chip called `name` (plan.chip); a ConfigError listing the known ones otherwise."""
    try:
        return CHIPS[str(name).lower()]
    except KeyError:
        raise ConfigError(f"plan.chip={name!r} is not a chip lingpack has figures for; choose one of "
                          f"{sorted(CHIPS)}") from None


def from_device_kind(kind: str) -> Chip | None:
    """The chip of a `jax.Device.device_kind` ("TPU v5p", "NVIDIA H100 80GB HBM3", ...), or None."""
    kind = kind.lower()
    return next((CHIPS[name] for key, name in DEVICE_KINDS if key in kind), None)


# Standard slice shapes per TPU generation (cloud.google.com/tpu/docs/v5e, /v5p, /v6e: the topologies a slice of
# that many chips is offered in): chips -> topology; libtpu compiles for it with no TPU attached.
TOPOLOGIES = {
    "v5e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "v6e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "v5p": {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
            256: "4x8x8", 512: "8x8x8"},
}
CHIP_CONFIG = {"v5e": "default", "v6e": "default", "v5p": "megacore"}   # v5p: one device per chip (both cores)
INSTALL_TPU = 'pip install -e ".[tpu]"'


def topology_name(chip: Chip, devices: int, override: str | None = None) -> str:
    """The slice topology ("4x4x4") of `devices` chips of `chip`: `override` (plan.topology), else the standard one."""
    if override:
        dims = [int(d) for d in str(override).split("x") if d.isdigit()]
        if len(dims) != len(TOPOLOGIES[chip.name][1].split("x")) or _product(dims) != devices:
            raise ConfigError(f"plan.topology={override!r} is not a {chip.name} topology of {devices} chips; e.g. "
                              f"plan.topology={TOPOLOGIES[chip.name].get(devices, '4x4x4')}")
        return "x".join(map(str, dims))
    try:
        return TOPOLOGIES[chip.name][devices]
    except KeyError:
        raise ConfigError(f"plan.devices={devices}: no standard {chip.name} slice has that many chips (they have "
                          f"{sorted(TOPOLOGIES[chip.name])}); set plan.devices to one, or plan.topology=AxB"
                          f"{'xC' if chip.name == 'v5p' else ''} for another shape") from None


def _product(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


_LOADED_WITH = None   # LIBTPU_INIT_ARGS when this process first asked libtpu for a topology (its flags from then on)


def libtpu_flags() -> str | None:
    """The LIBTPU_INIT_ARGS this process's libtpu compiles under (read once, at its first topology); None before."""
    return _LOADED_WITH


def tpu_devices(chip: Chip, devices: int, override: str | None = None) -> list:
    """`devices` TPU devices of a `chip` slice, for compiling with libtpu on a host without one (no TPU needed)."""
    import os
    global _LOADED_WITH
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip.name}-8")   # quiets libtpu's probe of this host
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")        # one process compiles: no pod workers to find
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")           # other compiles may hold libtpu's lock
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ConfigError(f"compiling for {chip.name} needs libtpu: {INSTALL_TPU} (or plan.compiler=cpu for the "
                          "XLA:CPU twin, an estimate)") from None
    from jax.experimental import topologies
    if _LOADED_WITH is None:
        _LOADED_WITH = os.environ.get("LIBTPU_INIT_ARGS", "").strip()   # " ": a user's way to ask for no flags
    name = topology_name(chip, devices, override)
    dims = [int(d) for d in name.split("x")]
    bounds = tuple(min(d, 2) for d in dims) + (1,) * (3 - len(dims))   # chips per host: 2x2 (x1)
    if chip.name != "v5p" and len(dims) == 2 and devices >= 8 and dims[1] >= 4:
        bounds = (min(dims[0], 2), 4, 1)   # v5e / v6e hosts hold 8 chips (2x4)
    found = topologies.get_topology_desc(platform="tpu", topology_name=f"{chip.name}:{name}",
                                         chip_config_name=CHIP_CONFIG[chip.name], chips_per_host_bounds=bounds,
                                         num_slices=1, wrap=(False,) * 3).devices
    return list(found)
