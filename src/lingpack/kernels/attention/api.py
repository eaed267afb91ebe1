"""The one entry point for segment-aware causal attention: `attention(q, k, v, *, segment_ids, impl)`.

Layout `[B, T, H, K]` for q and k, `[B, T, H, V]` for v (V may differ from K, as in MLA); output
`[B, T, H, V]` in q's dtype. The mask (see `masks.py`): causal within equal segment ids, padding
(id 0) attends nowhere and outputs 0. `scale` defaults to K**-0.5.

Implementations (`impl`):
  dot_product    masked [T, T] reference, fp32 softmax (the oracle)
  flash          query x key tiles, online softmax in jnp, fully masked tiles skipped, recomputing VJP: O(T) memory
  splash         the Pallas TPU splash kernel with SegmentIds (Mosaic on TPU; interpret mode on CPU)
  pallas_triton  JAX's Pallas GPU flash-attention kernel with segment ids (Triton on GPU; interpret mode on CPU)
  auto           the platform's kernel (`AUTO`), read from the backend target at trace time; flash for float64
                 inputs on every platform (the Pallas kernels compute in fp32)
A Pallas kernel traced for the other accelerator is a ConfigError naming `auto`. `block_size` is the tile
of flash and splash; pallas_triton picks its tiles from the head width (`pallas_triton.block_sizes`).
`residual_name`: flash and splash (`NAMES_RESIDUALS`) name the output and logsumexp their VJP keeps, so that
a remat policy keeping that name does not rerun the forward in the backward pass (models/remat.py, `context`).
"""

from __future__ import annotations

import jax.numpy as jnp

from lingpack import backend
from lingpack.kernels.attention.dot_product import dot_product_attention
from lingpack.kernels.attention.flash import flash_attention

IMPLS = ("dot_product", "flash", "splash", "pallas_triton")
AUTO = {"tpu": "splash", "gpu": "pallas_triton", "cpu": "flash"}   # docs/kernels.md: why each
CHOICES = ("auto",) + IMPLS
FP32_KERNELS = ("splash", "pallas_triton")   # Pallas kernels with fp32 accumulators: no float64 inputs
NAMES_RESIDUALS = ("flash", "splash")        # their VJP's kept (o, lse) carry `residual_name`


def resolve(impl: str, dtype=None) -> str:
    """The implementation `impl` runs as on the platform being traced for (`auto` -> `AUTO[platform]`, or flash
    for float64 inputs: `dtype`)."""
    if impl not in CHOICES:
        raise ValueError(f"unknown attention impl {impl!r}; valid choices: {list(CHOICES)}")
    if impl == "auto" and dtype is not None and jnp.dtype(dtype) == jnp.float64:
        return "flash"
    return AUTO[backend.current()] if impl == "auto" else impl


def attention(q_BTHK, k_BTHK, v_BTHV, *, segment_ids_BT=None, impl: str = "dot_product", scale: float | None = None,
              causal: bool = True, block_size: int = 128, interpret: bool | None = None,
              residual_name: str | None = None):
    impl = resolve(impl, jnp.result_type(q_BTHK, k_BTHK, v_BTHV))
    B, T, H, K = q_BTHK.shape
    if k_BTHK.shape != (B, T, H, K):
        raise ValueError(f"k must have q's shape {q_BTHK.shape}; got {k_BTHK.shape}")
    if v_BTHV.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = ({B}, {T}, {H}, V); got {v_BTHV.shape}")
    if segment_ids_BT is None:
        segment_ids_BT = jnp.ones((B, T), jnp.int32)
    elif segment_ids_BT.shape != (B, T):
        raise ValueError(f"segment_ids must have shape (B, T) = {(B, T)}; got {segment_ids_BT.shape}")
    scale = K ** -0.5 if scale is None else scale
    kw = dict(segment_ids_BT=segment_ids_BT, scale=scale, causal=causal)
    if impl == "dot_product":
        return dot_product_attention(q_BTHK, k_BTHK, v_BTHV, **kw)
    if impl == "flash":
        return flash_attention(q_BTHK, k_BTHK, v_BTHV, block_kv=block_size, residual_name=residual_name, **kw)
    if impl in FP32_KERNELS and jnp.float64 in (q_BTHK.dtype, k_BTHK.dtype, v_BTHV.dtype):
        raise ValueError(f"impl={impl!r} is a Pallas kernel computing in fp32: float64 inputs would be rounded; use "
                         "impl='dot_product', 'flash' or 'auto'")
    if impl == "pallas_triton":
        from lingpack.kernels.attention.pallas_triton import triton_flash_attention  # Pallas import only when used
        return triton_flash_attention(q_BTHK, k_BTHK, v_BTHV, interpret=interpret, **kw)
    from lingpack.kernels.attention.splash import splash_attention  # Pallas import only when used
    return splash_attention(q_BTHK, k_BTHK, v_BTHV, block=block_size, interpret=interpret,
                            residual_name=residual_name, **kw)
