"""Blockwise (flash) attention in plain jnp: online softmax over key blocks, custom VJP that recomputes.

Forward: a `lax.scan` over key blocks of `block_kv` tokens keeps fp32 running max `m`, normaliser `l`
and output accumulator per query, so the largest live tensor is [B, H, T, block_kv]: O(T) memory for a
fixed block, never [T, T]. Backward recomputes each block's probabilities from the saved log-sum-exp
(no stored probabilities) and accumulates dq in fp32 while emitting dk, dv per block.

Numerics: masked logits are set to the finite MASK_VALUE and masked probabilities to exactly 0, so a
query with no visible key (padding) keeps l = 0 and gets output 0 through a guarded 1/l; its lse is
set to 0 (never used, since all its probabilities are masked).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from lingpack.kernels.attention.masks import MASK_VALUE, allowed


def _pad_to_blocks(k_BHTK, v_BHTV, kv_seg_BT, block: int):
    T = k_BHTK.shape[2]
    n_blocks = -(-T // block)
    pad = n_blocks * block - T
    if pad:  # filler keys get segment 0, which no query can attend
        k_BHTK = jnp.pad(k_BHTK, [(0, 0), (0, 0), (0, pad), (0, 0)])
        v_BHTV = jnp.pad(v_BHTV, [(0, 0), (0, 0), (0, pad), (0, 0)])
        kv_seg_BT = jnp.pad(kv_seg_BT, [(0, 0), (0, pad)])
    B, H, Tp, K = k_BHTK.shape
    blocks = lambda x: jnp.moveaxis(x.reshape(B, H, n_blocks, block, x.shape[-1]), 2, 0)  # [N, B, H, blk, *]
    seg_blocks = jnp.moveaxis(kv_seg_BT.reshape(B, n_blocks, block), 1, 0)                # [N, B, blk]
    index_blocks = jnp.arange(Tp).reshape(n_blocks, block)                                # [N, blk]
    return blocks(k_BHTK), blocks(v_BHTV), seg_blocks, index_blocks


def _block_logits(q_BHTK, k_blk, q_seg, seg_blk, idx_blk, scale, causal):
    s = jnp.einsum("bhqk,bhsk->bhqs", q_BHTK, k_blk) * scale
    mask = allowed(q_seg, seg_blk, jnp.arange(q_BHTK.shape[2]), idx_blk, causal)
    return jnp.where(mask, s, MASK_VALUE), mask


def _forward(q, k, v, seg, scale, causal, block):
    """q,k,v fp32 [B, H, T, *] -> (o [B,H,T,V], lse [B,H,T])."""
    B, H, T, _ = q.shape
    V = v.shape[-1]
    k_b, v_b, seg_b, idx_b = _pad_to_blocks(k, v, seg, block)

    def step(carry, xs):
        m, l, acc = carry
        k_blk, v_blk, seg_blk, idx_blk = xs
        s, mask = _block_logits(q, k_blk, seg, seg_blk, idx_blk, scale, causal)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # masked probabilities are exactly 0
        alpha = jnp.exp(m - m_new)                                # <= 1: finite m, never -inf - -inf
        l = alpha * l + p.sum(-1)
        acc = alpha[..., None] * acc + jnp.einsum("bhqs,bhsv->bhqv", p, v_blk)
        return (m_new, l, acc), None

    init = (jnp.full((B, H, T), MASK_VALUE, jnp.float32), jnp.zeros((B, H, T), jnp.float32),
            jnp.zeros((B, H, T, V), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, (k_b, v_b, seg_b, idx_b))
    nonempty = l > 0
    o = acc / jnp.where(nonempty, l, 1.0)[..., None]   # guarded 1/l: empty rows stay 0
    lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), 0.0)
    return o, lse


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, scale, causal, block):
    return _forward(q, k, v, seg, scale, causal, block)[0]


def _flash_fwd(q, k, v, seg, scale, causal, block):
    o, lse = _forward(q, k, v, seg, scale, causal, block)
    return o, (q, k, v, seg, o, lse)


def _flash_bwd(scale, causal, block, res, do):
    q, k, v, seg, o, lse = res
    T = k.shape[2]
    k_b, v_b, seg_b, idx_b = _pad_to_blocks(k, v, seg, block)
    delta = jnp.sum(do * o, axis=-1)  # D_i = sum_v dO_iv O_iv, the softmax-Jacobian row term

    def step(dq, xs):
        k_blk, v_blk, seg_blk, idx_blk = xs
        s, mask = _block_logits(q, k_blk, seg, seg_blk, idx_blk, scale, causal)
        p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
        dv_blk = jnp.einsum("bhqs,bhqv->bhsv", p, do)
        dp = jnp.einsum("bhqv,bhsv->bhqs", do, v_blk)
        ds = p * (dp - delta[..., None])
        dq = dq + jnp.einsum("bhqs,bhsk->bhqk", ds, k_blk) * scale
        dk_blk = jnp.einsum("bhqs,bhqk->bhsk", ds, q) * scale
        return dq, (dk_blk, dv_blk)

    dq, (dk_b, dv_b) = jax.lax.scan(step, jnp.zeros_like(q), (k_b, v_b, seg_b, idx_b))
    unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(*x.shape[1:3], -1, x.shape[-1])[:, :, :T]
    return dq, unblock(dk_b), unblock(dv_b), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_BTHK, k_BTHK, v_BTHV, *, segment_ids_BT, scale: float, causal: bool = True,
                    block_kv: int = 128):
    if block_kv <= 0:
        raise ValueError(f"block_kv must be positive; got {block_kv}")
    f32 = jnp.float32  # the running max, normaliser and accumulators are fp32 (REFERENCE.md §6)
    to_bhtk = lambda x: jnp.swapaxes(x, 1, 2).astype(f32)
    o = _flash(to_bhtk(q_BTHK), to_bhtk(k_BTHK), to_bhtk(v_BTHV), segment_ids_BT.astype(jnp.int32),
               float(scale), bool(causal), int(min(block_kv, k_BTHK.shape[1])))
    return jnp.swapaxes(o, 1, 2).astype(q_BTHK.dtype)
