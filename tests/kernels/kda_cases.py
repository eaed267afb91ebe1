"""Shared inputs and oracles for every KDA implementation's tests."""
import importlib.util
from pathlib import Path

import numpy as np

from lingpack.parity.fla import fla_gate_functions  # noqa: F401  (the gate oracle, shared with the parity reference)


def xla_impls():
    """Registered KDA implementations that run as XLA (test_kda.py's suite); Pallas ones get test_kda_pallas.py's."""
    from lingpack.kernels.kda import api
    return [name for name in api.names() if not name.startswith("pallas")]


def pallas_impls():
    from lingpack.kernels.kda import api
    return [name for name in api.names() if name.startswith("pallas")]


def fla_naive_module(float64: bool = False):
    """FLA's fla/ops/kda/naive.py loaded by file path (FLA's package import needs triton); `float64`: its float32
    upcasts made float64 (lingpack.parity.widen)."""
    spec = importlib.util.find_spec("fla")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    if float64:
        from lingpack.parity.widen import module_at
        return module_at(path, "fla_kda_naive_float64")
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def make_inputs(rng, B, T, H, K, V, dtype=np.float32, gate_scale=1.0):
    """q, k (unit norm), v, g <= 0, beta in (0,1): the regime KDA layers feed the kernel."""
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    g = (-gate_scale * np.abs(rng.standard_normal((B, T, H, K)))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    return [x.astype(dtype) for x in (q, k, v, g, beta)]


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
