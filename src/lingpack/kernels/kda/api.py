"""The one entry point for KDA kernels: `chunk_kda(q, k, v, g, beta, *, segment_ids, impl, ...)`.

Layout `[B, T, H, K]` (v: `[B, T, H, V]`, beta: `[B, T, H]`), returning `(o [B,T,H,V], final_state)`.
`segment_ids` int32 `[B, T]` (1,2,3... per row, 0 = trailing padding) reset the state at every document
boundary; `None` means one document per row. `initial_state [B,H,K,V]` seeds each row's first segment;
`final_state [B,H,K,V]` (fp32, float64 for float64 inputs) is the state after each row's last real token.

Implementations (`impl`), all with the same semantics and tests:
  reference        naive recurrence, `lax.scan` over time (the dense reference)
  chunked          chunkwise WY form, segment-native (no phantom segments, any B)
  chunked_aligned  chunkwise WY form on the aligned cu_seqlens layout (`max_segs` phantom slots)
  pallas_varlen / pallas_segment  Pallas TPU kernels, registered by their module when present
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from lingpack.kernels.kda import chunked, gate, reference, segments
from lingpack.precision import at_least_fp32

IMPLS: dict[str, Callable] = {
    "reference": reference.reference_kda,
    "chunked": chunked.chunked_segment_native,
    "chunked_aligned": chunked.chunked_aligned,
}
SAFE_GATE_MIN = gate.SAFE_GATE_MIN
NEEDS_MAX_SEGS = {"chunked_aligned", "pallas_varlen"}
CHUNKED = {"chunked", "chunked_aligned", "pallas_varlen", "pallas_segment"}
FUSES_GATE: set[str] = set()  # impls that take the raw gate / raw q, k and apply gate and L2 norm in-kernel


def register(name: str, fn: Callable, *, needs_max_segs: bool = False, fuses_gate: bool = False) -> None:
    """Add an implementation (used by the Pallas modules) under `name`."""
    IMPLS[name] = fn
    if needs_max_segs:
        NEEDS_MAX_SEGS.add(name)
    if fuses_gate:
        FUSES_GATE.add(name)
    CHUNKED.add(name)


def _load_optional_impls() -> None:
    for module in ("pallas_varlen", "pallas_segment"):
        if module not in IMPLS:
            try:
                __import__(f"lingpack.kernels.kda.{module}")
            except ModuleNotFoundError as err:
                if err.name != f"lingpack.kernels.kda.{module}":
                    raise


def names() -> tuple[str, ...]:
    """Every registered implementation, the Pallas ones included: what configs accept and tests cover."""
    _load_optional_impls()
    return tuple(IMPLS)


def needs_max_segs(name: str) -> bool:
    """Whether implementation `name` packs documents into `max_segs` cu_seqlens slots."""
    _load_optional_impls()
    return name in NEEDS_MAX_SEGS


def _check_shapes(q, k, v, g, beta, segment_ids, initial_state):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K]; got shape {q.shape}")
    B, T, H, K = q.shape
    V = v.shape[-1] if v.ndim == 4 else None
    expected = {"k": (k, (B, T, H, K)), "v": (v, (B, T, H, V)), "g": (g, (B, T, H, K)), "beta": (beta, (B, T, H))}
    for name, (x, shape) in expected.items():
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape} to match q {q.shape}; got {x.shape}")
    for name, x in {"q": q, "k": k, "v": v, "g": g, "beta": beta}.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating dtype (bf16, fp32 or float64); got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids must have shape (B, T) = {(B, T)}; got {segment_ids.shape}")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state must have shape (B, H, K, V) = {(B, H, K, V)}; got {initial_state.shape}")


def chunk_kda(q, k, v, g, beta, *, segment_ids=None, impl: str = "chunked", chunk_size: int = 64,
              max_segs: int | None = None, scale: float | None = None, initial_state=None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, lower_bound: float | None = None,
              safe_gate: bool = False, interpret: bool | None = None, precision: str | None = None):
    """KDA over packed rows; see the module docstring for shapes and semantics.

    With `use_gate_in_kernel`, `g` holds the raw gate pre-activation and the gate (softplus form with
    `A_log`/`dt_bias`, or the safe form when `lower_bound` is set) is applied here; with
    `use_qk_l2norm_in_kernel`, q and k are L2-normalised (fp32) here. `safe_gate` promises every
    g >= -5 (always true for the lower-bound gate, which sets it), letting the chunked kernels form
    within-sub-chunk decays with matmuls; a larger decay would then overflow. `interpret` and `precision` only
    concern Pallas (`precision`: None = bf16 matmul operands for bf16 inputs, fp32 for fp32; "default" = bf16;
    "highest" = fp32 everywhere; the cumsum and the WY inverse are always fp32, see `pallas_chunk`).
    """
    _load_optional_impls()
    if impl not in IMPLS:
        raise ValueError(f"unknown KDA impl {impl!r}; valid choices: {sorted(IMPLS)}")
    _check_shapes(q, k, v, g, beta, segment_ids, initial_state)
    if impl.startswith("pallas") and any(x.dtype == jnp.float64 for x in (q, k, v, g, beta)):
        raise ValueError(f"impl={impl!r} is a TPU kernel computing in fp32 (TPUs have no float64): float64 inputs "
                         "would be rounded; use impl='chunked' or 'reference'")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if impl in CHUNKED:
        gate.check_chunk_size(chunk_size)
    if impl in NEEDS_MAX_SEGS and max_segs is None:
        raise ValueError(f"impl={impl!r} packs segments into max_segs cu_seqlens slots: set max_segs"
                         " (kernel.max_segs; `python -m lingpack.data.stats` recommends a value)")
    if segment_ids is None:
        segment_ids = jnp.ones((B, T), jnp.int32)
    else:
        segments.check_segment_ids(segment_ids)
        segment_ids = segment_ids.astype(jnp.int32)
        if impl in NEEDS_MAX_SEGS and segments.is_concrete(segment_ids):
            segments.segment_ids_to_cu_seqlens(segment_ids, max_segs)  # raises on overflow outside jit

    fused = {}
    if impl in FUSES_GATE and (use_gate_in_kernel or use_qk_l2norm_in_kernel):
        fused = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        use_gate_in_kernel = use_qk_l2norm_in_kernel = False
    if use_gate_in_kernel:
        g = gate.kda_gate(g, A_log, dt_bias, lower_bound)
        safe_gate = safe_gate or lower_bound is not None
    elif safe_gate and segments.is_concrete(g) and float(jnp.min(g)) < SAFE_GATE_MIN:
        raise ValueError(f"safe_gate=True needs every g >= {SAFE_GATE_MIN}; got min(g) = {float(jnp.min(g)):.3g}."
                         " Use the lower-bound gate or pass safe_gate=False")
    if use_qk_l2norm_in_kernel:  # normalised q, k stay fp32 or wider (as in FLA): rounding them to bf16 costs accuracy
        wide = at_least_fp32(q.dtype)
        q, k = gate.l2norm(q.astype(wide)), gate.l2norm(k.astype(wide))
    scale = K ** -0.5 if scale is None else scale
    if initial_state is None:  # the state's dtype: fp32, or float64 for float64 inputs
        initial_state = jnp.zeros((B, H, K, V), at_least_fp32(q.dtype, v.dtype))

    kwargs = dict(segment_ids_BT=segment_ids, scale=scale, initial_state_BHKV=initial_state)
    if impl in CHUNKED:
        kwargs.update(chunk_size=chunk_size, safe_gate=safe_gate)
    if impl in NEEDS_MAX_SEGS:
        kwargs["max_segs"] = max_segs
    if impl.startswith("pallas"):
        kwargs.update(interpret=interpret, precision=precision)
    kwargs.update(fused)
    o, final_state = IMPLS[impl](q, k, v, g, beta, **kwargs)
    return o.astype(v.dtype), (final_state if output_final_state else None)
