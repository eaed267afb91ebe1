"""TPU devices of a standard slice topology, from a CPU host with libtpu installed (nothing runs on them).

    from experiments import xla_tpu        # before JAX starts: sets the environment libtpu reads
    devices = xla_tpu.devices("v5p:2x2x2")  # 8 v5p chips (megacore), for a Mesh and `.lower().compile()`

libtpu probes the host at backend init unless TPU_ACCELERATOR_TYPE is set, and takes a machine-wide lock
file unless ALLOW_MULTIPLE_LIBTPU_LOAD is set (several compiles on one host at once). Compile for TPU under
`lingpack.backend.target("tpu")` so kernels and the MoE take their TPU side.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def devices(topology: str) -> list:
    """The devices of a TPU slice named like "v5p:2x2x2" (lingpack.plan.chips.tpu_devices)."""
    from lingpack.plan import chips
    generation, shape = topology.split(":")
    return chips.tpu_devices(chips.chip(generation), math.prod(map(int, shape.split("x"))), shape)


def memory(compiled) -> dict:
    """XLA's per-device buffer sizes of a compiled program, and its peak (arguments + outputs + temps - aliased)."""
    m = compiled.memory_analysis()
    parts = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    return dict(parts, peak=parts["argument"] + parts["output"] + parts["temp"] - parts["alias"])
