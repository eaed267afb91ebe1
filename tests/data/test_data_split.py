"""split.py against hand-worked examples and megatron-core's mask/position function."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lingpack.data.split import BATCH_KEYS, SplitOptions, split_window
from tests.optional import require

E, P = 9, 1  # EOD and pad ids for the hand-worked cases


def _split(window, **switches):
    return split_window(np.array(window), SplitOptions(eod_id=E, pad_id=P, **switches))


def test_hand_worked_documents_and_eod():
    window = [5, 6, E, 7, E, 8, 9]
    out = _split(window, eod_mask_loss=True, reset_attention_mask=True, reset_position_ids=True)
    assert out["inputs"].tolist() == [5, 6, E, 7, E, 8]
    assert out["targets"].tolist() == [6, E, 7, E, 8, 9]
    # The EOD keeps its document's id; the next document starts right after it.
    assert out["inputs_segmentation"].tolist() == [1, 1, 1, 2, 2, 3]
    assert out["inputs_position"].tolist() == [0, 1, 2, 0, 1, 0]
    assert out["targets_position"].tolist() == [0, 1, 2, 0, 1, 0]
    # eod_mask_loss drops the prediction made AT an EOD; predicting the EOD is trained.
    assert out["targets_segmentation"].tolist() == [1, 1, 0, 2, 0, 3]
    assert {key: value.dtype for key, value in out.items()} == {k: np.int32 for k in BATCH_KEYS}


def test_switches_are_independent():
    window = [5, 6, E, 7, E, 8, 9]
    no_eod_mask = _split(window, eod_mask_loss=False, reset_attention_mask=True)
    assert no_eod_mask["targets_segmentation"].tolist() == [1, 1, 1, 2, 2, 3]
    one_segment = _split(window, eod_mask_loss=True, reset_attention_mask=False,
                         reset_position_ids=True)
    assert one_segment["inputs_segmentation"].tolist() == [1] * 6
    assert one_segment["targets_segmentation"].tolist() == [1, 1, 0, 1, 0, 1]
    assert one_segment["inputs_position"].tolist() == [0, 1, 2, 0, 1, 0]
    plain_positions = _split(window, reset_attention_mask=True, reset_position_ids=False)
    assert plain_positions["inputs_position"].tolist() == list(range(6))
    assert plain_positions["inputs_segmentation"].tolist() == [1, 1, 1, 2, 2, 3]


def test_padding_is_masked_and_zeroed():
    out = _split([5, E, 6, P, P], eod_mask_loss=False)
    assert out["inputs"].tolist() == [5, E, 6, 0]  # pad ids become 0, as megatron-core does
    assert out["targets"].tolist() == [E, 6, 0, 0]
    assert out["inputs_segmentation"].tolist() == [1, 1, 2, 0]
    assert out["targets_segmentation"].tolist() == [1, 1, 0, 0]  # pad targets carry no loss
    masked = _split([5, E, 6, P, P], eod_mask_loss=True)
    assert masked["targets_segmentation"].tolist() == [1, 0, 0, 0]


def test_row_starting_with_eod_and_no_pad_token():
    out = split_window(np.array([E, 5, 6]), SplitOptions(eod_id=E, pad_id=-1))
    assert out["inputs_segmentation"].tolist() == [1, 2]
    assert out["inputs_position"].tolist() == [0, 0]
    assert out["targets_segmentation"].tolist() == [1, 2]


def test_batched_equals_rowwise():
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 10, size=(4, 33))
    options = SplitOptions(eod_id=E, pad_id=P, eod_mask_loss=True)
    batched = split_window(windows, options)
    for row in range(4):
        single = split_window(windows[row], options)
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(batched[key][row], single[key])


def _megatron_reference(window, eod, pad, eod_mask_loss, reset_attention_mask, reset_position_ids):
    torch = require("torch")
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = torch.from_numpy(window[:-1].astype(np.int64))
    labels = torch.from_numpy(window[1:].astype(np.int64))
    attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
        tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss, True
    )
    loss_mask[labels == pad] = 0.0  # GPTDataset.__getitem__ adds this
    allowed = ~attention_mask[0].numpy()  # megatron: True = masked out
    return allowed, loss_mask.numpy(), position_ids.numpy()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    offset=st.integers(0, 11),
    seq_length=st.integers(2, 40),
    eod_mask_loss=st.booleans(),
    reset_attention_mask=st.booleans(),
    reset_position_ids=st.booleans(),
    trailing_pad=st.integers(0, 3),
)
def test_matches_megatron_masks_and_positions(
    lengths, offset, seq_length, eod_mask_loss, reset_attention_mask, reset_position_ids,
    trailing_pad,
):
    """Random document layouts (length-1 documents, a window starting mid-document, trailing pad):
    our loss mask and positions equal megatron-core's, and segment ids encode its attention mask."""
    require("megatron.core.datasets.gpt_dataset")
    eod, pad = 3, 2
    stream = np.concatenate([np.append(np.full(n - 1, 7), eod) for n in lengths] * 8)[offset:]
    window = stream[: seq_length + 1 - trailing_pad]
    window = np.concatenate([window, np.full(seq_length + 1 - window.size, pad)])
    options = SplitOptions(eod, pad, eod_mask_loss, reset_attention_mask, reset_position_ids)
    ours = split_window(window, options)
    allowed, loss_mask, positions = _megatron_reference(
        window, eod, pad, eod_mask_loss, reset_attention_mask, reset_position_ids
    )
    np.testing.assert_array_equal(ours["inputs_position"], positions)
    np.testing.assert_array_equal((ours["targets_segmentation"] != 0).astype(np.float32), loss_mask)
    segment = ours["inputs_segmentation"]
    real = segment != 0
    same_segment = (segment[:, None] == segment[None, :]) & np.tril(np.ones_like(allowed))
    # Megatron's attention mask ignores padding; compare among real tokens.
    np.testing.assert_array_equal(same_segment[np.ix_(real, real)], allowed[np.ix_(real, real)])
