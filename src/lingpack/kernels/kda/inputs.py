"""Random KDA kernel inputs in the regime the KDA layer feeds the kernel, for benchmarks and tests."""

from __future__ import annotations

import numpy as np


def random_inputs(rng: np.random.Generator, B: int, T: int, H: int, K: int, V: int, dtype=np.float32,
                  gate_scale: float = 1.0) -> list[np.ndarray]:
    """q, k, v `[B, T, H, K|V]`, g `[B, T, H, K]`, beta `[B, T, H]`: keys of unit norm (the layer L2-normalises
    them), g = -gate_scale * |N(0, 1)| <= 0 (a log-decay), beta = sigmoid(N(0, 1)) in (0, 1)."""
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    g = (-gate_scale * np.abs(rng.standard_normal((B, T, H, K)))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    return [x.astype(dtype) for x in (q, k, v, g, beta)]
