"""Building blocks shared by every layer: norms, RoPE, SwiGLU MLP, the segment-masked short convolution.

Parameters carry logical axis names (see `ling3.py`'s docstring for the set); compute happens in the
module's `dtype`, numerically sensitive parts (norm statistics, RoPE angles) in fp32, or in the compute dtype
when it is wider (float64: `precision.at_least_fp32`).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from lingpack import backend
from lingpack.kernels import short_conv as short_conv_kernel
from lingpack.parallel.context import current
from lingpack.parallel.halo import context_neighbours
from lingpack.precision import at_least_fp32
from lingpack.models.remat import tag

DEFAULT_INIT = nnx.initializers.normal(stddev=0.02)  # DeepSeek/HF initializer_range


def partitioned(init, axes: tuple[str | None, ...]):
    """`init` with logical axis names; lazy (no mesh needed here): the training code maps names to mesh axes."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


def dense(in_dim: int, out_dim: int, axes: tuple[str, str], *, dtype, param_dtype, rngs: nnx.Rngs,
          init=DEFAULT_INIT) -> nnx.Linear:
    """Bias-free linear layer `x @ kernel[in, out]` with logical sharding `axes` on the kernel."""
    return nnx.Linear(in_dim, out_dim, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=partitioned(init, axes), rngs=rngs)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) over the last axis, in fp32 or wider (bf16 squares lose the mean's precision)."""
    x32 = x.astype(at_least_fp32(x.dtype))
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """y = rmsnorm(x) * weight; statistics and the product in fp32 or wider, result in `dtype` (or x's dtype)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(partitioned(nnx.initializers.ones, ("norm",))(None, (dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps)
        y = y * self.weight[...].astype(y.dtype)
        return y.astype(self.dtype or x.dtype)


GATE_ACTIVATIONS = {"sigmoid": jax.nn.sigmoid, "silu": jax.nn.silu}


class GatedRMSNorm(nnx.Module):
    """y = rmsnorm(x) * weight * act(gate), act in {sigmoid (FLA, Moonshot), silu}; all in fp32 or wider."""

    def __init__(self, dim: int, *, eps: float = 1e-6, activation: str = "sigmoid", dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"unknown gate activation {activation!r}; valid choices: {sorted(GATE_ACTIVATIONS)}")
        self.eps = eps
        self.activation = activation
        self.dtype = dtype
        self.weight = nnx.Param(partitioned(nnx.initializers.ones, ("norm",))(None, (dim,), param_dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        y = rms_normalize(x.astype(at_least_fp32(x.dtype, gate.dtype)), self.eps)
        y = y * self.weight[...].astype(y.dtype)
        y = y * GATE_ACTIVATIONS[self.activation](gate.astype(y.dtype))  # gate in fp32 (or wider), as FLA's kernel
        return y.astype(self.dtype or x.dtype)


def apply_rope(x_BTHD: jax.Array, positions_BT: jax.Array, *, theta: float = 10000.0, rotary_dim: int | None = None,
               interleaved: bool = False) -> jax.Array:
    """Rotary embedding on the first `rotary_dim` features of each head (the rest pass through).

    interleaved=True rotates pairs (x[2i], x[2i+1]) (GPT-J / DeepSeek-MLA checkpoints); False rotates
    (x[i], x[i + rotary_dim/2]) (GPT-NeoX / HF `rotate_half`). Frequency i is theta^(-2i/rotary_dim).
    Positions come from the batch (`inputs_position`), so they restart with every packed document.
    """
    D = x_BTHD.shape[-1]
    rotary_dim = D if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= D:
        raise ValueError(f"rotary_dim must be even and in (0, {D}]; got {rotary_dim}")
    half = rotary_dim // 2
    wide = at_least_fp32(x_BTHD.dtype)  # angles in fp32 (or wider): bf16 angles of large positions are useless
    inv_freq = theta ** (-jnp.arange(half, dtype=wide) * 2.0 / rotary_dim)
    angles_BT1F = (positions_BT.astype(wide)[..., None] * inv_freq)[:, :, None, :]
    cos, sin = jnp.cos(angles_BT1F), jnp.sin(angles_BT1F)
    x32 = x_BTHD.astype(wide)
    rot, rest = x32[..., :rotary_dim], x32[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rot = jnp.stack([y1, y2], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rot, rest], axis=-1).astype(x_BTHD.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, emb_dim: int, hidden_dim: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = dense(emb_dim, hidden_dim, ("embed", "mlp"), **kw)
        self.up_proj = dense(emb_dim, hidden_dim, ("embed", "mlp"), **kw)
        self.down_proj = dense(hidden_dim, emb_dim, ("mlp", "embed"), **kw)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        gate, up = tag(self.gate_proj(x_BTD), "mlpwi_0"), tag(self.up_proj(x_BTD), "mlpwi_1")
        return tag(self.down_proj(jax.nn.silu(gate) * up), "mlpwo")


def _conv_init(kernel_size: int):
    bound = 1.0 / math.sqrt(kernel_size)  # torch Conv1d default for a depthwise conv (fan_in = kernel_size)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def _tap(x_BTC: jax.Array, segment_ids_BT: jax.Array | None, offset: int) -> jax.Array:
    """x[t + offset] where token t + offset exists and shares t's segment, else 0. The conv reads offsets -lag;
    its transpose (the backward) reads +lag."""
    T, lag = x_BTC.shape[1], abs(offset)
    pad = (lag, 0) if offset < 0 else (0, lag)
    cut = slice(0, T) if offset < 0 else slice(lag, lag + T)
    x_src = jnp.pad(x_BTC, [(0, 0), pad, (0, 0)])[:, cut]
    if segment_ids_BT is None or not lag:
        return x_src
    seg_src = jnp.pad(segment_ids_BT, [(0, 0), pad], constant_values=-1)[:, cut]   # -1: no token there
    return jnp.where((seg_src == segment_ids_BT)[..., None], x_src, 0)


def segment_causal_conv(x_BTC: jax.Array, kernel_KC: jax.Array, segment_ids_BT: jax.Array | None) -> jax.Array:
    """Depthwise causal conv: y[t] = sum_j kernel[j] * x[t - (K-1) + j], only over taps in t's segment.

    Tap order (documented, fixed): `kernel[K-1]` multiplies the CURRENT token, `kernel[0]` the token
    K-1 steps back: PyTorch/Flax cross-correlation order, so a torch `Conv1d.weight [C, 1, K]` converts
    by a transpose, no flip. A tap contributes only when source and target share a segment id, so each
    packed document starts with zero conv history.
    """
    K = kernel_KC.shape[0]
    wide = at_least_fp32(x_BTC.dtype, kernel_KC.dtype)  # accumulate the K taps in fp32 (or wider)
    y = jnp.zeros(x_BTC.shape, wide)
    for lag in range(K):
        y = y + _tap(x_BTC, segment_ids_BT, -lag).astype(wide) * kernel_KC[K - 1 - lag].astype(wide)
    return y.astype(x_BTC.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3, 6))
def short_conv(x_BTC: jax.Array, kernel_KC: jax.Array, segment_ids_BT: jax.Array | None, activation: str | None,
               prev_x_BWC: jax.Array | None = None, prev_ids_BW: jax.Array | None = None,
               backward: str = "xla") -> jax.Array:
    """`segment_causal_conv`, then SiLU if `activation == "silu"`, of x extended by `prev_x` (the W = K-1 tokens
    before the block and their ids, under context parallelism; None: the row starts here). Returns the block's
    own T tokens. Its VJP keeps only the inputs and recomputes the taps: autodiff would keep K-1 shifted, masked
    copies of x and the SiLU's operands, or the extended block. `backward`: "xla" (below), or the Pallas TPU
    kernel `kernels/short_conv.py` ("pallas": Mosaic; "pallas_interpret": interpret mode, for tests)."""
    x_ext, ids_ext = _extend(x_BTC, segment_ids_BT, prev_x_BWC, prev_ids_BW)
    y = segment_causal_conv(x_ext, kernel_KC, ids_ext)[:, x_ext.shape[1] - x_BTC.shape[1]:]
    return jax.nn.silu(y) if activation == "silu" else y


def _extend(x_BTC, segment_ids_BT, prev_x_BWC, prev_ids_BW):
    if prev_x_BWC is None:
        return x_BTC, segment_ids_BT
    return jnp.concatenate([prev_x_BWC, x_BTC], 1), jnp.concatenate([prev_ids_BW, segment_ids_BT], 1)


def _short_conv_fwd(x_BTC, kernel_KC, segment_ids_BT, activation, prev_x_BWC, prev_ids_BW, backward):
    out = short_conv(x_BTC, kernel_KC, segment_ids_BT, activation, prev_x_BWC, prev_ids_BW, backward)
    return out, (x_BTC, kernel_KC, segment_ids_BT, prev_x_BWC, prev_ids_BW)


def _short_conv_bwd(activation, backward, residuals, d_out_BTC):
    x_BTC, kernel_KC, segment_ids_BT, prev_x_BWC, prev_ids_BW = residuals
    if backward != "xla":
        dx, d_kernel, d_prev = short_conv_kernel.short_conv_bwd(
            x_BTC, kernel_KC, segment_ids_BT, d_out_BTC, prev_x_BWC, prev_ids_BW, silu=activation == "silu",
            interpret=backward == "pallas_interpret")
        d_prev = None if d_prev is None else d_prev.astype(prev_x_BWC.dtype)
        return dx, d_kernel.astype(kernel_KC.dtype), None, d_prev, None
    # tied to the cotangent: XLA cannot schedule the recomputation below into the forward, where it would be live
    x_BTC, prev_x_BWC, kernel_KC, d_out_BTC = jax.lax.optimization_barrier((x_BTC, prev_x_BWC, kernel_KC, d_out_BTC))
    x_ext, ids_ext = _extend(x_BTC, segment_ids_BT, prev_x_BWC, prev_ids_BW)
    W = x_ext.shape[1] - x_BTC.shape[1]
    K = kernel_KC.shape[0]
    wide = at_least_fp32(x_BTC.dtype, kernel_KC.dtype)   # the backward in fp32 (or wider), as the forward's taps
    dy = jnp.pad(d_out_BTC.astype(wide), [(0, 0), (W, 0), (0, 0)])   # the W earlier tokens have no outputs here
    if activation == "silu":   # silu'(y) = s (1 + y (1 - s)), s = sigmoid(y), at the forward's rounded y
        y = segment_causal_conv(x_ext, kernel_KC, ids_ext).astype(wide)
        s = jax.nn.sigmoid(y)
        dy = dy * s * (1 + y * (1 - s))
    # tap `lag` sends x[t - lag] to y[t], so both gradients read dy[t + lag] at t:
    # sum_t dy[t] x[t - lag] = sum_s dy[s + lag] x[s]
    ahead = [_tap(dy, ids_ext, lag) for lag in range(K)]
    dx = sum(a * kernel_KC[K - 1 - lag].astype(wide) for lag, a in enumerate(ahead))
    d_kernel = jnp.stack([jnp.sum(ahead[K - 1 - j] * x_ext.astype(wide), axis=(0, 1)) for j in range(K)])
    d_prev = None if prev_x_BWC is None else dx[:, :W].astype(prev_x_BWC.dtype)
    return dx[:, W:].astype(x_BTC.dtype), d_kernel.astype(kernel_KC.dtype), None, d_prev, None


short_conv.defvjp(_short_conv_fwd, _short_conv_bwd)


class ShortConvolution(nnx.Module):
    """Depthwise causal conv over time with a segment mask, optional SiLU (see `segment_causal_conv`).

    `pallas_backward`: the backward is the Pallas TPU kernel (`kernels/short_conv.py`), in Mosaic or interpret
    mode as `interpret` and the platform say (`backend.pallas_interpret`), for shapes it takes (T a multiple of
    8); XLA's otherwise."""

    def __init__(self, channels: int, kernel_size: int = 4, *, activation: str | None = "silu", dtype=jnp.float32,
                 param_dtype=jnp.float32, pallas_backward: bool = False, interpret: bool | None = None,
                 rngs: nnx.Rngs):
        if activation not in (None, "silu"):
            raise ValueError(f"short conv activation must be 'silu' or None; got {activation!r}")
        self.activation = activation
        self.dtype = dtype
        self.pallas_backward, self.interpret = pallas_backward, interpret
        init = partitioned(_conv_init(kernel_size), ("conv", "heads"))
        self.kernel = nnx.Param(init(rngs.params(), (kernel_size, channels), param_dtype))

    def _backward(self, T: int, C: int, K: int) -> str:
        if not self.pallas_backward or not short_conv_kernel.supported(T, C, K):
            return "xla"
        interpret = backend.pallas_interpret(self.interpret, kernel="the Pallas short-conv backward (kernel.short_conv"
                                             "=pallas)", alternative="kernel.short_conv=xla")
        return "pallas_interpret" if interpret else "pallas"

    def __call__(self, x_BTC: jax.Array, segment_ids_BT: jax.Array | None = None) -> jax.Array:
        x, kernel = x_BTC.astype(self.dtype), self.kernel[...].astype(self.dtype)
        conv = lambda a, s, prev_a, prev_s, w: short_conv(a, w, s, self.activation, prev_a, prev_s,
                                                          self._backward(*a.shape[1:], w.shape[0]))
        cp = current()
        if cp is None:
            return conv(x, segment_ids_BT, None, None, kernel)
        # sequence split over `context`: the previous block's last K-1 tokens arrive as a halo
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones(x.shape[:2], jnp.int32)
        return context_neighbours(conv, x, segment_ids_BT, kernel, cp=cp, side="previous", width=kernel.shape[0] - 1,
                                  apart=True)
