"""The Pallas backward of the segment-masked short convolution (kernels/short_conv.py), in interpret mode on CPU
against autodiff of the plain conv (`segment_causal_conv`, itself checked against torch in
tests/models/test_layers.py), and compiled by Mosaic (libtpu, no TPU attached) at the flagship's KDA width."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lingpack.kernels import mosaic
from lingpack.kernels import short_conv as kernel
from lingpack.models.layers import ShortConvolution, segment_causal_conv, short_conv

ROOT = Path(__file__).resolve().parents[2]
FLAGSHIP = yaml.safe_load((ROOT / "conf/model/ling3_flagship.yaml").read_text())["kda"]


def _inputs(B, T, C, K, W, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x, d = (jnp.asarray(rng.normal(size=(B, T, C)), dtype) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(K, C)) * 0.5, dtype)
    seg = jnp.asarray(np.sort(rng.integers(0, 4, size=(B, T)), axis=1), jnp.int32)   # 1-4 documents a row
    prev = jnp.asarray(rng.normal(size=(B, W, C)), dtype) if W else None
    prev_ids = jnp.asarray(rng.integers(0, 2, size=(B, W)), jnp.int32) if W else None   # some rows continue doc 0
    return x, w, seg, d, prev, prev_ids


def _oracle(x, w, seg, d, prev, prev_ids, silu):
    """Autodiff of the conv over [halo | block] (fp32): (dx, d_kernel, d_halo)."""
    W = 0 if prev is None else prev.shape[1]

    def out(x, w, prev):
        x_ext = x if prev is None else jnp.concatenate([prev, x], 1)
        ids = seg if prev is None else jnp.concatenate([prev_ids, seg], 1)
        y = segment_causal_conv(x_ext, w, ids)[:, W:]
        return jax.nn.silu(y) if silu else y
    args = [a.astype(jnp.float32) for a in (x, w)] + [None if prev is None else prev.astype(jnp.float32)]
    _, vjp = jax.vjp(out, *args)
    return vjp(d.astype(jnp.float32))


@pytest.mark.parametrize("B,T,C,K,W,rows,cols,silu", [(2, 48, 256, 4, 0, 16, 128, True),   # 3 x 2 blocks
                                                      (1, 40, 128, 4, 3, 8, None, False),  # 5 blocks, a CP halo
                                                      (2, 64, 256, 3, 2, None, None, True)])  # K=3, one block
def test_backward_matches_autodiff_fp32(B, T, C, K, W, rows, cols, silu):
    x, w, seg, d, prev, prev_ids = _inputs(B, T, C, K, W, jnp.float32)
    got = kernel.short_conv_bwd(x, w, seg, d, prev, prev_ids, silu=silu, interpret=True, rows=rows, cols=cols)
    want = _oracle(x, w, seg, d, prev, prev_ids, silu)
    for g, r in zip(got, want):
        if r is None:
            assert g is None
            continue
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(r))))


def test_bf16_backward_is_the_xla_backward():
    """bf16, as the KDA layer runs it: the same fp32 math per token as the XLA backward, so dx to the rounding
    of its last add (an ulp of bf16 at most), the kernel gradient to fp32 summation order."""
    x, w, seg, d, prev, prev_ids = _inputs(2, 64, 256, 4, 3, jnp.bfloat16, seed=1)
    _, vjp = jax.vjp(lambda x, w, p: short_conv(x, w, seg, "silu", p, prev_ids), x, w, prev)
    want = vjp(d)
    _, vjp = jax.vjp(lambda x, w, p: short_conv(x, w, seg, "silu", p, prev_ids, "pallas_interpret"), x, w, prev)
    got = vjp(d)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        np.testing.assert_allclose(g, r, rtol=2 ** -7, atol=2 ** -7 * np.abs(r).max())


def test_no_token_crosses_a_document_boundary():
    """The cotangent of one document's outputs reaches only that document's inputs, also across block edges."""
    B, T, C, K = 1, 32, 128, 4
    seg = jnp.asarray(np.repeat([0, 1, 2], [9, 8, 15])[None], jnp.int32)   # boundaries at 9 and 17, blocks of 8
    x = jnp.ones((B, T, C))
    d = jnp.zeros((B, T, C)).at[:, 9:17].set(1.0)   # only document 1's outputs
    dx, _, _ = kernel.short_conv_bwd(x, jnp.ones((K, C)), seg, d, silu=True, interpret=True, rows=8)
    touched = np.flatnonzero(np.abs(np.asarray(dx[0, :, 0])) > 0)
    assert touched.min() == 9 and touched.max() == 16


def test_module_runs_the_kernel_where_configured():
    """ShortConvolution with the Pallas backward (`kernel.short_conv=pallas`): the kernel in the jaxpr, XLA's
    gradients; without it, XLA's backward (no Pallas call)."""
    x = jax.random.normal(jax.random.key(0), (2, 32, 128))
    seg = jnp.asarray(np.repeat([[0, 1], [0, 0]], 16, axis=1), jnp.int32)
    grads = {}
    for pallas in (True, False):
        conv = ShortConvolution(128, 4, pallas_backward=pallas, interpret=True, rngs=nnx.Rngs(0))
        loss = lambda x: jnp.sum(conv(x, seg) ** 2)
        assert ("pallas_call" in str(jax.make_jaxpr(jax.grad(loss))(x))) == pallas
        grads[pallas] = jax.grad(loss)(x)
    np.testing.assert_allclose(grads[True], grads[False], rtol=1e-5, atol=1e-6)


