"""KDA gate forms and the q/k L2 norm (docs/design.md#kda-gates); outputs are fp32, or float64 for float64 inputs.

Usable outside the kernel (the layer computes them) or inside (`chunk_kda(use_gate_in_kernel=True)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lingpack.precision import at_least_fp32

# The safe-gate contract, shared by every chunked kernel: with every g >= SAFE_GATE_MIN, a decay factor
# across at most SUB_CHUNK - 1 steps inside a sub-chunk is <= e^(5 * 15) = e^75, below fp32's e^88 overflow.
SAFE_GATE_MIN = -5.0  # Ling3's lower bound, and the lowest one the lower-bound gate accepts
SUB_CHUNK = 16        # sub-chunk size of the decay-product factoring; chunk sizes are multiples of it


def check_lower_bound(lower_bound: float, name: str = "lower_bound") -> None:
    """The lower-bound gate's bound must lie in [SAFE_GATE_MIN, 0) (g stays in (lower_bound, 0))."""
    if not SAFE_GATE_MIN <= lower_bound < 0.0:
        raise ValueError(f"{name} must lie in [{SAFE_GATE_MIN:g}, 0); got {lower_bound}")


def check_chunk_size(chunk_size: int, name: str = "chunk_size") -> None:
    """Chunked kernels factor decays per SUB_CHUNK tokens: chunk sizes are positive multiples of it."""
    if chunk_size < SUB_CHUNK or chunk_size % SUB_CHUNK:
        raise ValueError(f"{name}={chunk_size} must be a positive multiple of {SUB_CHUNK} (64 is standard)")


def softplus(x: jax.Array) -> jax.Array:
    """torch.nn.functional.softplus (threshold 20, in every dtype): x itself above 20, log1p(exp(x)) below."""
    safe_x = jnp.minimum(x, 20.0)  # clamp inside the unused branch so its gradient stays finite
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(safe_x)))


def _with_bias(g_raw_BTHK: jax.Array, dt_bias: jax.Array | None) -> jax.Array:
    H, K = g_raw_BTHK.shape[-2:]
    # gates are computed in fp32 whatever the activations' dtype (float64 when anything is float64)
    g = g_raw_BTHK.astype(at_least_fp32(g_raw_BTHK.dtype, *([] if dt_bias is None else [dt_bias.dtype])))
    if dt_bias is None:
        return g
    if dt_bias.size != H * K:
        raise ValueError(f"dt_bias must have H*K = {H * K} elements (head-major [H, K]); got shape {dt_bias.shape}")
    return g + dt_bias.reshape(H, K).astype(g.dtype)


def _check_a_log(A_log: jax.Array, H: int, dtype) -> jax.Array:
    if A_log.size != H:
        raise ValueError(f"A_log must have one value per head (H={H}); got shape {A_log.shape}")
    return A_log.reshape(H, 1).astype(at_least_fp32(dtype, A_log.dtype))


def softplus_gate(g_raw_BTHK: jax.Array, A_log: jax.Array, dt_bias: jax.Array | None = None) -> jax.Array:
    """g = -exp(A_log[h]) * softplus(g_raw + dt_bias): the Kimi Linear gate, unbounded below."""
    g = _with_bias(g_raw_BTHK, dt_bias)
    return -jnp.exp(_check_a_log(A_log, g_raw_BTHK.shape[-2], g.dtype)) * softplus(g)


def lower_bound_gate(g_raw_BTHK: jax.Array, A_log: jax.Array | None, dt_bias: jax.Array | None = None,
                     lower_bound: float = SAFE_GATE_MIN) -> jax.Array:
    """g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias)): Ling3's "safe gate", g in (lower_bound, 0)."""
    check_lower_bound(lower_bound)
    x = _with_bias(g_raw_BTHK, dt_bias)
    if A_log is not None:
        x = jnp.exp(_check_a_log(A_log, g_raw_BTHK.shape[-2], x.dtype)) * x
    return lower_bound * jax.nn.sigmoid(x)


def kda_gate(g_raw_BTHK: jax.Array, A_log: jax.Array | None, dt_bias: jax.Array | None = None,
             lower_bound: float | None = None) -> jax.Array:
    """The softplus gate, or the lower-bound gate when `lower_bound` is given."""
    if lower_bound is None:
        if A_log is None:
            raise ValueError("the softplus gate needs A_log; pass A_log or set lower_bound for the safe gate")
        return softplus_gate(g_raw_BTHK, A_log, dt_bias)
    return lower_bound_gate(g_raw_BTHK, A_log, dt_bias, lower_bound)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in fp32 or wider (FLA's l2norm), cast back to x's dtype."""
    x32 = x.astype(at_least_fp32(x.dtype))  # the sum of squares overflows/loses precision in bf16
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def inverse_softplus(y: jax.Array) -> jax.Array:
    """x with softplus(x) = y, for y > 0 (used to initialise dt_bias)."""
    return y + jnp.log(-jnp.expm1(-y))


def init_a_log(key: jax.Array, num_heads: int, dtype=jnp.float32) -> jax.Array:
    """A_log = log(U(1, 16)) per head."""
    return jnp.log(jax.random.uniform(key, (num_heads,), dtype, 1.0, 16.0))


def init_dt_bias(key: jax.Array, size: int, dt_min: float = 1e-3, dt_max: float = 1e-1,
                 dt_floor: float = 1e-4, dtype=jnp.float32) -> jax.Array:
    """dt_bias = inverse_softplus(clamp(exp(U(log dt_min, log dt_max)), min=dt_floor))."""
    log_dt = jax.random.uniform(key, (size,), dtype, jnp.log(dt_min), jnp.log(dt_max))
    return inverse_softplus(jnp.maximum(jnp.exp(log_dt), dt_floor))
