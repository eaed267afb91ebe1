"""The dense reference: the naive KDA recurrence (docs/design.md#kda-recurrence) as a `lax.scan` over time, in fp32
(or float64).

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

The state resets to zero at every segment start (a row's first segment starts from `initial_state`).
Padding tokens (id 0) are no-ops: no decay, no write, output 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lingpack.kernels.kda import segments
from lingpack.precision import at_least_fp32


def reference_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, *, segment_ids_BT, scale, initial_state_BHKV):
    B, T, H, K = q_BTHK.shape
    # the state and every accumulation are fp32 whatever the input dtype (float64 when an input is float64)
    f32 = at_least_fp32(q_BTHK.dtype, k_BTHK.dtype, v_BTHV.dtype, g_BTHK.dtype, beta_BTH.dtype)
    real_BT = segment_ids_BT != 0
    reset_BT = segments.segment_starts(segment_ids_BT).at[:, 0].set(False)  # row starts keep initial_state
    mask = real_BT[..., None, None]
    q = q_BTHK.astype(f32) * scale
    k = jnp.where(mask, k_BTHK.astype(f32), 0.0)
    v = jnp.where(mask, v_BTHV.astype(f32), 0.0)
    g = jnp.where(mask, g_BTHK.astype(f32), 0.0)
    beta = jnp.where(real_BT[..., None], beta_BTH.astype(f32), 0.0)

    def step(state_BHKV, xs):
        q_t, k_t, v_t, g_t, beta_t, reset_t = xs
        state_BHKV = jnp.where(reset_t[:, None, None, None], 0.0, state_BHKV)
        state_BHKV = state_BHKV * jnp.exp(g_t)[..., None]
        predicted_BHV = jnp.einsum("bhk,bhkv->bhv", k_t, state_BHKV)
        state_BHKV = state_BHKV + jnp.einsum("bhk,bhv->bhkv", beta_t[..., None] * k_t, v_t - predicted_BHV)
        return state_BHKV, jnp.einsum("bhk,bhkv->bhv", q_t, state_BHKV)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset_BT)]
    final_BHKV, o_TBHV = jax.lax.scan(step, initial_state_BHKV.astype(f32), time_major)
    o_BTHV = jnp.where(mask, jnp.moveaxis(o_TBHV, 0, 1), 0.0)
    return o_BTHV, final_BHKV
