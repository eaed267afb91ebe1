"""Multi-token prediction (DeepSeek-V3 MTP) made exact under packing.

Alignment (0-indexed depth d = 0 .. mtp_num_layers-1):
  `mtp_logits[d][b, t]` predicts `targets[b, t + 1 + d]` (input token t + 2 + d): the main head at t
  predicts targets[t]; MTP depth d looks d + 1 tokens further. Use `mtp_targets(...)` for the matching
  targets and mask, which are 0 wherever t + 1 + d leaves t's document, the row, or hits padding.

Depth d's layer at position t combines the previous depth's hidden state at t (the main model's final
hidden state, before the final norm, for d = 0) with the embedding of input token t + 1 + d
(the input embeddings rolled by `roll_and_mask_by_segment` d + 1 times: a zero vector where masked):
    h_d = block(eh_proj([enorm(rolled_embeddings), hnorm(h_{d-1})]))
then the shared final norm and output head. The block is an MLA layer (dense or MoE ffn) that attends
with the UN-rolled segment ids and positions, so no document sees another.

Loss (docs/design.md#mtp; train/loss.py computes it):
    for each d: tgt, mask = mtp_targets(targets, targets_segmentation, d, segment_ids=inputs_segmentation)
               L_d = sum(xent(mtp_logits[d], tgt) * mask) / sum(mask)      (each depth its own count)
    mtp_loss = scale * mean_d L_d               (scale = LossConfig.mtp_loss_scale, 0.1)
`mtp_loss_terms` returns the per-depth (sum, count) pairs for token-weighted reduction across batches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from lingpack.models.block import DecoderLayer, LayerSpec
from lingpack.models.layers import RMSNorm, dense
from lingpack.parallel.context import current
from lingpack.parallel.halo import context_neighbours
from lingpack.precision import at_least_fp32


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    use_moe: bool = True     # the MTP layer's ffn: MoE (DeepSeek-V3, Ling3) or dense SwiGLU


def roll_and_mask_by_segment(x_BT: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    """Shift left by one along T; position t becomes 0 if seg[t] != seg[t+1], seg[t] == 0, or t is last.

    `x` is [B, T] or [B, T, ...] (e.g. embeddings [B, T, D]: masked positions become zero vectors).
    Under context parallelism each block's last position reads the next block's first token (parallel/halo.py).
    """
    cp = current()
    if cp is None:
        return _roll_and_mask(x_BT, segment_ids_BT)
    return context_neighbours(_roll_and_mask, x_BT, segment_ids_BT, cp=cp, side="next", width=1)


def _roll_and_mask(x_BT: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    rolled = jnp.concatenate([x_BT[:, 1:], jnp.zeros_like(x_BT[:, :1])], axis=1)
    same = (segment_ids_BT[:, :-1] == segment_ids_BT[:, 1:]) & (segment_ids_BT[:, :-1] != 0)
    valid = jnp.concatenate([same, jnp.zeros_like(same[:, :1])], axis=1)
    valid = valid.reshape(valid.shape + (1,) * (x_BT.ndim - 2))
    return jnp.where(valid, rolled, jnp.zeros_like(rolled))


def mtp_targets(targets_BT: jax.Array, targets_segmentation_BT: jax.Array, depth: int,
                segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(targets [B,T] int32, mask [B,T] fp32 (0/1: a format)) for MTP depth `depth` (0-indexed): targets[t + 1 + depth].

    The mask is the rolled loss mask (`targets_segmentation != 0`), zeroed where the roll leaves the
    document. Pass `segment_ids_BT` = inputs_segmentation (documents); without it the rolls use
    `targets_segmentation` itself, which also drops positions next to masked tokens.
    """
    if depth < 0:
        raise ValueError(f"MTP depth is 0-indexed and non-negative; got {depth}")
    seg = targets_segmentation_BT if segment_ids_BT is None else segment_ids_BT
    tgt, mask = targets_BT, (targets_segmentation_BT != 0).astype(jnp.int32)
    for _ in range(depth + 1):
        tgt, mask = roll_and_mask_by_segment(tgt, seg), roll_and_mask_by_segment(mask, seg)
    return tgt.astype(jnp.int32), mask.astype(jnp.float32)


def mtp_loss_terms(mtp_logits: list, targets_BT, targets_segmentation_BT, segment_ids_BT=None):
    """[(sum of masked fp32 (or float64) cross-entropy, token count)] per depth."""
    terms = []
    for d, logits_BTV in enumerate(mtp_logits):
        tgt, mask = mtp_targets(targets_BT, targets_segmentation_BT, d, segment_ids_BT)
        # fp32 (or wider): log-probs of a large vocab
        logp = jax.nn.log_softmax(logits_BTV.astype(at_least_fp32(logits_BTV.dtype)), axis=-1)
        xent = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
        terms.append((jnp.sum(xent * mask), jnp.sum(mask)))
    return terms


class MTPLayer(nnx.Module):
    def __init__(self, spec: LayerSpec, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if spec.mixer != "mla":
            raise ValueError(f"MTP layers are MLA layers; got mixer={spec.mixer!r}")
        D = spec.emb_dim
        self.enorm = RMSNorm(D, eps=spec.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.hnorm = RMSNorm(D, eps=spec.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.eh_proj = dense(2 * D, D, (None, "embed"), dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.block = DecoderLayer(spec, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, h_prev_BTD, rolled_emb_BTD, segment_ids_BT, positions_BT):
        x = self.eh_proj(jnp.concatenate([self.enorm(rolled_emb_BTD), self.hnorm(h_prev_BTD)], axis=-1))
        return self.block(x, segment_ids_BT, positions_BT)
