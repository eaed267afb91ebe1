"""Segment-aware causal attention on NVIDIA GPUs: JAX's Pallas flash-attention kernel, lowered to Triton.

`jax.experimental.pallas.ops.gpu.attention.mha` takes `segment_ids [B, T]` (a pair attends iff the ids are
equal) and `causal`, which is exactly the packed mask of `masks.py`, and has a fused Triton backward
(dq, dk, dv). It lowers to `__gpu$xla.gpu.triton` custom calls, so a CPU host can export it for CUDA, and
it runs in Pallas interpret mode on CPU for tests. docs/kernels.md says why it was chosen over cuDNN's
fused attention.

The kernel's constraints, and what this wrapper does about them:
  one head width for q, k and v   MLA's v (128) is narrower than q/k (192): v is zero-padded to q's width
                                  and the output sliced back (zero columns of v only produce zero columns)
  width padded to a power of two  inside the kernel (192 -> 256, masked loads); the tiles below fit that
  T a multiple of every tile      T is padded with segment-0 tokens, which attend only each other
  padding (id 0) attends id 0     padding outputs are zeroed afterwards (the shared mask contract)
Fully masked tiles between documents are computed (only the causal upper triangle is skipped), unlike
`flash`, which skips them. On a sharded mesh the kernel runs per shard (`kernels/shard.py`: rows over
`data, fsdp, expert`, heads over `tensor`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.gpu import attention as triton_attention

from lingpack import backend
from lingpack.kernels import shard

TILE = shard.Dims(rows=0, heads=2)   # q, k [B, T, H, K]; v, o [B, T, H, V]


def block_sizes(head_dim: int) -> triton_attention.BlockSizes:
    """Tiles for a head width: JAX's defaults (forward 128 x 128, backward 32) below a padded width of 256.
    At 256 (MLA's 192) the forward's pipelined k and v tiles alone would take 2 stages x 2 x 128 x 256 bf16
    = 256 KiB, over the 227 KiB of shared memory an H100/H200 block may use (an estimate from the tile
    shapes, not a compile on a GPU), so the forward tiles halve to 64."""
    forward = 128 if pl.next_power_of_2(head_dim) < 256 else 64
    return triton_attention.BlockSizes(block_q=forward, block_k=forward, block_q_dkv=32, block_kv_dkv=32,
                                       block_q_dq=32, block_kv_dq=32)


def triton_local(q_BTHK, k_BTHK, v_BTHV, *, segment_ids_BT, scale: float, causal: bool, interpret: bool):
    """The kernel on the arrays it is given (one shard's rows and heads, or everything off a mesh)."""
    T, K, V = q_BTHK.shape[1], q_BTHK.shape[-1], v_BTHV.shape[-1]
    width = max(K, V)
    sizes = block_sizes(width)
    tile = max(sizes.block_q, sizes.block_k, sizes.block_q_dkv, sizes.block_kv_dkv, sizes.block_q_dq,
               sizes.block_kv_dq)
    pad_T = -T % tile
    pad = lambda x: jnp.pad(x, [(0, 0), (0, pad_T), (0, 0), (0, width - x.shape[-1])])
    seg = jnp.pad(segment_ids_BT.astype(jnp.int32), [(0, 0), (0, pad_T)])   # filler: segment 0
    o_BTHW = triton_attention.mha(pad(q_BTHK), pad(k_BTHK), pad(v_BTHV.astype(q_BTHK.dtype)), seg,
                                  sm_scale=scale, causal=causal, block_sizes=sizes, interpret=interpret)
    o_BTHV = o_BTHW[:, :T, :, :V]
    return jnp.where((segment_ids_BT != 0)[..., None, None], o_BTHV, 0).astype(q_BTHK.dtype)


# XLA cannot partition a Triton custom call either (it would gather every row onto every device): per shard
triton_on_mesh = shard.over_mesh(triton_local, args=(TILE, TILE, TILE), kwargs={"segment_ids_BT": shard.Dims(rows=0)},
                                 out=TILE, kernel="pallas_triton attention")


def triton_flash_attention(q_BTHK, k_BTHK, v_BTHV, *, segment_ids_BT, scale: float, causal: bool = True,
                           interpret: bool | None = None):
    interpret = backend.pallas_interpret(
        interpret, kernel="pallas_triton attention", native="gpu",
        alternative="model.attention_impl=auto (splash on TPU)",
        emulate="pass interpret=True to lingpack.kernels.attention.api.attention to emulate it",
        cpu_alternative="model.attention_impl=auto (flash on CPU)")
    return triton_on_mesh(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT=segment_ids_BT, scale=float(scale),
                          causal=bool(causal), interpret=bool(interpret))
