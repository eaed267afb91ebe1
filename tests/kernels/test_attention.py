"""Segment-aware attention: every impl against torch's SDPA run on each document alone (the oracle)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lingpack import precision
from lingpack.kernels.attention.api import IMPLS, attention
from tests.optional import lazy

torch = lazy("torch")   # the per-document SDPA oracle; the other tests run without the parity extra


def _segments(rows, T):
    seg = np.zeros((len(rows), T), np.int32)
    for b, lengths in enumerate(rows):
        pos = 0
        for i, n in enumerate(lengths):
            seg[b, pos:pos + n] = i + 1
            pos += n
    return seg


def _inputs(B, T, H, K, V, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in ((B, T, H, K), (B, T, H, K), (B, T, H, V))]


def _torch_per_document(q, k, v, seg, scale, weights_o=None):
    """o and (if weights_o) grads of sum(o * weights_o), computed by SDPA per document; padding -> 0."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=tq.dtype)
    for b, row in enumerate(seg):
        for s in np.unique(row[row > 0]):
            idx = torch.tensor(np.nonzero(row == s)[0])
            sl = lambda x: x[b, idx].transpose(0, 1)[None]  # [1, H, n, *]
            o = torch.nn.functional.scaled_dot_product_attention(sl(tq), sl(tk), sl(tv), is_causal=True, scale=scale)
            out = out.index_put((torch.tensor(b), idx), o[0].transpose(0, 1))
    grads = None
    if weights_o is not None:
        (out * torch.tensor(weights_o)).sum().backward()
        grads = [t.grad.numpy() for t in (tq, tk, tv)]
    return out.detach().numpy(), grads


CASES = [
    ([[5, 1, 20, 6]], 40),                 # length-1 document, trailing padding
    ([[33, 31], [1, 1, 62], [64]], 64),    # several rows, repeated ids across rows
    ([[130, 3, 7]], 150),                  # more than one splash/flash/pallas_triton tile, padding to 256
]


# pallas_triton runs in Pallas interpret mode here (seconds per case): the default suite takes its case with
# several tiles, a 3-token document and padding (outputs and gradients per document); `make test-all` the rest
SLOW = pytest.mark.slow
CASE_IMPLS = [pytest.param(impl, rows, T, marks=[SLOW] if impl == "pallas_triton" and T != 150 else [],
                           id=f"{impl}-T{T}") for rows, T in CASES for impl in IMPLS]


@pytest.mark.parametrize("impl,rows,T", CASE_IMPLS)
def test_matches_per_document_sdpa(impl, rows, T):
    H, K, V = 2, 16, 8
    seg = _segments(rows, T)
    q, k, v = _inputs(len(rows), T, H, K, V)
    scale = K ** -0.5
    w = np.random.default_rng(1).standard_normal(q.shape[:3] + (V,)).astype(np.float32)
    ref_o, ref_grads = _torch_per_document(q, k, v, seg, scale, w)

    def f(q, k, v):
        o = attention(q, k, v, segment_ids_BT=jnp.asarray(seg), impl=impl, block_size=32 if impl == "flash" else 128)
        return jnp.sum(o * w), o

    (_, o), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), r, atol=5e-5, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.parametrize("impl", ["dot_product", "flash"])
def test_float64_matches_per_document_sdpa_in_float64(impl):
    """float64 inputs: softmax, accumulators and gradients in float64 (fp32 inside would miss 1e-12 by ~1e-7)."""
    (rows, T), (H, K, V) = CASES[1], (2, 16, 8)
    seg = _segments(rows, T)
    q, k, v = _inputs(len(rows), T, H, K, V, dtype=np.float64)
    w = np.random.default_rng(1).standard_normal(q.shape[:3] + (V,))
    ref_o, ref_grads = _torch_per_document(q, k, v, seg, K ** -0.5, w)
    f = lambda q, k, v: attention(q, k, v, segment_ids_BT=jnp.asarray(seg), impl=impl, block_size=16)
    with precision.x64(True):
        o, vjp = jax.vjp(f, q, k, v)
        grads = vjp(jnp.asarray(w))
        for fp32_kernel in ("splash", "pallas_triton"):
            with pytest.raises(ValueError, match="float64 inputs would be rounded"):
                attention(q, k, v, impl=fp32_kernel)
        assert attention(q, k, v, impl="auto").dtype == jnp.float64   # auto takes flash for float64
    assert o.dtype == jnp.float64 and all(g.dtype == jnp.float64 for g in grads)
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=1e-12, rtol=1e-12)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-12, rtol=1e-11, err_msg=f"d{name}")


