"""Every KDA implementation against FLA's naive recurrence (per document) and against `reference`."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lingpack.kernels.kda import api, segments
from tests.kernels.kda_cases import (documents, fla_naive_module, make_inputs, per_document_oracle, pallas_impls,
                                     rms_ratio, segments_from_lengths, xla_impls)

IMPLS = xla_impls()   # from the registry in api.py: a registered kernel gets these oracle tests
CHUNKED_IMPLS = [impl for impl in IMPLS if impl in api.CHUNKED]
B, T, H, K, V = 2, 150, 2, 32, 16
MAX_SEGS = 12
CHUNK = 32  # small chunks so T=150 spans several, with a ragged tail


@pytest.fixture(scope="module")
def naive():
    return fla_naive_module()


@functools.lru_cache(maxsize=None)
def jitted(impl, chunk_size=CHUNK, max_segs=MAX_SEGS, safe_gate=False):
    """One compiled program per case (eager calls would compile every op of the kernel for every shape)."""
    def run(q, k, v, g, beta, seg, h0):
        return api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=chunk_size,
                             max_segs=max_segs, initial_state=h0, output_final_state=True, safe_gate=safe_gate)
    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def jitted_grads(impl, chunk_size=CHUNK, max_segs=MAX_SEGS):
    def loss(q, k, v, g, beta, seg, h0, w_o, w_s):
        o, s = api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=chunk_size,
                             max_segs=max_segs, initial_state=h0, output_final_state=True)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6)))


LAYOUTS = {
    "two_rows_padding_len1": [[40, 1, 64, 35], [70, 80]],
    "row_boundary_same_id": [[T], [T - 10]],      # row 0's only id continues as row 1's id 1
    "exact_chunks": [[CHUNK, CHUNK, 2 * CHUNK], [CHUNK, 1, 1, 1, CHUNK + 3]],
    "all_padding_row": [[5, 7, 100], []],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_fla_naive_per_document(naive, impl, layout):
    rng = np.random.default_rng(0)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V)
    h0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    seg = segments_from_lengths(LAYOUTS[layout], T)
    o_ref, s_ref = per_document_oracle(naive, q, k, v, g, beta, seg, h0)
    o, s = jitted(impl)(q, k, v, g, beta, seg, h0)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), s_ref, atol=2e-5, rtol=1e-5)
    assert not np.asarray(o)[seg == 0].any(), "padding positions must output 0"


@pytest.mark.parametrize("safe_gate", [False, True])
def test_strong_decay_is_finite(naive, safe_gate):
    """Ling3's lower-bound gate lets g reach -5 per token: exp(-G) over a chunk would overflow fp32.

    With `safe_gate` the in-sub-chunk factor reaches exp(4.9 * 15), the factored path's worst regime."""
    rng = np.random.default_rng(1)
    q, k, v, _, beta = make_inputs(rng, 1, 128, 1, 32, 16)
    g = np.full((1, 128, 1, 32), -4.9, np.float32)
    g[..., ::2] = -0.01
    seg = np.ones((1, 128), np.int32)
    o_ref, s_ref = per_document_oracle(naive, q, k, v, g, beta, seg)
    for impl in CHUNKED_IMPLS:
        o, s = jitted(impl, 64, 2, safe_gate)(q, k, v, g, beta, seg, None)
        assert np.isfinite(np.asarray(o)).all()
        np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(s), s_ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("safe_gate", [False, True])
@pytest.mark.parametrize("impl", CHUNKED_IMPLS)
def test_chunk_size_not_a_power_of_two_matches_fla(naive, impl, safe_gate):
    """48 = 3 x 16 is a valid chunk size: the halving splits pad it internally (main crashed here once)."""
    rng = np.random.default_rng(5)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V)
    g = np.maximum(g, -5.0) if safe_gate else g
    seg = segments_from_lengths(LAYOUTS["two_rows_padding_len1"], T)
    o_ref, s_ref = per_document_oracle(naive, q, k, v, g, beta, seg)
    o, s = jitted(impl, 48, MAX_SEGS, safe_gate)(q, k, v, g, beta, seg, None)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), s_ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", CHUNKED_IMPLS)
