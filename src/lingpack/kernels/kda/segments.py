"""Segment ids and their conversions: the only place that knows about cu_seqlens.

Segment ids are int32 `[B, T]`: 1, 2, 3... within a row, 0 = padding. Padding is only allowed at the
end of a row, and every row boundary ends a segment (even when the next row starts with the same id).

Two kernel designs consume them:
* segment-native: ids are used directly (`segment_starts`, `fill_padding_ids`);
* aligned (cu_seqlens, docs/design.md#aligned-cu_seqlens-layout): the batch is flattened to `[1, B*T]` and described by
  `cu_seqlens` of fixed shape `[max_segs + 1]` in FLA's convention (0, cumulative ends). Phantom
  segments beyond the real count have zero length. `align_plan` then places every segment at a chunk
  boundary of a static buffer of `aligned_length(...)` tokens.

Conventions chosen here (a conversion must hold for every layout the pipeline produces):
* a segment's span in the flattened stream runs to the next segment's start, so it also covers the
  row's trailing padding; kernels turn padding tokens into no-ops (no decay, no write), which keeps
  `cu_seqlens[-1] == B*T` as FLA requires and never changes a real token's result;
* on overflow (`num_segments > max_segs`) `cu_seqlens[max_segs]` is the start of the first segment
  that did not fit, so the overflowing tokens lie outside every span: they are dropped, never merged
  into the last slot (their outputs are zero). Eagerly this raises; under jit the count is returned.
  The training step never lets it come to that: `fits_max_segs` marks the documents that fit, and
  `train.step.drop_overflow` makes the rest padding before the model runs (out of loss and gradients).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class SegmentError(ValueError):
    """Segment ids that no kernel can run exactly."""


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_segment_ids(segment_ids, *, name: str = "segment_ids") -> None:
    """Raise on ids a kernel cannot run: wrong rank/dtype, decreasing ids, or padding before real tokens.

    Shape and dtype are checked always (trace time); values only when the array is concrete.
    """
    if segment_ids.ndim != 2:
        raise SegmentError(f"{name} must be [B, T]; got shape {tuple(segment_ids.shape)}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise SegmentError(f"{name} must be an integer array (int32); got dtype {segment_ids.dtype}")
    if not is_concrete(segment_ids):
        return
    ids = np.asarray(segment_ids)
    if (ids < 0).any():
        raise SegmentError(f"{name} has negative values (min {ids.min()}); use 0 for padding, 1,2,3... for documents")
    bad = row_errors(ids)
    if bad:
        raise SegmentError(f"{name} is invalid: " + "; ".join(bad[:3]) + " (ids must be non-decreasing"
                           " within a row, with padding 0 only at the end of a row)")


def row_errors(ids: np.ndarray) -> list[str]:
    """Human-readable problems with concrete segment ids, one entry per bad row."""
    errors = []
    for b, row in enumerate(ids):
        real = row != 0
        n_real = int(real.sum())
        if not real[:n_real].all():
            errors.append(f"row {b} has padding (0) at position {int(np.argmin(real))} before real tokens")
        elif n_real > 1 and (np.diff(row[:n_real]) < 0).any():
            t = int(np.argmax(np.diff(row[:n_real]) < 0)) + 1
            errors.append(f"row {b} decreases at position {t} ({row[t - 1]} -> {row[t]})")
    return errors


def invalid_rows(segment_ids: jax.Array) -> jax.Array:
    """Traceable count of rows whose ids decrease or have padding before real tokens."""
    prev, cur = segment_ids[:, :-1], segment_ids[:, 1:]
    decreases = (cur < prev) & (cur != 0)
    real_after_pad = (prev == 0) & (cur != 0)
    return jnp.sum(jnp.any(decreases | real_after_pad, axis=1)).astype(jnp.int32)


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """bool [B, T]: token t starts a segment (row start or id change), padding never does."""
    B = segment_ids.shape[0]
    changed = jnp.concatenate(
        [jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return changed & (segment_ids != 0)


def fill_padding_ids(segment_ids: jax.Array) -> jax.Array:
    """Padding (0) takes the id of the last real token in its row, so it continues that segment.

    Kernels make padding tokens no-ops, so this only decides that the row's final state is the state
    after its last real token. An all-padding row stays 0.
    """
    return jax.lax.cummax(segment_ids, axis=1)  # ids are non-decreasing, so the running max forward-fills


def num_segments(segment_ids: jax.Array) -> jax.Array:
    """int32 scalar: real segments in the batch, counting a row boundary as a segment end."""
    return jnp.sum(segment_starts(segment_ids)).astype(jnp.int32)


def segment_ids_to_cu_seqlens(segment_ids: jax.Array, max_segs: int) -> tuple[jax.Array, jax.Array]:
    """Flatten `[B, T]` ids to FLA-style `cu_seqlens` int32 `[max_segs + 1]` and the real segment count.

    Examples (B=1): [1,1,2,2,0,0], max_segs=4 -> [0,2,6,6,6] (padding rides with segment 2 as no-ops);
    ids [[1,1,1],[1,1,0]] -> [0,3,6,...] (the row boundary splits the equal ids).
    Raises `SegmentError` eagerly if the count exceeds `max_segs`; under jit compare the returned count.
    """
    check_segment_ids(segment_ids)
    if max_segs < 1:
        raise SegmentError(f"max_segs must be >= 1; got {max_segs}")
    total = segment_ids.size
    starts_flat = segment_starts(segment_ids).reshape(-1)
    count = jnp.sum(starts_flat).astype(jnp.int32)
    if is_concrete(count) and int(count) > max_segs:
        raise SegmentError(f"the batch has {int(count)} segments but max_segs={max_segs}: documents would mix;"
                           f" raise kernel.max_segs to at least {int(count)} (see `python -m lingpack.data.stats`)")
    # Positions of the first max_segs + 1 segment starts; missing ones are filled with the stream end.
    (start_pos,) = jnp.nonzero(starts_flat, size=max_segs + 1, fill_value=total)
    cu_seqlens = jnp.concatenate([jnp.zeros((1,), jnp.int32), start_pos[1:].astype(jnp.int32)])
    return cu_seqlens, count


def fits_max_segs(segment_ids: jax.Array, max_segs: int) -> jax.Array:
    """bool [B, T]: the token belongs to one of the first `max_segs` segments of the flattened batch.

    These are the segments the aligned kernels give a cu_seqlens slot; the rest (the tail of the
    flattened stream: the end of one row and every row after it) overflow. Padding follows the
    segment before it. Traceable; the training step turns the overflow into padding before the model.
    """
    B, T = segment_ids.shape
    rank = jnp.cumsum(segment_starts(segment_ids).reshape(-1)).reshape(B, T)  # 1-based segment index
    return rank <= max_segs


def aligned_length(total_tokens: int, max_segs: int, chunk_size: int) -> int:
    """Static buffer length when each of at most `max_segs` spans is padded up to a chunk boundary.

    Each span wastes at most C-1 tokens; there can be no more spans than tokens.
    """
    n_spans = min(max_segs, total_tokens)
    return math.ceil((total_tokens + n_spans * (chunk_size - 1)) / chunk_size) * chunk_size


class AlignPlan(NamedTuple):
    """Where each flattened token goes in the chunk-aligned buffer, and per-chunk metadata."""
    dest: jax.Array            # int32 [B*T]: aligned position, or T_new (dropped) on overflow
    chunk_starts_seg: jax.Array  # bool [T_new / C]: the chunk begins a segment (reset the state)
    chunk_init_row: jax.Array  # int32 [T_new / C]: row whose initial state the chunk starts from, or B (zeros)
    seg_last_chunk: jax.Array  # int32 [max_segs]: chunk holding each span's last token
    row_last_seg: jax.Array    # int32 [B]: index of each row's last segment, -1 if the row has none
    cu_seqlens: jax.Array      # int32 [max_segs + 1]
    num_segments: jax.Array    # int32 scalar


def align_plan(segment_ids: jax.Array, max_segs: int, chunk_size: int) -> AlignPlan:
    """Chunk-aligned placement of the flattened batch, all static shapes."""
    B, T = segment_ids.shape
    total = B * T
    t_new = aligned_length(total, max_segs, chunk_size)
    n_chunks = t_new // chunk_size
    cu_seqlens, count = segment_ids_to_cu_seqlens(segment_ids, max_segs)
    starts_flat = segment_starts(segment_ids).reshape(-1)
    # Span index of every token; leading padding of an all-padding first row joins span 0 as no-ops.
    span = jnp.maximum(jnp.cumsum(starts_flat) - 1, 0)
    span_len = cu_seqlens[1:] - cu_seqlens[:-1]
    padded_len = -(-span_len // chunk_size) * chunk_size
    aligned_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded_len)[:-1].astype(jnp.int32)])
    in_slot = span < max_segs
    span_c = jnp.minimum(span, max_segs - 1)
    dest = jnp.where(in_slot, aligned_start[span_c] + jnp.arange(total) - cu_seqlens[span_c], t_new)
    dest = dest.astype(jnp.int32)

    # Segment -> row it lives in, and whether it is the row's first segment (gets the row's initial state).
    (start_pos,) = jnp.nonzero(starts_flat, size=max_segs, fill_value=total)
    seg_row = jnp.minimum(start_pos // T, B)
    seg_first_in_row = (start_pos % T == 0) & (start_pos < total)
    real_seg = jnp.arange(max_segs) < count
    first_chunk = jnp.where(real_seg & (span_len > 0), aligned_start // chunk_size, n_chunks)
    chunk_starts_seg = jnp.zeros((n_chunks,), bool).at[first_chunk].set(True, mode="drop")
    init_row = jnp.where(seg_first_in_row, seg_row, B).astype(jnp.int32)
    chunk_init_row = jnp.full((n_chunks,), B, jnp.int32).at[first_chunk].set(init_row, mode="drop")
    # A leading all-padding row makes span 0 start at a non-segment token; its chunk still resets to zeros.
    chunk_starts_seg = chunk_starts_seg.at[0].set(True)
    seg_last_chunk = jnp.clip((aligned_start + jnp.maximum(span_len, 1) - 1) // chunk_size, 0, n_chunks - 1)
    # Last segment index per row: the number of segments started up to the row's end, minus one.
    row_last_seg = (jnp.cumsum(jnp.sum(segment_starts(segment_ids), axis=1)) - 1).astype(jnp.int32)
    has_seg = jnp.any(segment_ids != 0, axis=1)
    row_last_seg = jnp.where(has_seg, row_last_seg, -1)
    return AlignPlan(dest, chunk_starts_seg, chunk_init_row.astype(jnp.int32), seg_last_chunk.astype(jnp.int32),
                     row_last_seg, cu_seqlens, count)


def packing_stats(segment_ids: jax.Array, *, max_segs: int | None = None, chunk_size: int = 64) -> dict:
    """Traceable per-batch figures for the training loop: segments, overflow and phantom overhead.

    `t_new_over_t` is the aligned design's buffer growth (its compute overhead); segment-native pays
    only the rounding of T up to a chunk multiple, reported as `native_t_over_t`.
    """
    B, T = segment_ids.shape
    count = num_segments(segment_ids)
    per_row = jnp.sum(segment_starts(segment_ids), axis=1)
    stats = {
        "segments": count,
        "segments_per_row_mean": jnp.mean(per_row.astype(jnp.float32)),   # reported figures: fp32 in every dtype
        "segments_per_row_max": jnp.max(per_row),
        "invalid_rows": invalid_rows(segment_ids),
        "native_t_over_t": jnp.float32(math.ceil(T / chunk_size) * chunk_size / T),
    }
    if max_segs is not None:
        stats["max_segs"] = jnp.int32(max_segs)
        stats["overflow"] = jnp.maximum(count - max_segs, 0).astype(jnp.int32)
        stats["phantom_segments"] = jnp.maximum(max_segs - count, 0).astype(jnp.int32)
        stats["t_new_over_t"] = jnp.float32(aligned_length(B * T, max_segs, chunk_size) / (B * T))
    return stats
