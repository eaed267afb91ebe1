"""XLA:TPU flags (LIBTPU_INIT_ARGS) per TPU generation: collectives overlapped with compute.

libtpu reads LIBTPU_INIT_ARGS once, when the TPU backend initialises: set it before JAX first touches the TPU
(the launch scripts in slurm_or_tpu_launch/ do, unless the user already set it), and compare flag sets in
fresh processes. The groups follow MaxText's library of commonly used flags
(AI-Hypercomputer/maxtext:benchmarks/xla_flags_library.py: CF_FOR_ALL_GATHER, CF_FOR_ALL_REDUCE,
DATA_PARALLEL_OVERLAP), and the expert exchange's asynchronous ragged all-to-all is libtpu's own flag;
experiments/tpu_flags/ compiles a small FSDP layer stack for 8 v5p chips under each and reads what the
compiled schedule does with them, and the flagship's plans show each on the whole step (docs/planning.md).

    python -m lingpack.tpu_flags v5p            # prints the LIBTPU_INIT_ARGS value for v5p
"""

from __future__ import annotations

import os
import sys

from lingpack.errors import ConfigError

# group: (flags, what it does)
GROUPS = {
    # MaxText's `..._fuse_all_gather=true` is a group of its own (v6e only): on the flagship's step for 64 v5p
    # chips (T=8192) it moved the weight all-gathers into the layer and head loops and repeated them, 19.2 GB a
    # step per device against 6.5 GB, for a slower plan (641 against 635 ms); on v6e it planned 1028 against
    # 1088 ms (docs/planning.md)
    "async_all_gather": ((
        "--xla_enable_async_all_gather=true",
        "--xla_tpu_enable_async_collective_fusion=true",
        "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
        "--xla_tpu_overlap_compute_collective_tc=true",
    ), "FSDP all-gathers asynchronous, overlapped with the tensor cores' compute"),
    "fuse_all_gather": ((
        "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    ), "FSDP all-gathers fused into the async collective fusions (repeated inside loops: v6e gains, v5p loses)"),
    "async_all_reduce": ((
        "--xla_enable_async_all_reduce=true",
        "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true",
    ), "gradient all-reduces fused and asynchronous, overlapped the same way"),
    # the expert exchange is synchronous by default: its whole transfer is exposed. Asynchronous, XLA:TPU's schedule
    # runs it beside the work that does not wait for it (the recomputed forward's grouped matmuls under the exchange
    # of the output cotangents, the expert weight gradients under the return of the input gradients; the flagship's
    # plans: docs/planning.md). Not on v5e: it refuses the ragged all-to-all, and its dense one asynchronous
    # ("Async all-to-all not supported on limited ICI", libtpu 0.0.42)
    "async_ragged_all_to_all": ((
        "--xla_tpu_enable_async_ragged_all_to_all=true",
    ), "the expert-parallel ragged all-to-all asynchronous, overlapped with the compute that does not need it"),
    "data_parallel_all_reduce": ((
        "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
        "--xla_tpu_data_parallel_opt_different_sized_ops=true",
    ), "data-parallel all-reduces pipelined across iterations (the DCN all-reduce optimisation)"),
}
# generation -> groups, in order (the async fusions are libtpu defaults on recent versions: set to be sure)
GENERATIONS = {
    "v5p": ("async_all_gather", "async_all_reduce", "async_ragged_all_to_all", "data_parallel_all_reduce"),
    "v6e": ("async_all_gather", "fuse_all_gather", "async_all_reduce", "async_ragged_all_to_all",
            "data_parallel_all_reduce"),
    "v5e": ("async_all_gather", "async_all_reduce", "data_parallel_all_reduce"),
    "v4": ("async_all_gather", "data_parallel_all_reduce"),
}
ENV = "LIBTPU_INIT_ARGS"


def generation(chip: str) -> str:
    """'v5p', 'v6e', ... from a chip name, a device kind ('TPU v5', 'TPU v6 lite') or an accelerator type ('v5p-64')."""
    name = str(chip).lower().replace("tpu", "").strip()
    aliases = {"v5": "v5p", "v5 lite": "v5e", "v5litepod": "v5e", "v6 lite": "v6e", "v6": "v6e"}
    name = name.split("-")[0].strip()
    name = aliases.get(name, name)
    if name not in GENERATIONS:
        raise ConfigError(f"no XLA:TPU flag table for chip {chip!r}; known generations: {sorted(GENERATIONS)}")
    return name


def flags_for(chip_generation: str, groups: tuple[str, ...] | None = None) -> list[str]:
    """The LIBTPU_INIT_ARGS flags of a generation (or of the named `groups` only)."""
    chosen = GENERATIONS[generation(chip_generation)] if groups is None else groups
    unknown = [g for g in chosen if g not in GROUPS]
    if unknown:
        raise ConfigError(f"unknown XLA:TPU flag group(s) {unknown}; known: {sorted(GROUPS)}")
    return [flag for g in chosen for flag in GROUPS[g][0]]


def env(chip_generation: str, groups: tuple[str, ...] | None = None, environ=None) -> dict:
    """{LIBTPU_INIT_ARGS: the generation's flags}, or {} when `environ` (default os.environ) already sets it:
    a user's own flags win."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV):
        return {}
    return {ENV: " ".join(flags_for(chip_generation, groups))}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m lingpack.tpu_flags <generation: v5p | v6e | v5e | v4, or an accelerator type>",
              file=sys.stderr)
        return 2
    try:
        print(" ".join(flags_for(argv[0])))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