def test_gradients_match_reference_fp32(impl):
    rng = np.random.default_rng(2)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V)
    h0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    w_o = rng.standard_normal((B, T, H, V)).astype(np.float32)
    w_s = rng.standard_normal((B, H, K, V)).astype(np.float32)
    seg = segments_from_lengths(LAYOUTS["two_rows_padding_len1"], T)
    ref = jitted_grads("reference")(q, k, v, g, beta, seg, h0, w_o, w_s)
    out = jitted_grads(impl)(q, k, v, g, beta, seg, h0, w_o, w_s)
    for name, r, o in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], ref, out):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=5e-5, rtol=1e-4, err_msg=name)
        assert np.abs(np.asarray(r)).max() > 0, name  # the gradient exists, so the comparison means something


@pytest.mark.parametrize("impl", CHUNKED_IMPLS)
def test_bf16_within_fla_tolerances(impl):
    rng = np.random.default_rng(3)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V)
    w_o = rng.standard_normal((B, T, H, V)).astype(np.float32)
    w_s = rng.standard_normal((B, H, K, V)).astype(np.float32)
    h0 = np.zeros((B, H, K, V), np.float32)
    seg = segments_from_lengths(LAYOUTS["two_rows_padding_len1"], T)
    o_ref, s_ref = jitted("reference")(q, k, v, g, beta, seg, h0)
    grads_ref = jitted_grads("reference")(q, k, v, g, beta, seg, h0, w_o, w_s)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, g, beta)]
    o, s = jitted(impl)(*bf, seg, h0)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32  # state stays fp32
    assert rms_ratio(o_ref, o.astype(jnp.float32)) < 0.005
    assert rms_ratio(s_ref, s) < 0.005
    grads = jitted_grads(impl)(*bf, seg, h0, w_o, w_s)
    limits = {"dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02, "dh0": 0.008}  # FLA's
    for (name, limit), r, o in zip(limits.items(), grads_ref, grads, strict=True):
        assert rms_ratio(r, np.asarray(o, np.float32)) < limit, name


def test_every_registered_impl_is_tested():
    """The two suites together cover the registry: XLA impls here, Pallas ones in test_kda_pallas.py."""
    assert sorted(IMPLS + pallas_impls()) == sorted(api.names())
    assert {"reference", "chunked", "chunked_aligned", "pallas_varlen", "pallas_segment"} <= set(api.names())


def row_lengths(max_docs, length_strategy):
    return st.lists(length_strategy, min_size=0, max_size=max_docs)


@st.composite
def segmentations(draw):
    """Rows of random document lengths: length-1 docs, exact chunks, ragged tails, trailing padding."""
    lengths = st.one_of(st.integers(1, 3), st.just(CHUNK), st.integers(1, T))
    rows = []
    for _ in range(B):
        row, used = [], 0
        for n in draw(row_lengths(6, lengths)):
            if used + n > T:
                break
            row.append(n)
            used += n
        if draw(st.booleans()) and used < T:  # often fill the row completely, else leave padding
            row.append(T - used)
        rows.append(row)
    return segments_from_lengths(rows, T)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seg=segmentations(), seed=st.integers(0, 2**16))
