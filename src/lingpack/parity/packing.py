"""Packing parity, the core promise: a packed batch's loss equals each document run alone.

Every document of a real batch is moved to the start of its own row (padding after it, positions kept),
the whole set runs as one batch, and the token-weighted loss is compared with the packed batch's (both padded
with empty rows to one shape, so one jitted forward serves both).
Documents the kernel has no slot for (more than its max_segs in a micro-batch) are left out of both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingpack.precision import at_least_fp32


def unpack_documents(batch: dict) -> dict:
    """One row per document (segment) of `batch`, left-aligned, the rest padding (segment 0)."""
    rows = []
    seg = np.asarray(batch["inputs_segmentation"])
    for b in range(seg.shape[0]):
        for s in np.unique(seg[b][seg[b] > 0]):
            rows.append((b, np.nonzero(seg[b] == s)[0]))
    T = seg.shape[1]
    out = {key: np.zeros((len(rows), T), np.int32) for key in batch}
    for r, (b, idx) in enumerate(rows):
        for key in batch:
            out[key][r, :len(idx)] = np.asarray(batch[key])[b, idx]
        out["inputs_segmentation"][r, :len(idx)] = 1
        out["targets_segmentation"][r, :len(idx)] = np.asarray(batch["targets_segmentation"])[b, idx] != 0
    return out


def pad_rows(batch: dict, rows: int) -> dict:
    """`batch` with all-padding rows (segment 0, no loss) appended up to `rows` rows."""
    return {k: np.pad(np.asarray(v), ((0, rows - np.asarray(v).shape[0]), (0, 0))) for k, v in batch.items()}


@nnx.jit
def _masked_xent(model, inputs, segmentation, position, targets, targets_segmentation):
    out = model(inputs, segmentation, position)
    log_probs = jax.nn.log_softmax(out.logits_BTV.astype(at_least_fp32(out.logits_BTV.dtype)), axis=-1)
    xent = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    mask = targets_segmentation != 0
    return jnp.sum(jnp.where(mask, xent, 0.0)), jnp.sum(mask)


def token_weighted_loss(model, batch: dict) -> tuple[float, float]:
    """(sum of masked token cross-entropies, number of loss tokens) of the main head, in fp32 or the logits'
    wider dtype (one jitted forward per batch shape)."""
    keys = ("inputs", "inputs_segmentation", "inputs_position", "targets", "targets_segmentation")
    total, count = _masked_xent(model, *(jnp.asarray(batch[k]) for k in keys))
    return float(total), float(count)


def packing_parity(model, batch: dict, *, micro_batches: int = 1) -> dict:
    """Relative difference between the packed loss and the per-document (unpacked) loss of `batch`.

    The batch is split into `micro_batches` like a train step; documents that do not fit the kernel's
    max_segs slots of their micro-batch are dropped first, as training drops them (`train.step.drop_overflow`),
    and only the documents that train are compared. Each micro-batch's documents run alone as one batch.
    """
    from lingpack.train.step import drop_overflow, kernel_max_segs
    B = np.asarray(batch["inputs"]).shape[0]
    if B % micro_batches:
        raise ValueError(f"a batch of {B} rows does not split into micro_batches={micro_batches}")
    micro = {k: jnp.asarray(v).reshape(micro_batches, B // micro_batches, -1) for k, v in batch.items()}
    kept, dropped = drop_overflow(micro, kernel_max_segs(getattr(model, "cfg", None)))
    micro_kept = [{k: np.asarray(v[m]) for k, v in kept.items()} for m in range(micro_batches)]
    micro_alone = [unpack_documents(mb) for mb in micro_kept]
    rows = max(B // micro_batches, *(a["inputs"].shape[0] for a in micro_alone))  # one shape: one compile
    packed_sum = packed_count = alone_sum = alone_count = 0.0
    documents = 0
    for mb, alone_batch in zip(micro_kept, micro_alone):
        s, c = token_weighted_loss(model, pad_rows(mb, rows))
        packed_sum, packed_count = packed_sum + s, packed_count + c
        s, c = token_weighted_loss(model, pad_rows(alone_batch, rows))
        alone_sum, alone_count = alone_sum + s, alone_count + c
        documents += alone_batch["inputs"].shape[0]
    if packed_count != alone_count:
        raise AssertionError(f"loss tokens differ after unpacking: {packed_count} vs {alone_count}")
    packed, alone = packed_sum / packed_count, alone_sum / alone_count
    return {"packed_loss": packed, "per_document_loss": alone, "rel_diff": abs(packed - alone) / abs(alone),
            "documents": documents, **{k: int(v) for k, v in dropped.items()}}
