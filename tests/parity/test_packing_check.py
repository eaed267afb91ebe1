"""The packing-parity check itself: it reports 0 for a model without cross-document flow and catches a leak."""
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingpack.parity.packing import packing_parity


class TokenModel(nnx.Module):
    """Logits from each token's embedding; `leak=True` adds a running sum over the row (crosses documents)."""

    def __init__(self, leak: bool):
        self.embed = nnx.Param(jax.random.normal(jax.random.key(0), (16, 16)))
        self.leak = leak

    def __call__(self, inputs_BT, segment_ids_BT, positions_BT):
        x_BTV = self.embed[...][inputs_BT]
        if self.leak:
            x_BTV = x_BTV + 0.1 * jnp.cumsum(x_BTV, axis=1)   # every earlier token of the row, any document
        return types.SimpleNamespace(logits_BTV=x_BTV)


def _packed_batch():
    rng = np.random.default_rng(0)
    seg = np.array([[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 1, 1, 2, 2, 0, 0]], np.int32)
    pos = np.array([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 0]], np.int32)
    return {"inputs": rng.integers(0, 16, seg.shape).astype(np.int32), "targets": rng.integers(0, 16, seg.shape).astype(np.int32),
            "inputs_segmentation": seg, "targets_segmentation": seg, "inputs_position": pos, "targets_position": pos}


def test_packing_parity_is_zero_without_flow_and_catches_a_leak():
    clean = packing_parity(TokenModel(leak=False), _packed_batch())
    # no reduction across tokens: every token's loss is bitwise its document's alone, and the sums are exact
    assert clean["documents"] == 5 and clean["rel_diff"] == 0.0 and clean["token_max_abs_diff"] == 0.0
    assert (clean["tokens_differing"], clean["tokens"]) == (0, 14)
    leaky = packing_parity(TokenModel(leak=True), _packed_batch())
    assert leaky["documents"] == 5 and leaky["rel_diff"] > 1e-3, leaky
