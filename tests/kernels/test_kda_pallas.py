"""Pallas KDA kernels (interpret mode on CPU) against the kernel suite's oracles, and their TPU lowering.

Outputs and final states are checked against FLA's naive recurrence run per document; every gradient
(dq, dk, dv, dg, dbeta, dh0, all from the Pallas backward kernels) against autodiff of `reference`.
One shape per dtype, so each implementation compiles once and every layout reuses it.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lingpack import backend
from lingpack.errors import ConfigError
from lingpack.kernels.kda import api, gate, pallas_chunk, pallas_common, segments
from tests.kernels.kda_cases import (fla_naive_module, make_inputs, pallas_impls, per_document_oracle, rms_ratio,
                                     segments_from_lengths)
from tests.kernels.test_kda import segmentations  # the kernel suite's random segmentations (B=2, T=150)

IMPLS = pallas_impls()   # from the registry in api.py
B, T, H, K, V = 2, 150, 2, 64, 64
CHUNK, MAX_SEGS = 64, 12
GRAD_NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
LAYOUTS = {
    "padding_len1_exact_chunk": [[40, 1, 64, 35], [64, 1, 1, 1, 70]],
    "row_boundary_same_id": [[T], [T - 10]],     # row 0's only id continues as row 1's id 1
    "all_padding_row": [[5, 7, 100], []],
}


@pytest.fixture(scope="module")
def naive():
    return fla_naive_module()


@functools.lru_cache(maxsize=None)
def value_and_grads(impl, chunk_size=CHUNK, **flags):
    """jit(value_and_grad) of a random projection of (o, final_state); returns ((loss, (o, s)), grads)."""
    def loss(q, k, v, g, beta, h0, seg, w_o, w_s, A_log, dt_bias):
        extra = dict(A_log=A_log, dt_bias=dt_bias) if flags.get("use_gate_in_kernel") else {}
        o, s = api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=chunk_size, max_segs=MAX_SEGS,
                             initial_state=h0, output_final_state=True, **flags, **extra)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s), (o, s)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))


def inputs(seed, gate_scale=1.0, strong_channels=0):
    rng = np.random.default_rng(seed)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V, gate_scale=gate_scale)
    # A few channels decay by up to ~e^-80 per token: unmasked exponents inside a chunk would overflow.
    g[..., :strong_channels] *= 40.0
    h0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    w_o = rng.standard_normal((B, T, H, V)).astype(np.float32)
    w_s = rng.standard_normal((B, H, K, V)).astype(np.float32)
    return (q, k, v, g, beta, h0), (w_o, w_s)


def run(impl, xs, seg, ws, gate_params=(None, None), **flags):
    (_, (o, s)), grads = value_and_grads(impl, **flags)(*xs, seg, *ws, *gate_params)
    return np.asarray(o, np.float32), np.asarray(s), [np.asarray(x, np.float32) for x in grads]


def assert_grads_close(grads, ref, atol=5e-5, rtol=1e-4, nonzero=True):
    for name, g, r in zip(GRAD_NAMES, grads, ref):
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, r, atol=atol, rtol=rtol, err_msg=name)
        assert not nonzero or np.abs(r).max() > 0, name   # the gradient exists, so the comparison means something


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_matches_oracle_and_reference_gradients(naive, impl):
    xs, ws = inputs(0, strong_channels=4)
    for layout, rows in LAYOUTS.items():
        seg = segments_from_lengths(rows, T)
        o_ref, s_ref = per_document_oracle(naive, *xs[:5], seg, xs[5])
        o, s, grads = run(impl, xs, seg, ws)
        np.testing.assert_allclose(o, o_ref, atol=3e-5, rtol=1e-5, err_msg=layout)
        np.testing.assert_allclose(s, s_ref, atol=3e-5, rtol=1e-5, err_msg=layout)
        assert not o[seg == 0].any(), "padding positions must output 0"
        _, _, grads_ref = run("reference", xs, seg, ws)
        assert_grads_close(grads, grads_ref)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seg=segmentations(), seed=st.integers(0, 2**16))
def test_random_segmentations_match_oracle_and_reference(seg, seed):
    naive = fla_naive_module()
    xs, ws = inputs(seed)
    o_ref, s_ref = per_document_oracle(naive, *xs[:5], seg, xs[5])
    _, _, grads_ref = run("reference", xs, seg, ws)
    n_segs = int(segments.num_segments(jnp.asarray(seg)))
    for impl in IMPLS:
        if api.needs_max_segs(impl) and n_segs > MAX_SEGS:
            with pytest.raises(segments.SegmentError, match="max_segs"):   # raised eagerly, before any kernel
                api.chunk_kda(*xs[:5], segment_ids=seg, impl=impl, max_segs=MAX_SEGS)
            continue
        o, s, grads = run(impl, xs, seg, ws)
        np.testing.assert_allclose(o, o_ref, atol=3e-5, rtol=1e-5, err_msg=impl)
        np.testing.assert_allclose(s, s_ref, atol=3e-5, rtol=1e-5, err_msg=impl)
        assert_grads_close(grads, grads_ref, nonzero=False)   # an all-padding batch has no dq


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_within_fla_tolerances(impl):
    xs, ws = inputs(3)
    xs = list(xs)
    xs[5] = np.zeros_like(xs[5])
    seg = segments_from_lengths(LAYOUTS["padding_len1_exact_chunk"], T)
    o_ref, s_ref, grads_ref = run("reference", xs, seg, ws)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in xs[:5]] + [xs[5]]
    (_, (o, s)), grads = value_and_grads(impl)(*bf, seg, *ws, None, None)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32  # the state stays fp32
    assert rms_ratio(o_ref, np.asarray(o, np.float32)) < 0.005
    assert rms_ratio(s_ref, s) < 0.005
    limits = {"dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02, "dh0": 0.008}  # FLA's
    for (name, limit), r, g in zip(limits.items(), grads_ref, grads, strict=True):
        assert g.dtype == bf[GRAD_NAMES.index(name)].dtype, name
        assert rms_ratio(r, np.asarray(g, np.float32)) < limit, name


def test_gate_and_l2norm_via_api_with_safe_gate(impl="pallas_varlen"):
    """The model's path today: the API applies the lower-bound gate and the L2 norm and sets safe_gate (the
    sub-block factoring); pallas_segment's safe-gate path is covered by the fused test below."""
    xs, ws = inputs(6)
    rng = np.random.default_rng(6)
    g_raw = rng.standard_normal((B, T, H, K)).astype(np.float32) * 3.0
    gate_params = (np.log(rng.uniform(1, 16, H)).astype(np.float32), rng.standard_normal(H * K).astype(np.float32))
    xs = (xs[0] * 3.0, xs[1] * 3.0, xs[2], g_raw, xs[4], xs[5])
    seg = segments_from_lengths(LAYOUTS["padding_len1_exact_chunk"], T)
    flags = dict(use_gate_in_kernel=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref, grads_ref = run("reference", xs, seg, ws, gate_params, **flags)
    o, s, grads = run(impl, xs, seg, ws, gate_params, **flags)
    assert np.min(np.asarray(gate.kda_gate(g_raw, *gate_params, -5.0))) < -4.9   # the bound is really exercised
    np.testing.assert_allclose(o, o_ref, atol=3e-5, rtol=1e-5)
    np.testing.assert_allclose(s, s_ref, atol=3e-5, rtol=1e-5)
    assert_grads_close(grads, grads_ref)


@pytest.mark.slow   # the end-to-end gradient tests cover this; it localises a failure to the chunk math
@pytest.mark.parametrize("safe_gate,with_masks", [(False, True), (True, True), (False, False), (True, False)])
def test_chunk_backward_matches_autodiff_of_chunk_forward(monkeypatch, safe_gate, with_masks):
    """The hand-derived chunk backward (pallas_chunk) equals jax.vjp of the chunk forward, outside any kernel."""
    monkeypatch.setattr(pallas_chunk, "roll_rows", lambda x, s: jnp.roll(x, s % x.shape[0], 0))  # no Mosaic here
    rng = np.random.default_rng(8)
    C, Kc, Vc = 32, 16, 8
    q, k, v, g, _ = make_inputs(rng, 1, C, 1, Kc, Vc, gate_scale=1.5)
    q, k, v, g = [jnp.asarray(x[0, :, 0]) for x in (q, k, v, g)]
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (1, C)), jnp.float32)
    S, dO, dS = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((Kc, Vc), (C, Vc), (Kc, Vc))]
    ids = jnp.asarray([[3.0] * 5 + [4.0] * 20 + [5.0] * 7])   # the carried segment, one inside, the last one

    def masks(prev_last):
        return pallas_chunk.segment_masks(ids, prev_last) if with_masks else pallas_chunk.NO_MASKS

    fwd = lambda *a: pallas_chunk.chunk_forward(*a[:6], masks=masks(a[6]), safe_gate=safe_gate)[:2]
    bwd = jax.jit(lambda *a: pallas_chunk.chunk_backward(*a[:8], masks=masks(a[8]), safe_gate=safe_gate))
    vjp_of_fwd = jax.jit(lambda *a: jax.vjp(lambda *x: fwd(*x, a[8]), *a[:6])[1]((a[6], a[7])))
    for prev_last in (3.0, 2.0):   # the chunk continues the incoming segment / starts a new one
        args = (q, k, v, g, beta, S, dO, dS, jnp.full((1, 1), prev_last))
        for name, e, o in zip(["dq", "dk", "dv", "dg", "dbeta", "dS"], vjp_of_fwd(*args), bwd(*args)):
            np.testing.assert_allclose(o, e, atol=2e-5, rtol=1e-4, err_msg=f"{name} prev_last={prev_last}")


