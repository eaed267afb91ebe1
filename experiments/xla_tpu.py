"""TPU devices of a standard slice topology, from a CPU host with libtpu installed (nothing runs on them).

    from experiments import xla_tpu        # before JAX starts: sets the environment libtpu reads
    devices = xla_tpu.devices("v5p:2x2x2")  # 8 v5p chips (megacore), for a Mesh and `.lower().compile()`

libtpu probes the host at backend init unless TPU_ACCELERATOR_TYPE is set, and takes a machine-wide lock
file unless ALLOW_MULTIPLE_LIBTPU_LOAD is set (several compiles on one host at once). Compile for TPU under
`lingpack.backend.target("tpu")` so kernels and the MoE take their TPU side.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# topology name: (chip config, chips per host); one host holds at most 4 chips (2x2x1 / 2x2)
TOPOLOGIES = {
    "v5p:1x1x1": ("megacore", (1, 1, 1)),
    "v5p:2x2x1": ("megacore", (2, 2, 1)),
    "v5p:2x2x2": ("megacore", (2, 2, 1)),
    "v5p:4x4x4": ("megacore", (2, 2, 1)),
    "v5e:1x1": ("default", (1, 1)),
    "v5e:2x2": ("default", (2, 2)),
    "v5e:2x4": ("default", (2, 2)),
    "v6e:1x1": ("default", (1, 1)),
    "v6e:2x2": ("default", (2, 2)),
    "v6e:2x4": ("default", (2, 2)),
}


def devices(topology: str) -> list:
    """The devices of one slice of `topology` (a key of TOPOLOGIES)."""
    from jax.experimental import topologies
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; known: {sorted(TOPOLOGIES)}")
    chip_config, per_host = TOPOLOGIES[topology]
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name=chip_config,
                                             chips_per_host_bounds=per_host, num_slices=1,
                                             wrap=(False,) * len(per_host)).devices)


def memory(compiled) -> dict:
    """XLA's per-device buffer sizes of a compiled program, and its peak (arguments + outputs + temps - aliased)."""
    m = compiled.memory_analysis()
    parts = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    return dict(parts, peak=parts["argument"] + parts["output"] + parts["temp"] - parts["alias"])
