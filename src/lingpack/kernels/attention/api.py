"""The one entry point for segment-aware causal attention: `attention(q, k, v, *, segment_ids, impl)`.

Layout `[B, T, H, K]` for q and k, `[B, T, H, V]` for v (V may differ from K, as in MLA); output
`[B, T, H, V]` in q's dtype. The mask (see `masks.py`): causal within equal segment ids, padding
(id 0) attends nowhere and outputs 0. `scale` defaults to K**-0.5.

Implementations (`impl`):
  dot_product  masked [T, T] reference, fp32 softmax (the oracle)
  flash        query x key tiles, online softmax in jnp, fully masked tiles skipped, recomputing VJP: O(T) memory
  splash       the Pallas TPU splash kernel with SegmentIds (interpret mode off-TPU)
"""

from __future__ import annotations

import jax.numpy as jnp

from lingpack.kernels.attention.dot_product import dot_product_attention
from lingpack.kernels.attention.flash import flash_attention

IMPLS = ("dot_product", "flash", "splash")


def attention(q_BTHK, k_BTHK, v_BTHV, *, segment_ids_BT=None, impl: str = "dot_product", scale: float | None = None,
              causal: bool = True, block_size: int = 128, interpret: bool | None = None):
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; valid choices: {list(IMPLS)}")
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
        return flash_attention(q_BTHK, k_BTHK, v_BTHV, block_kv=block_size, **kw)
    if jnp.float64 in (q_BTHK.dtype, k_BTHK.dtype, v_BTHV.dtype):
        raise ValueError("impl='splash' is a TPU kernel computing in fp32 (TPUs have no float64): float64 inputs "
                         "would be rounded; use impl='dot_product' or 'flash'")
    from lingpack.kernels.attention.splash import splash_attention  # Pallas import only when used
    return splash_attention(q_BTHK, k_BTHK, v_BTHV, block=block_size, interpret=interpret, **kw)