@pytest.mark.parametrize("impl,lower_bound,head_dim", [("pallas_segment", -5.0, 128), ("pallas_varlen", None, 64)])
def test_gate_and_l2norm_fused_in_kernel(impl, lower_bound, head_dim):
    """Raw gate + A_log/dt_bias and raw q/k into the kernels; compared with the API applying them outside.
    Head dim 128 also runs pallas_segment's transpose-free layout ((C, K) tiles of [B, T, H*K])."""
    rng = np.random.default_rng(11)
    q, k, v, _, beta = make_inputs(rng, B, T, H, head_dim, head_dim)
    h0 = rng.standard_normal((B, H, head_dim, head_dim)).astype(np.float32)
    w_o = rng.standard_normal(v.shape).astype(np.float32)
    w_s = rng.standard_normal(h0.shape).astype(np.float32)
    g_raw = rng.standard_normal(q.shape).astype(np.float32) * 3.0
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = rng.standard_normal(H * head_dim).astype(np.float32)
    seg = segments_from_lengths(LAYOUTS["padding_len1_exact_chunk"], T)
    flags = dict(use_gate_in_kernel=True, lower_bound=lower_bound, use_qk_l2norm_in_kernel=True)

    def loss(fn, q, k, v, g, beta, h0, A_log, dt_bias):
        o, s = fn(q, k, v, g, beta, h0, A_log, dt_bias)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)

    def reference(q, k, v, g, beta, h0, A_log, dt_bias):
        return api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl="reference", initial_state=h0,
                             output_final_state=True, A_log=A_log, dt_bias=dt_bias, **flags)

    def fused(q, k, v, g, beta, h0, A_log, dt_bias):
        extra = dict(max_segs=MAX_SEGS) if impl == "pallas_varlen" else {}
        return api.IMPLS[impl](q, k, v, g, beta, segment_ids_BT=jnp.asarray(seg), scale=head_dim ** -0.5,
                               initial_state_BHKV=h0, chunk_size=CHUNK, A_log=A_log, dt_bias=dt_bias, **flags, **extra)

    api._load_optional_impls()
    args = (q * 3.0, k * 3.0, v, g_raw, beta, h0, A_log, dt_bias)
    grad = lambda fn: jax.jit(jax.value_and_grad(functools.partial(loss, fn), argnums=tuple(range(8)), has_aux=True))
    (_, (o_ref, s_ref)), grads_ref = grad(reference)(*args)
    (_, (o, s)), grads = grad(fused)(*args)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=3e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), atol=3e-5, rtol=1e-5)
    assert not np.asarray(o)[seg == 0].any(), "padding positions must output 0"
    for name, g, r in zip(GRAD_NAMES[:5] + ["dh0", "dA_log", "ddt_bias"], grads, grads_ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5, rtol=1e-4, err_msg=name)
        assert np.abs(np.asarray(r)).max() > 0, name