def test_the_kernel_group_selects_it_and_refuses_unknown_names():
    from lingpack.config import ConfigError, KernelConfig
    from lingpack.models.kda import KDA, KDAConfig, KDAKernel
    layer = KDA(KDAConfig(num_heads=2, head_dim=64), 32, kernel=KDAKernel(short_conv="pallas", interpret=True),
                rngs=nnx.Rngs(0))
    assert layer.q_conv.pallas_backward and layer.v_conv.interpret
    with pytest.raises(ConfigError, match="kernel.short_conv='triton'"):
        KernelConfig(short_conv="triton")


def test_on_a_data_x_tensor_mesh_equals_one_device():
    """Rows over `data`, channels over `tensor` (8 fake CPU devices): each shard runs the kernel on its rows and
    channels, the kernel gradient's partials are summed across the rows' shards."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
    x, w, seg, d, prev, prev_ids = _inputs(4, 32, 256, 4, 3, jnp.float32, seed=2)
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    args = (put(x, "data", None, "tensor"), put(w, None, "tensor"), put(seg, "data"), put(d, "data", None, "tensor"),
            put(prev, "data", None, "tensor"), put(prev_ids, "data"))
    call = lambda *a: kernel.short_conv_bwd(*a, silu=True, interpret=True, rows=8, cols=128)
    assert "shard_map" in str(jax.make_jaxpr(call)(*args))
    for g, r in zip(call(*args), call(x, w, seg, d, prev, prev_ids)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(r))))


def test_shapes_it_does_not_take_are_refused_or_left_to_xla():
    assert kernel.supported(T=8192, C=2048, K=4) and not kernel.supported(T=8190, C=2048, K=4)
    x, w, seg, d, _, _ = _inputs(1, 12, 128, 4, 0, jnp.float32)
    with pytest.raises(ValueError, match="T % 8 == 0"):   # the module leaves such shapes to XLA's backward
        kernel.short_conv_bwd(x, w, seg, d, silu=True, interpret=True)
    conv = ShortConvolution(128, 4, pallas_backward=True, interpret=True, rngs=nnx.Rngs(0))
    assert "pallas_call" not in str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(conv(x, seg))))(x))


@pytest.mark.parametrize("generation", [pytest.param(g, marks=() if g == "v5p" else pytest.mark.slow)
                                        for g in mosaic.GENERATIONS])
def test_compiles_with_mosaic_at_the_flagship_width(generation):
    """T=8192 and the flagship's H*K channels, bf16: one kernel, its VMEM within its limit, its CostEstimate kept."""
    C = FLAGSHIP["num_heads"] * FLAGSHIP["head_dim"]
    fn, args = mosaic.short_conv_program(B=1, T=8192, C=C, K=FLAGSHIP["conv_size"])
    compiled, _ = mosaic.compile_for(fn, args, generation)
    (found,) = [k for k in mosaic.kernels(compiled.as_text()) if "short_conv_bwd" in k.name]
    assert 0 < found.vmem_used <= found.vmem_limit <= mosaic.VMEM_BYTES[generation]
    assert found.cost["bytes_accessed"] >= 3 * 8192 * C * 2   # x and the cotangent read, dx written, bf16
