"""The backend target: the platform a trace is for, read by every backend-dependent choice.

A step traced on a CPU host normally takes its CPU side everywhere. Inside `target("tpu")` (or "gpu")
it takes that platform's side instead, so `jax.export(..., platforms=["tpu"])` from a laptop sees exactly
the program a TPU run would build (Mosaic kernels, not interpret mode):

    with lingpack.backend.target("tpu"):
        exported = jax.export.export(step, platforms=["tpu"])(state, batch)

Outside any `target(...)` the platform is `jax.default_backend()` ("cuda"/"rocm" read as "gpu").
The choices that read it: Pallas interpret mode (`pallas_interpret`), the MoE grouped matmul, and any
`auto` implementation choice.
"""

from __future__ import annotations

import contextlib
import contextvars

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


def pallas_interpret(requested: bool | None, *, kernel: str, alternative: str) -> bool:
    """Whether a Pallas TPU kernel runs in interpret mode.

    `requested` is what the user or a test asked (`kernel.interpret`): True interprets anywhere, False
    lowers through Mosaic (on a CPU host: for export to TPU). None takes the platform's side: Mosaic on
    TPU, interpret mode on CPU (tests), and on GPU a ConfigError naming `alternative`: a TPU kernel there
    would only be emulated op by op.
    """
    if requested is not None:
        return bool(requested)
    platform = current()
    if platform == "gpu":
        raise ConfigError(f"{kernel} is a Pallas TPU (Mosaic) kernel and has no GPU lowering; use {alternative} "
                          "on GPU (or set kernel.interpret=true to emulate it, for debugging only)")
    return platform != "tpu"