@pytest.mark.parametrize("gate_kind", [None, "softplus", "lower_bound"])
def test_prologue_backward_matches_autodiff(gate_kind):
    rng = np.random.default_rng(12)
    q, k, g = [jnp.asarray(rng.standard_normal((16, 8)) * 2, jnp.float32) for _ in range(3)]
    params = jnp.asarray(np.stack([rng.standard_normal(8), np.full(8, 3.0)]), jnp.float32)
    fusion = pallas_chunk.Fusion(gate=gate_kind, lower_bound=-4.0, qk_l2norm=True)
    out, vjp = jax.vjp(lambda *a: pallas_chunk.prologue(*a, fusion)[:3], q, k, g, params)
    cts = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in out]
    expected = vjp(tuple(cts))
    saved = pallas_chunk.prologue(q, k, g, params, fusion)[3]
    got = pallas_chunk.prologue_backward(out[0], out[1], *cts, params, saved, fusion)
    for name, e, o in zip(["dq", "dk", "dg", "dparams"], expected, got):
        if gate_kind is None and name in ("dg", "dparams"):
            continue
        np.testing.assert_allclose(o, e, atol=1e-5, rtol=1e-5, err_msg=name)
    padded = pallas_chunk.gate_forward(jnp.full((1, 8), pallas_chunk.PADDING_GATE_RAW), params, fusion)
    if gate_kind is not None:   # padding's sentinel raw gate means exactly no decay, with zero gradient
        assert not np.asarray(padded).any()