def test_random_segmentations_all_impls_agree_with_oracle(seg, seed):
    naive = fla_naive_module()
    rng = np.random.default_rng(seed)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V)
    h0 = rng.standard_normal((B, H, K, V)).astype(np.float32)
    o_ref, s_ref = per_document_oracle(naive, q, k, v, g, beta, seg, h0)
    n_segs = int(segments.num_segments(jnp.asarray(seg)))
    for impl in IMPLS:
        if api.needs_max_segs(impl) and n_segs > MAX_SEGS:
            with pytest.raises(segments.SegmentError, match="max_segs"):
                api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, max_segs=MAX_SEGS)
            continue
        o, s = jitted(impl)(q, k, v, g, beta, seg, h0)
        np.testing.assert_allclose(np.asarray(o), o_ref, atol=3e-5, rtol=1e-5, err_msg=impl)
        np.testing.assert_allclose(np.asarray(s), s_ref, atol=3e-5, rtol=1e-5, err_msg=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_packing_invariance(impl):
    """Each document's output in a packed batch equals that document run alone through the same impl."""
    rng = np.random.default_rng(4)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V)
    seg = segments_from_lengths(LAYOUTS["two_rows_padding_len1"], T)
    o, _ = jitted(impl)(q, k, v, g, beta, seg, None)
    alone_fn = jitted(impl, max_segs=1)  # one compiled shape: each document alone at the start of a padded row
    for b, idx in documents(seg):
        n = len(idx)
        alone = [np.zeros_like(x[:1]) for x in (q, k, v, g, beta)]
        for a, x in zip(alone, (q, k, v, g, beta)):
            a[0, :n] = x[b, idx]
        o_alone, _ = alone_fn(*alone, (np.arange(T) < n)[None].astype(np.int32), None)
        np.testing.assert_allclose(np.asarray(o)[b, idx], np.asarray(o_alone)[0, :n], atol=2e-5, rtol=1e-5)


def test_no_segment_ids_is_one_document_per_row(naive):
    rng = np.random.default_rng(5)
    q, k, v, g, beta = make_inputs(rng, 2, 70, 1, 16, 16)
    seg = np.ones((2, 70), np.int32)
    o_ref, _ = per_document_oracle(naive, q, k, v, g, beta, seg)
    for impl in IMPLS:
        o, _ = jitted(impl, 16, 2)(q, k, v, g, beta, None, None)
        np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5, rtol=1e-5)


def test_gate_and_l2norm_in_kernel_match_outside():
    rng = np.random.default_rng(6)
    q, k, v, _, beta = make_inputs(rng, 1, 64, 2, 16, 16)
    g_raw = rng.standard_normal((1, 64, 2, 16)).astype(np.float32)
    A_log = np.log(rng.uniform(1, 16, 2)).astype(np.float32)
    dt_bias = rng.standard_normal(32).astype(np.float32)
    from lingpack.kernels.kda import gate
    for lower_bound in (None, -5.0):
        def outside(q, k, v, g_raw, beta):
            g = gate.kda_gate(g_raw, A_log, dt_bias, lower_bound)
            return api.chunk_kda(gate.l2norm(q), gate.l2norm(k), v, g, beta, chunk_size=16)[0]

        def inside(q, k, v, g_raw, beta):
            return api.chunk_kda(q, k, v, g_raw, beta, chunk_size=16, use_gate_in_kernel=True, A_log=A_log,
                                 dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm_in_kernel=True)[0]
        o_out, o_in = [jax.jit(f)(q, k, v, g_raw, beta) for f in (outside, inside)]
        np.testing.assert_allclose(np.asarray(o_in), np.asarray(o_out), atol=1e-6)


def test_bad_arguments_name_the_argument():
    rng = np.random.default_rng(7)
    q, k, v, g, beta = make_inputs(rng, 1, 32, 1, 16, 16)
    with pytest.raises(ValueError, match="k must have shape"):
        api.chunk_kda(q, k[:, :16], v, g, beta)
    with pytest.raises(ValueError, match="beta must have shape"):
        api.chunk_kda(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="share a dtype"):
        api.chunk_kda(q, k.astype(jnp.bfloat16), v, g, beta)
    with pytest.raises(ValueError, match="chunk_size"):
        api.chunk_kda(q, k, v, g, beta, chunk_size=24)
    with pytest.raises(ValueError, match="unknown KDA impl"):
        api.chunk_kda(q, k, v, g, beta, impl="fast")
    with pytest.raises(ValueError, match="max_segs"):
        api.chunk_kda(q, k, v, g, beta, impl="chunked_aligned")
    with pytest.raises(segments.SegmentError, match="decreases at position 3"):
        api.chunk_kda(q, k, v, g, beta, segment_ids=np.array([[1, 1, 2, 1] + [1] * 28], np.int32))
    with pytest.raises(segments.SegmentError, match="padding"):
        api.chunk_kda(q, k, v, g, beta, segment_ids=np.array([[1, 0, 2] + [2] * 29], np.int32))
    with pytest.raises(segments.SegmentError, match="integer"):
        api.chunk_kda(q, k, v, g, beta, segment_ids=np.ones((1, 32), np.float32))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("safe_gate", [False, True])
