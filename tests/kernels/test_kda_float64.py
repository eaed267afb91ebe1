"""The XLA KDA kernels compute in float64 for float64 inputs: against FLA's naive recurrence run in float64
(its float32 upcasts widened) per document, and the chunked custom VJPs against autodiff of the reference.

fp32 arithmetic anywhere inside would cost ~1e-7; the bars here are ~1e-12, and the fp32 run of the same
inputs is shown to miss them (so an fp32 upcast left in a kernel fails these tests)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lingpack import precision
from tests.kernels.kda_cases import fla_naive_module, make_inputs, per_document_oracle, segments_from_lengths, xla_impls

B, T, H, K, V = 2, 100, 2, 16, 8
CHUNK = 32
ROWS = [[40, 1, 35], [70, 20]]   # padding, a 1-token document, a ragged chunk tail
IMPLS = xla_impls()


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    q, k, v, g, beta = make_inputs(rng, B, T, H, K, V, dtype=np.float64)
    h0 = rng.standard_normal((B, H, K, V))
    return (q, k, v, g, beta), segments_from_lengths(ROWS, T), h0, rng


@functools.lru_cache(maxsize=None)
def jitted(impl):
    from lingpack.kernels.kda import api
    return jax.jit(lambda q, k, v, g, beta, seg, h0: api.chunk_kda(
        q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=CHUNK, max_segs=8, initial_state=h0,
        output_final_state=True))


@pytest.mark.parametrize("impl", IMPLS)
def test_float64_matches_fla_naive_in_float64(case, impl):
    (q, k, v, g, beta), seg, h0, _ = case
    o_ref, s_ref = per_document_oracle(fla_naive_module(float64=True), q, k, v, g, beta, seg, h0)
    with precision.x64(True):
        o, s = jitted(impl)(q, k, v, g, beta, seg, h0)
        assert o.dtype == s.dtype == jnp.float64
        o32, s32 = jitted(impl)(*(x.astype(np.float32) for x in (q, k, v, g, beta)), seg, h0.astype(np.float32))
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=1e-12, rtol=1e-11)
    np.testing.assert_allclose(np.asarray(s), s_ref, atol=1e-12, rtol=1e-11)
    assert np.abs(np.asarray(o32, np.float64) - o_ref).max() > 1e-8  # fp32 arithmetic could not meet the bar


def test_float64_chunked_gradients_match_reference_autodiff(case):
    """Every closed-form VJP of the chunked kernel (WY inverse, inter-chunk scan) in float64."""
    from lingpack.kernels.kda import api
    (q, k, v, g, beta), seg, h0, rng = case
    w_o, w_s = rng.standard_normal((B, T, H, V)), rng.standard_normal((B, H, K, V))

    def grads(impl, dtype):
        def loss(q, k, v, g, beta, h0):
            o, s = api.chunk_kda(q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=CHUNK, initial_state=h0,
                                 output_final_state=True)
            return jnp.sum(o * w_o.astype(dtype)) + jnp.sum(s * w_s.astype(dtype))
        return jax.jit(jax.grad(loss, argnums=range(6)))(*(x.astype(dtype) for x in (q, k, v, g, beta, h0)))

    with precision.x64(True):
        ref, out, out32 = grads("reference", np.float64), grads("chunked", np.float64), grads("chunked", np.float32)
    for name, r, o, o32 in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], ref, out, out32, strict=True):
        r, o = np.asarray(r), np.asarray(o)
        assert o.dtype == np.float64 and np.abs(r).max() > 0, name
        np.testing.assert_allclose(o, r, atol=1e-11, rtol=1e-10, err_msg=name)
        assert np.abs(np.asarray(o32, np.float64) - r).max() > 1e-8, name   # what fp32 arithmetic gives
