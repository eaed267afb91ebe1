"""The Pallas TPU splash-attention kernel with `SegmentIds`; interpret mode only on CPU or when asked.

Splash masks pairs whose segment ids differ; we add the causal mask statically. It does not scale q,
so q is pre-multiplied by `scale`. T is padded up to a multiple of `block` (the kernel's tile) with
segment 0 tokens; padding queries (segment 0) see only padding keys there, and their outputs are
zeroed afterwards so the shared mask contract holds (padding output is 0).

On a sharded mesh the kernel runs per shard (`kernels/shard.py`: rows over `data, fsdp, expert`, heads
over `tensor`; XLA cannot partition a Mosaic call), so each shard builds its multi-head mask for its
local head count. Under context parallelism the ring calls the tile functions below once per ring step
(parallel/ring_splash.py) inside its own shard_map.

JAX's splash kernels declare no `pl.CostEstimate` (XLA:TPU's cost analysis counts them as zero FLOPs);
`cost_estimates` is lingpack's, analytic from the tiles the static mask (causal, or a ring step's full tile)
leaves computed, for each of the three kernels a training step runs (forward, dq, dkv), keyed by their names.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from lingpack import backend
from lingpack.kernels import shard

TILE = shard.Dims(rows=0, heads=2)   # q, k [B, T, H, K]; v, o [B, T, H, V]


@functools.lru_cache(maxsize=32)
def _kernel(num_heads: int, seq_len: int, block: int, causal: bool, interpret: bool, kv_len: int | None = None,
            residuals: bool = False, residual_name: str | None = None, k_seq_minor: bool = False):
    """The kernel of a [seq_len, kv_len] mask (kv_len None: square); `residuals`: its forward also returns lse;
    `residual_name`: the name its VJP's kept output and logsumexp carry (blockwise.name_residuals);
    `k_seq_minor`: the kernels read k as [H, K, S] (the caller still passes [H, S, K]; XLA transposes)."""
    shape = (seq_len, kv_len or seq_len)
    base = splash_mask.CausalMask(shape) if causal else splash_mask.FullMask(shape)
    mask = splash_mask.MultiHeadMask([base] * num_heads)
    sizes = splash_kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                     block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                     block_kv_dq=block, k_layout=splash_kernel.QKVLayout.SEQ_MINOR if k_seq_minor
                                     else splash_kernel.QKVLayout.HEAD_DIM_MINOR)
    with jax.ensure_compile_time_eval():  # mask metadata must be concrete: the kernel is cached across traces
        return splash_kernel.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                             save_residuals=residuals, interpret=interpret,
                                             residual_checkpoint_name=residual_name)


def tile_forward(q_HQK, k_HSK, v_HSV, q_seg_Q, kv_seg_S, *, causal: bool, block: int, interpret: bool,
                 k_seq_minor: bool = False):
    """(o [H,Q,V] in q's dtype, lse [H,Q] fp32) of one row's tile, q pre-scaled; causal only for Q == S.

    A query whose keys in the tile are all masked gets lse near the mask value (about -2.4e38) and the mean
    of v: combined with any real tile its weight exp(lse - lse_total) is exactly 0.
    """
    H, Q, _ = q_HQK.shape
    kernel = _kernel(H, Q, block, causal, interpret, k_HSK.shape[1], True, k_seq_minor=k_seq_minor)
    o, (lse,) = kernel(q_HQK, k_HSK, v_HSV, segment_ids=splash_kernel.SegmentIds(q=q_seg_Q, kv=kv_seg_S))
    return o, lse


def tile_backward(q_HQK, k_HSK, v_HSV, q_seg_Q, kv_seg_S, lse_HQ, do_HQV, di_HQ, *, causal: bool, block: int,
                  interpret: bool, k_seq_minor: bool = False):
    """(dq, dk, dv) in the inputs' dtypes of one tile given the whole row's lse and di = sum(o * do) (not the
    tile's own; do in q's dtype): probabilities exp(s - lse) and the row term di are then the row's, so the
    tile's gradients are its exact share of the row's. Splash's own backward kernels (dkv, dq), called with
    those residuals; di comes in so that a ring forms it once per row, not once per step."""
    H, Q, _ = q_HQK.shape
    kernel = _kernel(H, Q, block, causal, interpret, k_HSK.shape[1], True, k_seq_minor=k_seq_minor)
    kw, sizes = kernel.kwargs, kernel.kwargs["block_sizes"]
    common = dict(is_mqa=kw["is_mqa"], mask_value=kw["mask_value"], attn_logits_soft_cap=kw["attn_logits_soft_cap"],
                  q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout,
                  mask_function=kw["mask_function"], interpret=kw["interpret"])
    args = (q_HQK, k_HSK, v_HSV, splash_kernel.SegmentIds(q=q_seg_Q, kv=kv_seg_S), None, lse_HQ, do_HQV, di_HQ)
    _, dk, dv = splash_kernel._splash_attention_bwd_dkv(
        *args, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv, bkv_compute=sizes.block_kv_dkv_compute,
        mask_info=kernel.dkv_mask_info, use_fused_bwd_kernel=False, **common)
    dq = splash_kernel._splash_attention_bwd_dq(*args, bq=sizes.block_q_dq, bkv=sizes.block_kv_dq,
                                                mask_info=kernel.dq_mask_info, **common)
    return dq, dk, dv


def computed_tiles(seq_len: int, block: int, causal: bool, kv_len: int | None = None) -> int:
    """block x block tiles of one head that the kernels compute: the static mask's nonzero tiles (segment ids
    mask inside a tile, they skip none). `kv_len`: the keys' length where it differs (a full mask)."""
    n = -(-seq_len // block)
    return n * (n + 1) // 2 if causal else n * -(-(kv_len or seq_len) // block)


LANES = 128   # the forward's logsumexp residual is stored lane-broadcast, [T, 128] fp32


def cost_estimates(B: int, H: int, T: int, K: int, V: int, *, block: int, causal: bool = True,
                   itemsize: int = 2, S: int | None = None) -> dict[str, pl.CostEstimate]:
    """{kernel name prefix: cost} of the forward, dq and dkv kernels at [B, T, H, K] (v: V), T padded to `block`;
    `S`: the keys' length where it differs from T (a ring step's full tile, ring_splash.py).

    Per computed tile: forward s = q k^T and o += p v (2 b^2 (K + V)); dq recomputes s, forms dp = do v^T and
    dq = ds k (2 b^2 (2K + V)); dkv recomputes s, dv = p^T do, dp, dk = ds^T q (2 b^2 (2K + 2V)); one exp per
    score in each. Bytes: the operand tiles each kernel streams per computed tile, the resident ones once."""
    t_pad = -(-T // block) * block
    tiles = computed_tiles(t_pad, block, causal, S)
    pairs = B * H * tiles * block * block                    # scores computed
    streamed = B * H * tiles * block * itemsize              # bytes per unit width per tile
    once = B * H * t_pad * itemsize                                            # bytes per unit width, whole T
    lse = B * H * t_pad * LANES * 4
    cost = lambda flops, nbytes: pl.CostEstimate(flops=int(flops), transcendentals=int(pairs),
                                                 bytes_accessed=int(nbytes))
    return {"splash_mha_fwd": cost(2 * pairs * (K + V), once * (K + V) + streamed * (K + V) + lse),
            "splash_mha_dq": cost(2 * pairs * (2 * K + V), once * (2 * K + V) + streamed * (K + V) + lse),
            "splash_mha_dkv": cost(2 * pairs * (2 * K + 2 * V), once * 2 * (K + V) + streamed * (K + V) + lse)}


def splash_local(q_BTHK, k_BTHK, v_BTHV, *, segment_ids_BT, scale: float, causal: bool, block: int,
                 interpret: bool, residual_name: str | None = None):
    """The kernel on the arrays it is given (one shard's rows and heads, or everything off a mesh)."""
    B, T, H, K = q_BTHK.shape
    t_pad = -(-T // block) * block
    pad = t_pad - T
    seg = segment_ids_BT.astype(jnp.int32)
    to_bhtk = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), [(0, 0), (0, 0), (0, pad), (0, 0)])
    q = to_bhtk(q_BTHK * jnp.asarray(scale, q_BTHK.dtype))
    k, v = to_bhtk(k_BTHK), to_bhtk(v_BTHV)
    seg = jnp.pad(seg, [(0, 0), (0, pad)])
    kernel = _kernel(H, t_pad, block, bool(causal), bool(interpret), residual_name=residual_name)
    run = lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash_kernel.SegmentIds(q=s1, kv=s1))
    o_BHTV = jax.vmap(run)(q, k, v, seg)
    o_BTHV = jnp.swapaxes(o_BHTV, 1, 2)[:, :T]
    return jnp.where((segment_ids_BT != 0)[..., None, None], o_BTHV, 0).astype(q_BTHK.dtype)


splash_on_mesh = shard.over_mesh(splash_local, args=(TILE, TILE, TILE), kwargs={"segment_ids_BT": shard.Dims(rows=0)},
                                 out=TILE, kernel="splash attention")


def resolve_interpret(interpret: bool | None) -> bool:
    """Whether splash runs in Pallas interpret mode (backend.pallas_interpret: asked for, or on a CPU host)."""
    return backend.pallas_interpret(
        interpret, kernel="splash attention", alternative="model.attention_impl=auto (pallas_triton)",
        emulate="pass interpret=True to lingpack.kernels.attention.api.attention to emulate it",
        cpu_alternative="model.attention_impl=auto (flash on CPU)")


def splash_attention(q_BTHK, k_BTHK, v_BTHV, *, segment_ids_BT, scale: float, causal: bool = True,
                     block: int = 128, interpret: bool | None = None, residual_name: str | None = None):
    interpret = resolve_interpret(interpret)
    return splash_on_mesh(q_BTHK, k_BTHK, v_BTHV, segment_ids_BT=segment_ids_BT, scale=float(scale),
                          causal=bool(causal), block=int(block), interpret=bool(interpret),
                          residual_name=residual_name)
