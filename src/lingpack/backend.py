"""The backend target: the platform a trace is for, read by every backend-dependent choice.

A step traced on a CPU host normally takes its CPU side everywhere. Inside `target("tpu")` (or "gpu")
it takes that platform's side instead, so `jax.export(..., platforms=["tpu"])` from a laptop sees exactly
the program a TPU run would build (Mosaic kernels, not interpret mode):

    with lingpack.backend.target("tpu"):
        exported = jax.export.export(step, platforms=["tpu"])(state, batch)

Outside any `target(...)` the platform is `jax.default_backend()` ("cuda"/"rocm" read as "gpu").
The choices that read it: Pallas interpret mode (`pallas_interpret`), the MoE grouped matmul
(`models/moe.py`), `attention_impl: auto` (`kernels/attention/api.py`) and the expert-parallel exchange
(`expert_exchange`, which also reads the chip generation from the mesh's devices); docs/kernels.md lists each
platform's side, docs/parallelism.md the exchange's.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import jax

from lingpack.errors import ConfigError

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
_TARGET: contextvars.ContextVar = contextvars.ContextVar("lingpack_backend_target", default=None)


def _normalise(platform: str) -> str:
    name = _ALIASES.get(str(platform).lower(), str(platform).lower())
    if name not in PLATFORMS:
        raise ConfigError(f"backend target {platform!r} is not a platform lingpack traces for; choose one of "
                          f"{PLATFORMS} (or 'cuda' / 'rocm' for gpu)")
    return name


@contextlib.contextmanager
def target(platform: str):
    """Trace the enclosed code as `platform` ("cpu", "gpu" or "tpu") would run it.

    JAX's trace caches do not know the target, so a function traced outside would be reused inside (and
    the reverse): entering or leaving a different target clears them.
    """
    name = _normalise(platform)
    switch = name != current()
    if switch:
        jax.clear_caches()
    token = _TARGET.set(name)
    try:
        yield name
    finally:
        _TARGET.reset(token)
        if switch:
            jax.clear_caches()


def current() -> str:
    """The platform being traced for: the innermost `target(...)`, else the default JAX backend."""
    chosen = _TARGET.get()
    return chosen if chosen is not None else _normalise(jax.default_backend())


LOWERINGS = {"tpu": "TPU (Mosaic)", "gpu": "GPU (Triton)"}   # the Pallas backend each native platform lowers through
_WARNED: set = set()   # kernels already announced as emulated on CPU: one line per kernel and process
log = logging.getLogger("lingpack")


def pallas_interpret(requested: bool | None, *, kernel: str, alternative: str, native: str = "tpu",
                     emulate: str | None = "set kernel.interpret=true to emulate it",
                     cpu_alternative: str | None = None) -> bool:
    """Whether a Pallas kernel written for `native` ("tpu": Mosaic, "gpu": Triton) runs in interpret mode.

    `requested` is what the user or a test asked (`kernel.interpret`): True interprets anywhere, False
    lowers for `native` (on a CPU host: for export). None takes the platform's side: the real kernel on
    `native`; on CPU interpret mode, with one warning per kernel and process that it is an op-by-op emulation
    and that `cpu_alternative` (default `alternative`) is the CPU's kernel; on any other accelerator a
    ConfigError naming `alternative` (and `emulate`, how to ask for emulation anyway): the kernel has no
    lowering there and would only be emulated op by op.
    """
    if requested is not None:
        return bool(requested)
    platform = current()
    if platform == native:
        return False
    if platform == "cpu":
        if kernel not in _WARNED:
            _WARNED.add(kernel)
            hint = f" ({emulate} without this warning)" if emulate else ""
            log.warning("%s has no CPU lowering: it runs in Pallas interpret mode, an op-by-op emulation meant for "
                        "tests and far slower than a kernel; on CPU use %s%s", kernel,
                        cpu_alternative or alternative, hint)
        return True
    hint = f" (or {emulate}, for debugging only)" if emulate else ""
    raise ConfigError(f"{kernel} is a Pallas {LOWERINGS[native]} kernel and has no {platform.upper()} lowering; use "
                      f"{alternative} on {platform.upper()}{hint}")


# XLA:TPU's ragged all-to-all stops with "Ragged all-to-all is currently not supported in limited ICI routing
# settings" on these device kinds past this many chips in a slice (libtpu 0.0.42.1, compiled from a CPU host:
# v5e 2x2, 2x4 and 4x4 compile, 4x8 and 8x8 refuse; v5p to 4x4x4 and v6e to 16x16 compile; docs/parallelism.md)
RAGGED_ALL_TO_ALL_MAX_CHIPS = {"TPU v5 lite": 16, "TPU v5e": 16}


def expert_exchange(devices) -> str:
    """The expert-parallel exchange for a program over `devices` (the mesh's): "ragged" (XLA's ragged
    all-to-all; parallel/expert.py) or "dense" (an all_to_all of capacity-sized buffers).

    CPU: "dense" (XLA:CPU has no ragged all-to-all). GPU: "ragged". TPU: "ragged" unless the chip's device
    kind (`device.device_kind`, e.g. "TPU v5 lite" for v5e) refuses it at this slice size
    (RAGGED_ALL_TO_ALL_MAX_CHIPS). Traced for TPU on CPU devices (export) the generation is unknown: "ragged".
    """
    platform = current()
    if platform == "cpu":
        return "dense"
    devices = list(devices)
    if platform == "tpu" and devices:
        limit = RAGGED_ALL_TO_ALL_MAX_CHIPS.get(devices[0].device_kind)
        first = getattr(devices[0], "slice_index", 0)
        chips = sum(getattr(d, "slice_index", 0) == first for d in devices)   # chips of one slice in the mesh
        if limit is not None and chips > limit:
            return "dense"
    return "ragged"
