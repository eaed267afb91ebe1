"""Packed batches and their per-document twins: the definition of "exact under packing"."""
import numpy as np


def packed_batch(rows, T, vocab, seed=0, mask_every=7):
    """rows: document lengths per row (rest is padding). Returns the Megatron/MaxText batch dict.

    `targets_segmentation` (the loss mask) also drops every `mask_every`-th real token, like eod_mask_loss.
    """
    rng = np.random.default_rng(seed)
    B = len(rows)
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b, lengths in enumerate(rows):
        start = 0
        for i, n in enumerate(lengths):
            seg[b, start:start + n] = i + 1
            pos[b, start:start + n] = np.arange(n)
            start += n
        assert start <= T, f"row {b} holds {start} > T={T} tokens"
    inputs = np.where(seg > 0, rng.integers(0, vocab, (B, T)), 0).astype(np.int32)
    targets = np.where(seg > 0, rng.integers(0, vocab, (B, T)), 0).astype(np.int32)
    keep = (np.arange(B * T).reshape(B, T) % mask_every) != 3
    tseg = np.where(keep, seg, 0).astype(np.int32)
    return dict(inputs=inputs, targets=targets, inputs_segmentation=seg, targets_segmentation=tseg,
                inputs_position=pos)


def documents(batch):
    """[(row, token indices)] for every document, in row-major order."""
    out = []
    for b, row in enumerate(batch["inputs_segmentation"]):
        for s in np.unique(row[row > 0]):
            out.append((b, np.nonzero(row == s)[0]))
    return out


def per_document_batch(batch, num_rows=None):
    """Every document alone at the start of its own row (segment 1, positions from 0), padded to T.

    `num_rows` pads with all-padding rows so the packed and per-document batches can share one shape.
    """
    docs = documents(batch)
    T = batch["inputs"].shape[1]
    R = max(len(docs), num_rows or 0)
    out = {k: np.zeros((R, T), np.int32) for k in batch}
    for r, (b, idx) in enumerate(docs):
        n = len(idx)
        for k in batch:
            out[k][r, :n] = batch[k][b, idx]
        out["inputs_segmentation"][r, :n] = 1
        out["targets_segmentation"][r, :n] = (batch["targets_segmentation"][b, idx] != 0).astype(np.int32)
        out["inputs_position"][r, :n] = np.arange(n)
    return out, docs


def pad_rows(batch, num_rows):
    """Append all-padding rows (segment 0) up to `num_rows`."""
    extra = num_rows - batch["inputs"].shape[0]
    return {k: np.concatenate([v, np.zeros((extra,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}
