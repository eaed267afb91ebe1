"""Splash attention on a sharded mesh (8 fake CPU devices): `kernels/shard.py` runs it per shard over rows
(`data`) and heads (`tensor`), each shard with a mask for its local heads.

Export for TPU lowers every splash Mosaic call inside the shard_map, none in interpret mode; the kernel
without the wrapper cannot be exported on the same mesh (what a TPU run of the flagship hit), which the
first test checks so that it can fail. Interpret mode on the mesh gives the single-device numbers.
"""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack import backend
from lingpack.plan import hlo
from lingpack.kernels.attention import splash
from lingpack.kernels.attention.api import attention
from tests.kernels.sharded_attention_cases import check_sharded_equals_single_device, data_tensor_mesh

FWD = {"splash_mha_fwd_segmented_no_residuals": 1}
GRAD = {"splash_mha_fwd_segmented_residuals": 1, "splash_mha_dq_segmented_no_residuals": 1,
        "splash_mha_dkv_segmented_no_residuals": 1}


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
    check_sharded_equals_single_device("splash")