"""Shared inputs and oracles for every KDA implementation's tests."""
import numpy as np

# shared with the benchmarks, so they live in the package
from lingpack.kernels.kda.inputs import random_inputs as make_inputs  # noqa: F401
from lingpack.parity.fla import fla_gate_functions, fla_naive_kda as fla_naive_module  # noqa: F401


def xla_impls():
    """Registered KDA implementations that run as XLA (test_kda.py's suite); Pallas ones get test_kda_pallas.py's."""
    from lingpack.kernels.kda import api
    return [name for name in api.names() if not name.startswith("pallas")]


def pallas_impls():
    from lingpack.kernels.kda import api
    return [name for name in api.names() if name.startswith("pallas")]


def segments_from_lengths(rows, T):
    """rows: list of lists of document lengths (sum <= T); the rest of each row is padding."""
    seg = np.zeros((len(rows), T), np.int32)
    for b, lengths in enumerate(rows):
        assert sum(lengths) <= T
        pos = 0
        for i, n in enumerate(lengths):
            seg[b, pos:pos + n] = i + 1
            pos += n
    return seg


def documents(seg):
    """Yield (row, token indices) per document."""
    for b, row in enumerate(seg):
        for s in np.unique(row[row > 0]):
            yield b, np.nonzero(row == s)[0]


def per_document_oracle(naive, q, k, v, g, beta, seg, h0=None):
    """FLA's naive recurrence run on each document alone: the definition of correct varlen (in float64 for
    float64 inputs, else fp32: pass `fla_naive_module(float64=True)` for a float64 recurrence)."""
    import torch
    B, T, H, _ = q.shape
    V = v.shape[-1]
    dtype = np.float64 if np.asarray(q).dtype == np.float64 else np.float32
    o = np.zeros((B, T, H, V), dtype)
    final = np.zeros((B, H, q.shape[-1], V), dtype) if h0 is None else h0.copy()
    for b, idx in documents(seg):
        take = lambda x: torch.tensor(np.asarray(x, dtype)[b:b + 1, idx])
        init = torch.tensor(h0[b:b + 1]) if (h0 is not None and idx[0] == 0) else None
        o_doc, s_doc = naive.naive_recurrent_kda(take(q), take(k), take(v), take(g), take(beta),
                                                 initial_state=init, output_final_state=True)
        o[b, idx] = o_doc[0].numpy()
        final[b] = s_doc[0].numpy()  # documents are visited in order, so the last one wins
    return o, final


def rms_ratio(ref, out):
    """FLA's test metric: RMS(ref - out) / RMS(ref)."""
    ref, out = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    return np.sqrt(np.mean((ref - out) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30)
