"""Training FLOPs per token (for the MFU estimate) and per-device peak FLOP/s.

Ling3 estimate, forward + backward = 3 x forward, multiply-add = 2 FLOPs:
  matmuls:   6 * (active parameters - input embedding table)    (the lookup is not a matmul)
  MTP heads: 6 * vocab * width per MTP depth                     (each depth's logits run the shared output head
             again, which the parameter count holds once)
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

from lingpack.kernels.attention.api import NAMES_RESIDUALS, resolve
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
    matmul += 6.0 * cfg.vocab_size * cfg.emb_dim * cfg.mtp_num_layers   # the shared head, once more per MTP depth
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


# ---------------------------------------------------------------- remat: the forward recompute a policy adds

# JAX's primitive policies, counted as the named policy that saves the same projections (approximate: a dot
# policy also keeps dots inside the kernels, and ragged_dot is not a dot_general)
_PRIMITIVE_AS = {"nothing_saveable": "full", "dots_saveable": "minimal_with_context",
                 "dots_with_no_batch_dims_saveable": "minimal_with_context"}


def forward_terms(cfg, seq_len: int) -> list[tuple[str, tuple, float, int]]:
    """(part, remat tags, forward FLOPs per token, layers) of every matmul and kernel of the remat'ed layers.

    A term is not recomputed when one of its tags is kept: its own output's, or a later value that makes it
    unneeded (the routed down projection: `mlpwo`, or `expert_outputs`, the outputs after the return exchange).
    No tags: never saved by a named policy (router, MTP input projection, the KDA kernel and the attention
    implementations whose custom VJPs recompute their forward from their inputs), so always recomputed; the
    attention's forward is skipped when `context` is kept and the implementation the platform being traced for
    resolves to names its residuals (kernels/attention/api.py `NAMES_RESIDUALS`: flash, splash). Outputs no backward reads (the mixer's
    out_proj, the shared expert's and dense MLP's down projection: only added to the residual) are left out:
    the backward never recomputes them. FLOPs: 2 per multiply-add, as `flops_per_token`.
    """
    D, kinds = cfg.emb_dim, cfg.layer_kinds()
    n_kda = sum(m == "kda" for m, _ in kinds)
    n_mla = sum(m == "mla" for m, _ in kinds) + cfg.mtp_num_layers
    n_moe = sum(f == "moe" for _, f in kinds) + (cfg.mtp_num_layers if cfg.mtp.use_moe else 0)
    n_mlp = len(kinds) + cfg.mtp_num_layers - n_moe
    H, K = cfg.kda.num_heads, cfg.kda.head_dim
    kda = [("query_proj", 2 * D * H * K), ("key_proj", 2 * D * H * K), ("value_proj", 2 * D * H * K),
           ("gate_proj", 2 * 2 * (D * K + K * H * K) + 2 * D * H),                    # decay f_a/f_b, output gate g_a/g_b, beta
           (None, kda_flops_per_token(H, K, cfg.kda_chunk_size) / 3)]                 # the kernel's forward
    m = cfg.mla
    attention_tag = "context" if resolve(cfg.attention_impl, cfg.dtype) in NAMES_RESIDUALS else None
    q = ([("qkv_proj", 2 * D * m.q_lora_rank), ("query_proj", 2 * m.q_lora_rank * m.num_heads * m.qk_head_dim)]
         if m.q_lora_rank else [("query_proj", 2 * D * m.num_heads * m.qk_head_dim)])
    mla = q + [("qkv_proj", 2 * D * (m.kv_lora_rank + m.qk_rope_head_dim)),
               ("kv_proj", 2 * m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)),
               (attention_tag, 2 * 2 * m.num_heads * (m.qk_head_dim + m.v_head_dim) / 2 * seq_len / 2)]   # attention forward
    e, S = cfg.moe, cfg.moe.num_shared_experts * cfg.moe.expert_dim
    moe = [(None, 2 * D * e.num_experts),                                              # router
           ("mlpwi_0", 2 * e.top_k * D * e.expert_dim + 2 * D * S), ("mlpwi_1", 2 * e.top_k * D * e.expert_dim + 2 * D * S),
           (("mlpwo", "expert_outputs"), 2 * e.top_k * e.expert_dim * D)]              # routed down: its output weighs the routing
    mlp = [("mlpwi_0", 2 * D * cfg.mlp_dim), ("mlpwi_1", 2 * D * cfg.mlp_dim)]
    terms = [("kda", t, f, n_kda) for t, f in kda] + [("mla", t, f, n_mla) for t, f in mla]
    terms += [("moe", t, f, n_moe) for t, f in moe] + [("mlp", t, f, n_mlp) for t, f in mlp]
    terms.append(("mtp", None, 2 * 2 * D * D, cfg.mtp_num_layers))                     # eh_proj of [emb, h] -> D
    return [(part, tag if isinstance(tag, tuple) else (tag,) if tag else (), flops, layers)
            for part, tag, flops, layers in terms if layers]


def remat_flops(model_cfg, policy: str | None = None, *, seq_len: int, expert_rounds: int = 1) -> float:
    """Forward FLOPs per token that the backward pass recomputes under `policy` (default: the config's own; 0
    without `remat`), on top of `flops_per_token`. Multiply by the step's tokens for a step's remat FLOPs.

    A policy's saved tags skip their matmul; everything else of a remat'ed layer's forward runs again, except
    outputs no backward reads (see `forward_terms`). Per-part overrides (`remat_policy_<part>`) are read from the
    config. expert_rounds > 1 (expert parallelism in `moe.expert_parallel_chunks` rounds) rematerialises each round
    on its own, so the routed experts' forward is recomputed whatever the policy.
    """
    from lingpack.models import remat as remat_lib
    from lingpack.models.ling3 import Ling3Config
    if not isinstance(model_cfg, Ling3Config):
        return 0.0
    cfg = model_cfg
    if policy is None and not cfg.remat:
        keep = {f"{p}/{t}" for p in remat_lib.PARTS for t in remat_lib.TAGS}
        kernels = False
    else:
        name = policy or cfg.remat_policy
        if name == "everything_saveable":
            keep, kernels = {f"{p}/{t}" for p in remat_lib.PARTS for t in remat_lib.TAGS}, False
        else:
            base = _PRIMITIVE_AS.get(name, name)
            overrides = cfg.remat_overrides() if name in remat_lib.NAMED or name == "nothing_saveable" else {}
            kept, offloaded = remat_lib.saved_tags(base, overrides)
            keep, kernels = kept | offloaded, True
    total = 0.0
    for part, tags, flops, layers in forward_terms(cfg, seq_len):
        recomputed = kernels and not any(f"{part}/{tag}" in keep for tag in tags)
        if part == "moe" and tags and tags[0] in ("mlpwi_0", "mlpwi_1", "mlpwo") and expert_rounds > 1:
            e = cfg.moe
            routed = flops - (2 * cfg.emb_dim * e.num_shared_experts * e.expert_dim if tags[0] != "mlpwo" else 0)
            total += layers * (flops if recomputed else routed)
            continue
        total += layers * flops * recomputed
    return float(total)
