"""The backend target: the platform a trace is for, read by every backend-dependent choice.

A step traced on a CPU host normally takes its CPU side everywhere. Inside `target("tpu")` (or "gpu")
it takes that platform's side instead, so `jax.export(..., platforms=["tpu"])` from a laptop sees exactly
the program a TPU run would build (Mosaic kernels, not interpret mode):

    with lingpack.backend.target("tpu"):
        exported = jax.export.export(step, platforms=["tpu"])(state, batch)

Outside any `target(...)` the platform is `jax.default_backend()` ("cuda"/"rocm" read as "gpu").
The choices that read it: Pallas interpret mode (`pallas_interpret`), the MoE grouped matmul
(`models/moe.py`) and `attention_impl: auto` (`kernels/attention/api.py`); docs/kernels.md lists each
platform's side.
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
