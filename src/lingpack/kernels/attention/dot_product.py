"""Masked reference attention: materialises the [T, T] logits; fp32 (or float64) softmax; the oracle for the others."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lingpack.kernels.attention.masks import MASK_VALUE, allowed
from lingpack.precision import at_least_fp32


def dot_product_attention(q_BTHK, k_BTHK, v_BTHV, *, segment_ids_BT, scale: float, causal: bool = True):
    B, T, H, K = q_BTHK.shape
    # logits and softmax in fp32 (float64 for float64 inputs): bf16 logits lose the max-subtraction's precision
    f32 = at_least_fp32(q_BTHK.dtype, k_BTHK.dtype, v_BTHV.dtype)
    logits = jnp.einsum("bqhk,bshk->bhqs", q_BTHK.astype(f32), k_BTHK.astype(f32)) * scale
    index = jnp.arange(T)
    mask = allowed(segment_ids_BT, segment_ids_BT, index, index, causal)
    logits = jnp.where(mask, logits, MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1)
    weights = jnp.where(mask, weights, 0.0)  # empty rows would be uniform over masked keys: zero them
    o = jnp.einsum("bhqs,bshv->bqhv", weights, v_BTHV.astype(f32))
    return o.astype(q_BTHK.dtype)
