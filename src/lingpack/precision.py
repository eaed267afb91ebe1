"""Floating-point dtypes of a run: the choices, the accumulation rule, and JAX's x64 mode for float64.

Every place that computes in fp32 whatever the activations' dtype (norm statistics, softmax, gates, the
KDA state, routing, the loss, gradient accumulation) makes a precision choice: fp32 because bf16 is not
enough. It follows a wider compute dtype: `at_least_fp32(dtype)` is fp32 for bf16 / fp16 / fp32 and
float64 for float64. Formats stay what they are (int32 ids, 0/1 masks, counts exact in fp32, finite mask
values), and each says so where it is made.

float64 arrays exist only in JAX's x64 mode, a process-wide switch that also decides the dtype of every
array made after it (`jnp.zeros(n)`, `jnp.arange(n)`): `x64(enabled)` sets it for one run and restores it
after, `check_float64()` refuses a backend without float64 arithmetic (TPUs have none).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from lingpack.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float64")   # model.dtype / model.param_dtype / optim.master_dtype
_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}


def as_dtype(name) -> jnp.dtype:
    """'float32' / 'bfloat16' / 'float64' (or a dtype) -> jnp.dtype, with an error naming the valid choices.

    float64 is only honoured in x64 mode: outside it JAX makes float32 arrays when asked for float64."""
    if isinstance(name, str):
        if name not in _NAMES:
            raise ValueError(f"unknown dtype {name!r}; valid choices: {sorted(_NAMES)}")
        return jnp.dtype(_NAMES[name])
    return jnp.dtype(name)


def at_least_fp32(*dtypes) -> jnp.dtype:
    """The dtype of a precision-sensitive computation on inputs of `dtypes`: fp32, or the widest input when it
    is wider (float64). `jnp.promote_types`, so bf16 with fp32 is fp32 and anything with float64 is float64."""
    out = jnp.dtype(jnp.float32)
    for dtype in dtypes:
        if not isinstance(dtype, (str, type, jnp.dtype)):   # an array: its dtype
            dtype = dtype.dtype
        out = jnp.promote_types(out, as_dtype(dtype))
    return out


def wants_float64(*names) -> bool:
    """Whether any of these dtype names (a config's model.dtype, model.param_dtype, optim.master_dtype) is float64."""
    return any(str(name) == "float64" for name in names)


@contextlib.contextmanager
def x64(enabled: bool):
    """JAX's x64 mode on (or off) for the enclosed code, the previous setting restored after.

    The switch is process-wide (not per thread: the data pipeline's threads see it too), so a run sets it
    before it makes its first array and a test or a multirun's next job starts from the setting it had."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", bool(enabled))
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def check_float64(key: str = "model.dtype") -> None:
    """Raise a one-line ConfigError unless float64 arrays exist and add in float64 on the default backend.

    Two ways it fails: x64 mode is off (JAX silently makes float32 arrays then), or the backend has no float64
    arithmetic (TPU). The test adds 2^-40 to 1 inside a jitted function: float32 would round it away."""
    fix = f"set {key} (and model.param_dtype, optim.master_dtype) to float32, or run on CPU or GPU"
    if not jax.config.jax_enable_x64:
        raise ConfigError(f"{key}=float64 needs JAX's x64 mode, which is off in this process (it is set per run by "
                          f"lingpack.experiment.run; JAX_ENABLE_X64=1 sets it for a script); or {fix}")
    tiny = 2.0 ** -40
    try:
        one = jnp.ones((), jnp.float64)
        kept = float(jax.jit(lambda a: a + tiny)(one)) - 1.0
        dtype = one.dtype
    except Exception as err:  # a backend without float64 raises its own error type here (XlaRuntimeError on TPU)
        raise ConfigError(f"{key}=float64: the {jax.default_backend()} backend cannot compute in float64 "
                          f"({type(err).__name__}); {fix}") from None
    if dtype != jnp.float64 or kept != tiny:
        raise ConfigError(f"{key}=float64: the {jax.default_backend()} backend computed 1 + 2^-40 as 1 + {kept!r} "
                          f"in {dtype} (no float64 arithmetic); {fix}")
