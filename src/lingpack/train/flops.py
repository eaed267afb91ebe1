"""Training FLOPs per token (for the MFU estimate) and per-device peak FLOP/s.

Ling3 estimate, forward + backward = 3 x forward, multiply-add = 2 FLOPs:
  matmuls:   6 * (active parameters - input embedding table)    (the lookup is not a matmul)
  attention: 3 * 2 * 2 * heads * (qk_head_dim + v_head_dim) / 2 * T / 2 per MLA layer (incl. MTP)
             (scores + values; causal: each query sees T/2 keys on average; an upper bound under packing)
  KDA:       3 * 2 * heads * (2 * head_dim^2 + chunk * 2 * head_dim) per KDA layer
             (state read + write per token, plus the intra-chunk products)
Other models: 6 * parameters, or their config's own `flops_per_token(seq_len)` when it has one.

Peak: vendor figures for accelerators; on CPU (no vendor figure means anything there) the matmul
throughput XLA reaches in this process, measured once (`measured_matmul_flops`), so `mfu` on CPU is
"fraction of the best dense matmul this machine does", not of a datasheet number, and approximate: on a
shared machine the ceiling varies ~2x between processes (experiments/cpu_matmul_ceiling/).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from lingpack.plan import chips

# Dense bf16 peak per chip of accelerators outside the planner's table (`lingpack.plan.chips`, which has the sources and
# is read first); matched by substring of `device.device_kind`, lower-cased.
PEAK_FLOPS = (("v4", 275e12), ("v3", 123e12), ("a100", 312e12), ("b200", 2250e12))


def peak_flops_per_device(device=None) -> float | None:
    """Vendor peak of an accelerator; on CPU the measured matmul ceiling shared by the process's CPU devices."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return measured_matmul_flops() / len(jax.local_devices(backend="cpu"))  # fake devices share the cores
    known = chips.from_device_kind(device.device_kind)
    if known is not None:
        return known.peak_flops
    kind = device.device_kind.lower()
    for key, value in PEAK_FLOPS:
        if key in kind:
            return value
    return None


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(size: int = 1024, dtype: str = "float32", repeats: int = 5) -> float:
    """FLOP/s of a jitted [size, size] @ [size, size] matmul on the default device: best of `repeats`.

    Best, not median: the ceiling is what the machine CAN do; a run on a loaded machine only ever
    measures too little. One call costs ~a second on two CPU cores (~2 GFLOP) and is cached per process.
    """
    a = jnp.ones((size, size), dtype) / size  # 1/size keeps the product O(1): no inf in any dtype
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))  # compile outside the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(a))
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / best


def flops_per_token(model_cfg, seq_len: int) -> float:
    if hasattr(model_cfg, "flops_per_token"):
        return float(model_cfg.flops_per_token(seq_len))
    from lingpack.models.ling3 import Ling3Config, count_active_params
    if not isinstance(model_cfg, Ling3Config):
        return 0.0
    cfg = model_cfg
    matmul = 6.0 * (count_active_params(cfg) - cfg.vocab_size * cfg.emb_dim * (not cfg.tie_embeddings))
    kinds = [mixer for mixer, _ in cfg.layer_kinds()]
    n_mla = kinds.count("mla") + cfg.mtp_num_layers
    n_kda = kinds.count("kda")
    mla = cfg.mla
    attention = n_mla * 3 * 2 * 2 * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim) / 2 * seq_len / 2
    kda = n_kda * kda_flops_per_token(cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda_chunk_size)
    return matmul + attention + kda


def kda_flops_per_token(heads: int, head_dim: int, chunk_size: int) -> float:
    """Training FLOPs per token of one KDA kernel call (the module docstring's KDA term)."""
    return 3 * 2 * heads * (2 * head_dim * head_dim + chunk_size * 2 * head_dim)
