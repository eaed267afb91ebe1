"""The attention mask every implementation shares: causal within a segment, padding attends nowhere.

Query i may attend key j iff  seg[i] == seg[j]  and  seg[i] != 0  and (not causal or j <= i).
Token order inside a row is the causal order (packed documents are contiguous), so the mask needs
no positions. Rows with no allowed key (padding queries) produce output 0, never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Finite mask value: `-inf - -inf` never happens and softmax stays NaN-free on empty rows (splash's choice). A format:
# fp32's, also in float64 logits (any finite value far below every real logit masks exactly: exp underflows to 0).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def allowed(q_seg_BQ: jax.Array, kv_seg_BK: jax.Array, q_index_Q: jax.Array, kv_index_K: jax.Array,
            causal: bool) -> jax.Array:
    """bool [B, 1, Q, K]: which (query, key) pairs may interact (head axis broadcast)."""
    ok = (q_seg_BQ[:, :, None] == kv_seg_BK[:, None, :]) & (q_seg_BQ[:, :, None] != 0)
    if causal:
        ok = ok & (kv_index_K[None, None, :] <= q_index_Q[None, :, None])
    return ok[:, None]