@pytest.mark.parametrize("impl", [pytest.param(i, marks=[SLOW] if i == "pallas_triton" else []) for i in IMPLS])
def test_padding_rows_are_zero_and_finite(impl):
    """An all-padding row (every query fully masked) outputs 0 with finite gradients."""
    seg = _segments([[4, 3], []], 16)
    q, k, v = _inputs(2, 16, 2, 8, 8)
    f = lambda q, k, v: attention(q, k, v, segment_ids_BT=jnp.asarray(seg), impl=impl, block_size=8 if impl == "flash" else 128)
    o = f(q, k, v)
    assert np.all(np.asarray(o)[1] == 0) and np.all(np.asarray(o)[0, 7:] == 0)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_flash_memory_is_linear_in_T():
    """The flash forward + backward never builds a [T, T] array (checked in the jaxpr)."""
    T, blk = 256, 32
    seg = jnp.ones((1, T), jnp.int32)
    q = jnp.ones((1, T, 1, 8))
    f = lambda q: jnp.sum(attention(q, q, q, segment_ids_BT=seg, impl="flash", block_size=blk))
    jaxpr = jax.make_jaxpr(jax.grad(f))(q)

    def shapes(jx):
        for eqn in jx.eqns:
            for var in eqn.outvars:
                yield getattr(var.aval, "shape", ())
            for sub in jax.core.subjaxprs(jx) if hasattr(jax.core, "subjaxprs") else []:
                yield from shapes(sub)
            for p in eqn.params.values():
                if hasattr(p, "jaxpr"):
                    yield from shapes(p.jaxpr)
    assert max(int(np.prod(s)) for s in shapes(jaxpr.jaxpr)) < T * T
    dense = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(attention(q, q, q, segment_ids_BT=seg))))(q)
    assert max(int(np.prod(s)) for s in shapes(dense.jaxpr)) >= T * T  # the check can fail


def test_unknown_impl_names_choices():
    q = jnp.ones((1, 4, 1, 8))
    with pytest.raises(ValueError, match="dot_product"):
        attention(q, q, q, impl="ring")


@pytest.mark.parametrize("impl", [pytest.param(i, marks=[SLOW] if i == "pallas_triton" else []) for i in IMPLS])
def test_gradients_never_cross_documents(impl):
    """d(outputs of one document) / d(q, k, v of every other token) is exactly zero."""
    seg = _segments([[9, 1, 12], [20]], 24)
    q, k, v = _inputs(2, 24, 2, 8, 8, seed=3)
    mine = jnp.asarray(seg == 3)[0]  # the third document of row 0

    def loss(q, k, v):
        o = attention(q, k, v, segment_ids_BT=jnp.asarray(seg), impl=impl, block_size=8 if impl == "flash" else 128)
        return jnp.sum(o[0] * mine[:, None, None])
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    outside = np.ones(seg.shape, bool)
    outside[0] = ~np.asarray(mine)
    for g in grads:
        g = np.asarray(g)
        assert np.all(g[outside] == 0.0) and np.abs(g[~outside]).max() > 0


def test_splash_lowers_for_tpu_with_mla_head_dims():
    """Forward and backward lower to Mosaic custom calls (no TPU needed): catches block-shape errors in CI."""
    f = lambda q, k, v, s: attention(q, k, v, segment_ids_BT=s, impl="splash", interpret=False)
    qk = jax.ShapeDtypeStruct((2, 256, 2, 192), jnp.bfloat16)   # MLA: qk_nope 128 + qk_rope 64, v 128
    shapes = (qk, qk, jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2, 256), jnp.int32))
    fwd = jax.export.export(jax.jit(f), platforms=["tpu"])(*shapes)
    assert "tpu_custom_call" in fwd.mlir_module()
    grad = jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    bwd = jax.export.export(jax.jit(grad), platforms=["tpu"])(*shapes)
    assert bwd.mlir_module().count("tpu_custom_call") >= 3  # forward, dq, dkv kernels


def test_flash_tile_counts_match_the_tiles_computed():
    """`tile_counts` (what the bench logs) counts exactly the tiles the kernel computes, and it skips."""
    from lingpack.kernels.attention.blockwise import Tiling, forward_tiles, init_softmax
    from lingpack.kernels.attention.flash import tile_counts
    seg = _segments([[64, 32, 16, 16], [128]], 128)
    q, k, v = (jnp.asarray(x).swapaxes(1, 2) for x in _inputs(2, 128, 1, 8, 8))
    index = jnp.arange(128)
    _, computed = forward_tiles(init_softmax(2, 1, 128, 8), q, k, v, seg, seg, index, index, Tiling(1.0, True, 32, 32))
    assert tile_counts(seg, block=32) == (int(computed), 16) == (10, 16)  # row 1's one document: causal tiles only
    assert tile_counts(seg[:1], block=32) == (5, 16)                        # 3 for the 64-token document + 2 diagonal
    assert tile_counts(seg[:1], block=32, causal=False) == (6, 16)
