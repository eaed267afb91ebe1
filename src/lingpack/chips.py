"""Accelerator figures the planner and the MFU estimate use: one row per chip, each figure with its public source.

    peak_flops    dense bf16 FLOP/s per chip (NVIDIA quotes "with sparsity": dense is half of that)
    hbm_bytes     HBM capacity per chip (bytes; the vendor's unit: GB = 1e9, GiB = 2**30)
    hbm_bw        HBM bandwidth per chip (bytes/s)
    link_bw       chip-to-chip bandwidth per chip, bidirectional (bytes/s): TPU ICI, NVIDIA NVLink
    platform      what `lingpack.backend.target` traces for it ("tpu" or "gpu")

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


CHIPS = {c.name: c for c in (
    Chip("v5e", "tpu", 197e12, 16 * GB, 819 * GB, 400 * GB),
    Chip("v5p", "tpu", 459e12, 95 * GiB, 2765 * GB, 1200 * GB),
    Chip("v6e", "tpu", 918e12, 32 * GB, 1638 * GB, 800 * GB),
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
