"""Flash attention in plain jnp: query x key tiles with online softmax, fully masked tiles skipped.

The tile math, the skip test and the recomputing custom VJP are `blockwise.py`'s (the same core the
context-parallel strategies run), here on one device with every query against every key of its row:
a tile is computed only if some row has a document on both sides of it and, causally, a key not after
every query (`blockwise.tile_visible`); a skipped tile contributes exact zeros, so skipping changes no
number. Memory is O(T) for fixed blocks (the largest live tensor is one [B, H, block, block] tile).

Numerics (docs/design.md#blockwise-softmax-attention): fp32 (float64 for float64 inputs) running max,
normaliser, accumulators and gradients; masked logits are the finite MASK_VALUE and masked probabilities exactly 0;
padding queries output 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lingpack.kernels.attention.blockwise import Tiling, blockwise_attention, tile_visible
from lingpack.precision import at_least_fp32


def _block(T: int, block: int) -> int:
    if block <= 0:
        raise ValueError(f"block_kv must be positive; got {block}")
    return min(block, T)


def _pad(x, n: int, axis: int):
    """Filler tokens at the end of `axis` (segment 0: they attend nowhere and nothing attends them)."""
    return jnp.pad(x, [(0, 0)] * axis + [(0, n)] + [(0, 0)] * (x.ndim - axis - 1)) if n else x


def flash_attention(q_BTHK, k_BTHK, v_BTHV, *, segment_ids_BT, scale: float, causal: bool = True,
                    block_kv: int = 128, residual_name: str | None = None):
    T = q_BTHK.shape[1]
    block = _block(T, block_kv)
    pad = -T % block
    wide = at_least_fp32(q_BTHK.dtype, k_BTHK.dtype, v_BTHV.dtype)  # fp32 (or float64) accumulation (§6)
    to_bhtk = lambda x: _pad(jnp.swapaxes(x, 1, 2).astype(wide), pad, 2)
    seg = _pad(segment_ids_BT.astype(jnp.int32), pad, 1)
    index = jnp.arange(T + pad)
    o = blockwise_attention(to_bhtk(q_BTHK), to_bhtk(k_BTHK), to_bhtk(v_BTHV), seg, seg, index, index,
                            Tiling(float(scale), bool(causal), block, block, residual_name))
    return jnp.swapaxes(o[:, :, :T], 1, 2).astype(q_BTHK.dtype)


def tile_counts(segment_ids_BT, *, block: int = 128, causal: bool = True) -> tuple[int, int]:
    """(computed, total) query x key tiles of `flash_attention` on these segment ids (the rest are skipped)."""
    seg = np.asarray(segment_ids_BT, np.int32)
    T = seg.shape[1]
    block = _block(T, block)
    seg = np.pad(seg, [(0, 0), (0, -T % block)])
    n = seg.shape[1] // block
    seg_blocks = jnp.asarray(seg.reshape(seg.shape[0], n, block).transpose(1, 0, 2))   # [n, B, block]
    index_blocks = jnp.arange(n * block).reshape(n, block)
    visible = jax.vmap(lambda qs, qi: jax.vmap(lambda ks, ki: tile_visible(qs, ks, qi, ki, causal))(
        seg_blocks, index_blocks))(seg_blocks, index_blocks)
    return int(jnp.sum(visible)), n * n
