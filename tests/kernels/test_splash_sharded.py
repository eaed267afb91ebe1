"""Splash attention on a sharded mesh (8 fake CPU devices): `kernels/shard.py` runs it per shard over rows
(`data`) and heads (`tensor`), each shard with a mask for its local heads.

Export for TPU lowers every splash Mosaic call inside the shard_map, none in interpret mode; the kernel
without the wrapper cannot be exported on the same mesh (what a TPU run of the flagship hit), which the
first test checks so that it can fail. Interpret mode on the mesh gives the single-device numbers.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lingpack import backend, hlo
from lingpack.kernels.attention import splash
from lingpack.kernels.attention.api import attention
from tests.kernels.kda_cases import segments_from_lengths

FWD = {"splash_mha_fwd_segmented_no_residuals": 1}
GRAD = {"splash_mha_fwd_segmented_residuals": 1, "splash_mha_dq_segmented_no_residuals": 1,
        "splash_mha_dkv_segmented_no_residuals": 1}


def data_tensor_mesh(data=4, tensor=2):
    return Mesh(np.asarray(jax.devices()[:data * tensor]).reshape(data, tensor), ("data", "tensor"))


def export_for_tpu(f, *args) -> tuple[str, dict]:
    """(the StableHLO module exported for TPU, the traced program's Pallas kernels by mode)."""
    jitted = jax.jit(f)
    with backend.target("tpu"):
        module = jax.export.export(jitted, platforms=["tpu"])(*args).mlir_module()
        return module, hlo.pallas_kernels(jitted.trace(*args).jaxpr)


def test_fwd_and_grad_export_for_tpu_on_data_x_tensor_mesh():
    """MLA's head dims (qk 192, v 128), bf16, T=1024, B=4, H=4 over data=4 x tensor=2: 1 row, 2 heads a shard."""
    mesh = data_tensor_mesh()
    tile = NamedSharding(mesh, P("data", None, "tensor", None))
    q = jax.ShapeDtypeStruct((4, 1024, 4, 192), jnp.bfloat16, sharding=tile)
    v = jax.ShapeDtypeStruct((4, 1024, 4, 128), jnp.bfloat16, sharding=tile)
    seg = jax.ShapeDtypeStruct((4, 1024), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))

    def forward(q, k, v, seg):
        return attention(q, k, v, segment_ids_BT=seg, impl="splash", block_size=512)

    def loss(q, k, v, seg):
        return jnp.sum(forward(q, k, v, seg).astype(jnp.float32))

    for f, kernels in ((forward, FWD), (jax.grad(loss, argnums=(0, 1, 2)), GRAD)):
        module, traced = export_for_tpu(f, q, q, v, seg)
        assert hlo.mosaic_calls(module) == kernels and traced == {"mosaic": kernels, "triton": {}, "interpret": {}}
        assert 'manual_axes={"data", "tensor"}' in module and "tensor<1x1024x2x192xbf16>" in module

    # the kernel without the mapping: XLA cannot partition its Mosaic call
    unwrapped = lambda q, k, v, seg: splash.splash_local(q, k, v, segment_ids_BT=seg, scale=0.1, causal=True,
                                                         block=512, interpret=False)
    with pytest.raises(NotImplementedError, match="shard_map"):
        export_for_tpu(unwrapped, q, q, v, seg)


def test_the_mosaic_count_sees_interpret_mode():
    """The export check above can fail: the same export with `interpret=True` is reported, kernel by kernel."""
    mesh = data_tensor_mesh()
    tile = NamedSharding(mesh, P("data", None, "tensor", None))
    q = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.float32, sharding=tile)
    seg = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))
    module, traced = export_for_tpu(
        lambda q, seg: attention(q, q, q, segment_ids_BT=seg, impl="splash", interpret=True), q, seg)
    assert hlo.mosaic_calls(module) == {} and traced == {"mosaic": {}, "triton": {}, "interpret": FWD}


def test_interpret_numerics_on_sharded_mesh_equal_single_device():
    """Packed rows with padding and a document crossing the 128 block: outputs and dq, dk, dv equal one device's."""
    B, T, H, K, V = 4, 256, 2, 16, 8
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    w_o = rng.standard_normal((B, T, H, V)).astype(np.float32)
    seg = segments_from_lengths([[100, 60, 1, 80], [T], [3, 200], []], T)

    def loss(q, k, v, seg):
        o = attention(q, k, v, segment_ids_BT=seg, impl="splash", interpret=True)
        return jnp.sum(o * w_o), o

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, o_ref), grads_ref = grad(q, k, v, seg)
    mesh = data_tensor_mesh()
    tile = NamedSharding(mesh, P("data", None, "tensor"))
    placed = [jax.device_put(x, tile) for x in (q, k, v)] + [jax.device_put(seg, NamedSharding(mesh, P("data")))]
    (_, o), grads = grad(*placed)
    assert tuple(o.sharding.spec)[:3] == ("data", None, "tensor")
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=1e-6, rtol=1e-5)
    for name, got, want in zip(["dq", "dk", "dv"], grads, grads_ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5, err_msg=name)
        assert np.abs(np.asarray(want)).max() > 0, name
