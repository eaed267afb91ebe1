"""Packing parity, the core promise: a packed batch's loss equals each document run alone.

Every document of a real batch is moved to the start of its own row (padding after it, positions kept),
the whole set runs as one batch, and the token-weighted loss is compared with the packed batch's (both padded
with empty rows to one shape, so one jitted forward serves both).
Documents the kernel has no slot for (more than its max_segs in a micro-batch) are left out of both.

Both losses are exact sums (`math.fsum`) of the same tokens' fp32 cross-entropies, so the two layouts'
summation orders do not enter: what differs is each token's own value. That is bitwise equal only where
every reduction of the forward sees the token's document in the same grouping, which packing cannot give:
the segment-native chunked KDA cuts a document at other chunk boundaries than alone (its state and in-chunk
products round differently), and reductions over the row's length (attention, for one) sum the other
documents' exact zeros at other places. A few fp32 rounding steps per token remain (docs/parity.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingpack.precision import at_least_fp32


def _documents(batch: dict) -> list[tuple[int, np.ndarray]]:
    """(row, token indices) of every document (segment) of `batch`, row by row, in segment order."""
    seg = np.asarray(batch["inputs_segmentation"])
    return [(b, np.nonzero(seg[b] == s)[0]) for b in range(seg.shape[0]) for s in np.unique(seg[b][seg[b] > 0])]


def unpack_documents(batch: dict) -> dict:
    """One row per document (segment) of `batch`, left-aligned, the rest padding (segment 0)."""
    rows = _documents(batch)
    T = np.asarray(batch["inputs_segmentation"]).shape[1]
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
def _token_xent(model, inputs, segmentation, position, targets):
    out = model(inputs, segmentation, position)
    log_probs = jax.nn.log_softmax(out.logits_BTV.astype(at_least_fp32(out.logits_BTV.dtype)), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


def token_losses(model, batch: dict) -> np.ndarray:
    """[rows, T] cross-entropy of every token of the main head, in fp32 or the logits' wider dtype (one jitted
    forward per batch shape); padding and unmasked tokens included."""
    keys = ("inputs", "inputs_segmentation", "inputs_position", "targets")
    return np.asarray(_token_xent(model, *(jnp.asarray(batch[k]) for k in keys)))


def token_weighted_loss(model, batch: dict) -> tuple[float, float]:
    """(exact sum of the masked token cross-entropies, number of loss tokens) of the main head."""
    mask = np.asarray(batch["targets_segmentation"]) != 0
    return math.fsum(token_losses(model, batch)[mask].astype(np.float64)), float(mask.sum())


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
    packed_tokens, alone_tokens, documents = [], [], 0
    for mb, alone_batch in zip(micro_kept, micro_alone):
        packed_x, alone_x = token_losses(model, pad_rows(mb, rows)), token_losses(model, pad_rows(alone_batch, rows))
        target = np.asarray(mb["targets_segmentation"]) != 0
        for r, (b, idx) in enumerate(_documents(mb)):  # row r of alone_batch is this document
            mask = target[b, idx]
            packed_tokens.append(packed_x[b, idx][mask])
            alone_tokens.append(alone_x[r, :len(idx)][mask])
        if sum(t.size for t in packed_tokens[documents:]) != target.sum():
            raise AssertionError("loss tokens outside every document of the packed batch")
        documents += alone_batch["inputs"].shape[0]
    packed_x, alone_x = (np.concatenate(t).astype(np.float64) for t in (packed_tokens, alone_tokens))
    packed, alone = math.fsum(packed_x) / packed_x.size, math.fsum(alone_x) / alone_x.size  # exact sums
    # a token's difference in nats: relative to a near-zero loss it would say nothing of the rounding
    return {"packed_loss": packed, "per_document_loss": alone, "rel_diff": abs(packed - alone) / abs(alone),
            "token_max_abs_diff": float(np.abs(packed_x - alone_x).max(initial=0.0)),
            "tokens_differing": int(np.count_nonzero(packed_x != alone_x)), "tokens": int(packed_x.size),
            "documents": documents, **{k: int(v) for k, v in dropped.items()}}
