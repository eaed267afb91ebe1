"""Turn `seq_length + 1` token windows into model inputs/targets with Megatron's semantics.

For a window `w` of T + 1 tokens (works on `[T+1]` or `[B, T+1]`):

- `inputs = w[:-1]`, `targets = w[1:]` (megatron-core's `tokens`, `labels`).
- documents end AFTER their EOD: the EOD input token keeps its document's segment id and position;
  the next token starts a new segment at position 0. Each row is its own sample, so ids restart at
  1 in every row and a row boundary always ends a segment.
- `reset_attention_mask`: segment ids 1, 2, 3... per document; off: the whole row is segment 1.
- `reset_position_ids`: positions restart at 0 after each EOD; off: 0..T-1.
- `eod_mask_loss`: no loss on the prediction made AT an EOD input (predicting the EOD is trained).
- pad: a pad target carries no loss and a pad input is segment 0; as in megatron-core, pad ids in
  `inputs`/`targets` are replaced by 0 so the embedding can look them up (pad_id may be -1).
- `targets_segmentation` is the loss mask written as segment ids: the input's segment id where the
  loss counts, 0 where it is masked. `targets_position` equals `inputs_position` (the position of the
  token that makes the prediction).
"""

from __future__ import annotations

import dataclasses

import numpy as np

BATCH_KEYS = (
    "inputs",
    "targets",
    "inputs_segmentation",
    "targets_segmentation",
    "inputs_position",
    "targets_position",
)


@dataclasses.dataclass(frozen=True)
class SplitOptions:
    eod_id: int
    pad_id: int = -1
    eod_mask_loss: bool = False
    reset_attention_mask: bool = True
    reset_position_ids: bool = True


def split_window(window: np.ndarray, options: SplitOptions) -> dict[str, np.ndarray]:
    """`[..., T+1]` token window -> dict of int32 `[..., T]` arrays (keys: BATCH_KEYS)."""
    window = np.asarray(window)
    if window.shape[-1] < 2:
        raise ValueError(f"a window needs at least 2 tokens, got shape {window.shape}")
    inputs, targets = window[..., :-1], window[..., 1:]
    length = inputs.shape[-1]
    is_eod = inputs == options.eod_id
    is_pad_input = inputs == options.pad_id

    # Exclusive count of EODs before each position: the EOD itself stays in its document.
    eods_before = np.cumsum(is_eod, axis=-1, dtype=np.int32) - is_eod
    if options.reset_attention_mask:
        segment = 1 + eods_before
    else:
        segment = np.ones(inputs.shape, dtype=np.int32)
    inputs_segmentation = np.where(is_pad_input, 0, segment).astype(np.int32)

    loss_mask = targets != options.pad_id
    if options.eod_mask_loss:
        loss_mask &= ~is_eod
    targets_segmentation = np.where(loss_mask, inputs_segmentation, 0).astype(np.int32)

    steps = np.broadcast_to(np.arange(length, dtype=np.int32), inputs.shape)
    if options.reset_position_ids:
        # Start of the current document = one past the latest EOD strictly before t.
        after_eod = np.where(is_eod, steps + 1, 0)
        document_start = np.maximum.accumulate(after_eod, axis=-1)
        document_start = np.concatenate(
            [np.zeros_like(document_start[..., :1]), document_start[..., :-1]], axis=-1
        )
        positions = (steps - document_start).astype(np.int32)
    else:
        positions = np.array(steps, dtype=np.int32)

    return {
        "inputs": np.where(is_pad_input, 0, inputs).astype(np.int32),
        "targets": np.where(targets == options.pad_id, 0, targets).astype(np.int32),
        "inputs_segmentation": inputs_segmentation,
        "targets_segmentation": targets_segmentation,
        "inputs_position": positions,
        "targets_position": positions.copy(),
    }


def loss_mask(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Megatron's float loss mask recovered from a batch: 1 where the target is trained."""
    return (np.asarray(batch["targets_segmentation"]) != 0).astype(np.float32)