def test_interpret_follows_the_backend_target():
    assert pallas_common.resolve_interpret(None) is True          # CPU: interpret (tests)
    assert pallas_common.resolve_interpret(False) is False        # asked: Mosaic lowering
    with backend.target("tpu"):
        assert pallas_common.resolve_interpret(None) is False
    with backend.target("gpu"), pytest.raises(ConfigError, match="kernel=chunked"):
        pallas_common.resolve_interpret(None)


def test_varlen_overflow_raises_and_bad_head_dim_names_the_fix():
    xs, _ = inputs(9)
    seg = segments_from_lengths([[10] * 15, [20]], T)
    with pytest.raises(segments.SegmentError, match="max_segs"):
        api.chunk_kda(*xs[:5], segment_ids=seg, impl="pallas_varlen", max_segs=MAX_SEGS)
    with pytest.raises(ValueError, match="head dim"):
        api.chunk_kda(*[x[..., :60] if x.ndim == 4 else x for x in xs[:5]], impl="pallas_segment")


def test_cost_model_counts_the_kernel_matmuls():
    """Per grid step, the MXU FLOPs traced from the kernel math (what experiments/pallas_cost and the
    pallas_call cost estimates use) equal the closed form: cumsum 2C^2K, off-diagonal decay products 12C^2K,
    inverse 24C^3 (6 doubling levels x 2 matmuls), W and U 2C^2K + 2C^2V, WS, QgS, Ko^T Vn 6CKV, Aqk Vn 2C^2V."""
    C, Kd, Vd = 64, 128, 64
    cost = pallas_common.step_cost("forward", C, Kd, Vd, False, True, pallas_chunk.Fusion())
    assert cost["mxu_flops"] == 16 * C * C * Kd + 4 * C * C * Vd + 24 * C ** 3 + 6 * C * Kd * Vd
    safe = pallas_common.step_cost("forward", C, Kd, Vd, True, True, pallas_chunk.Fusion())
    assert safe["mxu_flops"] == cost["mxu_flops"] + 4 * C * C * Kd     # two factored sub-block matmuls
    assert safe["transcendentals"] < cost["transcendentals"] / 2       # ... instead of 16 explicit exp steps