def test_other_documents_get_exactly_zero_gradient(impl, safe_gate):
    """d(document 2's output) / d(document 1's q, k, v, g, beta) is exactly 0, not just small."""
    rng = np.random.default_rng(8)
    q, k, v, g, beta = make_inputs(rng, 1, 96, 1, 16, 16)
    g = np.maximum(g * 3.0, -5.0)  # strong decays: rounding leaks through G_c - G_i would show
    seg = segments_from_lengths([[37, 59]], 96)
    doc2 = jnp.asarray(seg == 2)[..., None, None]

    def loss(q, k, v, g, beta):
        o, _ = api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=32, max_segs=4,
                             safe_gate=safe_gate)
        return jnp.sum(jnp.where(doc2, o, 0.0) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)
    for name, grad in zip(["dq", "dk", "dv", "dg", "dbeta"], grads):
        grad = np.asarray(grad)
        assert np.abs(grad[0, 37:]).max() > 0, name
        assert (grad[0, :37] == 0).all(), f"{name} leaks into document 1: {np.abs(grad[0, :37]).max()}"


@pytest.mark.parametrize("impl", [impl for impl in IMPLS if api.needs_max_segs(impl)])
def test_overflow_under_jit_keeps_survivors_exact_and_drops_the_rest(naive, impl):
    """More documents than max_segs under jit (no eager error possible): the first max_segs documents (flattened
    order) match the oracle exactly; every later one outputs exactly 0, gets exactly 0 gradient, and sends
    none to the survivors."""
    rng = np.random.default_rng(9)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V)
    seg = segments_from_lengths([[40, 1, 64, 35], [30, 20, 25, 10, 50]], T)   # 9 documents
    max_segs = 6
    order = list(documents(seg))
    survivors, dropped = order[:max_segs], order[max_segs:]
    keep = np.zeros((B, T), bool)
    for b, idx in survivors:
        keep[b, idx] = True
    gone = (seg != 0) & ~keep
    w_o = rng.standard_normal((B, T, H, V)).astype(np.float32)

    @jax.jit
    def forward_and_grads(seg_traced, weights, q, k, v, g, beta):   # traced ids: the overflow cannot raise eagerly
        def loss(q, k, v, g, beta):
            o, _ = api.chunk_kda(q, k, v, g, beta, segment_ids=seg_traced, impl=impl, chunk_size=CHUNK,
                                 max_segs=max_segs)
            return jnp.sum(o * weights), o
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, g, beta)

    (_, o), grads = forward_and_grads(seg, w_o, q, k, v, g, beta)
    o_ref, _ = per_document_oracle(naive, q, k, v, g, beta, np.where(keep, seg, 0))
    np.testing.assert_allclose(np.asarray(o)[keep], o_ref[keep], atol=2e-5, rtol=1e-5)
    assert len(dropped) == 3 and not np.asarray(o)[gone].any(), "dropped documents must output exactly 0"
    for name, grad in zip(["dq", "dk", "dv", "dg", "dbeta"], grads):
        assert not np.asarray(grad)[gone].any(), f"{name}: a dropped document receives gradient"
        assert np.abs(np.asarray(grad)[keep]).max() > 0, name
    # from them: weighting only the dropped positions' outputs gives exactly zero gradient everywhere
    (_, _), grads = forward_and_grads(seg, np.where(gone[..., None, None], w_o, 0.0), q, k, v, g, beta)
    for name, grad in zip(["dq", "dk", "dv", "dg", "dbeta"], grads):
        assert not np.asarray(grad).any(), f"{name}: dropped outputs send gradient"