# --- TPU lowering at the production shape: traced and lowered to Mosaic, never run -----------------------
PROD = dict(B=1, T=8192, H=16, K=128, V=128, max_segs=64)


def export_for_tpu(f):
    P = PROD
    bf = jnp.bfloat16
    args = [jax.ShapeDtypeStruct((P["B"], P["T"], P["H"], P["K"]), bf)] * 2 + [
        jax.ShapeDtypeStruct((P["B"], P["T"], P["H"], P["V"]), bf),
        jax.ShapeDtypeStruct((P["B"], P["T"], P["H"], P["K"]), jnp.float32),
        jax.ShapeDtypeStruct((P["B"], P["T"], P["H"]), jnp.float32),
        jax.ShapeDtypeStruct((P["B"], P["T"]), jnp.int32)]
    return jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()


@pytest.mark.parametrize("safe_gate", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_lowers_to_mosaic_for_tpu_at_production_shape(impl, safe_gate):
    def forward(q, k, v, g, beta, seg):
        return api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=64, max_segs=PROD["max_segs"],
                             safe_gate=safe_gate, output_final_state=True, interpret=False)

    def loss(*args):
        o, s = forward(*args)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    design = impl.removeprefix("pallas_")
    fwd_module = export_for_tpu(forward)
    grad_module = export_for_tpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    assert "tpu_custom_call" in fwd_module and "tpu_custom_call" in grad_module
    assert set(re.findall(rf"kda_{design}_\w+", fwd_module)) == {f"kda_{design}_fwd"}
    # the gradient: the forward (saving each chunk's WY inverse), the state-recompute and reverse-chunk kernels
    assert set(re.findall(rf"kda_{design}_\w+", grad_module)) == {f"kda_{design}_{k}" for k in ("fwd", "states", "bwd")}


# --- larger shapes -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_head_dim_128_longer_rows_fp32(naive, impl):
    rng = np.random.default_rng(10)
    Bs, Ts, Hs, Ks = 3, 300, 2, 128
    q, k, v, g, beta = make_inputs(rng, Bs, Ts, Hs, Ks, Ks)
    h0 = rng.standard_normal((Bs, Hs, Ks, Ks)).astype(np.float32)
    seg = segments_from_lengths([[64, 64, 1, 100, 71], [Ts], [7, 200]], Ts)
    o_ref, s_ref = per_document_oracle(naive, q, k, v, g, beta, seg, h0)
    w_o = rng.standard_normal(o_ref.shape).astype(np.float32)
    w_s = rng.standard_normal(s_ref.shape).astype(np.float32)

    def loss(impl, q, k, v, g, beta, h0):
        o, s = api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, max_segs=16, initial_state=h0,
                             output_final_state=True)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)
    grad = lambda name: jax.jit(jax.value_and_grad(functools.partial(loss, name), argnums=tuple(range(6)),
                                                   has_aux=True))(q, k, v, g, beta, h0)
    (_, (o, s)), grads = grad(impl)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=5e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), s_ref, atol=5e-5, rtol=1e-5)
    _, grads_ref = grad("chunked")
    assert_grads_close([np.asarray(x) for x in grads], [np.asarray(x) for x in grads_ref], atol=1e-4)
