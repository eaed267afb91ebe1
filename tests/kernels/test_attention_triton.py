"""pallas_triton (JAX's Pallas GPU flash attention) on a sharded mesh, exported for CUDA from this CPU host.

Its numerics against torch's per-document SDPA (interpret mode) are in test_attention.py. Here: traced as a
GPU run traces it (the backend target), forward and backward lower to Triton custom calls inside
`kernels/shard.py`'s shard_map, on each shard's rows and heads, none in interpret mode; the kernel without
the mapping exports on global shapes (the check can fail), and interpret mode is seen in the traced jaxpr
(`lingpack.plan.hlo.pallas_kernels`).
"""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack import backend
from lingpack.plan import hlo
from lingpack.kernels.attention import pallas_triton
from lingpack.kernels.attention.api import attention
from tests.kernels.sharded_attention_cases import check_sharded_equals_single_device, data_tensor_mesh
from tests.kernels.triton_cases import TRITON_FWD, TRITON_GRAD_NAMES, triton_operand_types

WAIVED = [jax.export.DisabledSafetyCheck.custom_call(hlo.TRITON_CALL)]


def export_for_cuda(f, *args) -> tuple[str, dict]:
    """(the StableHLO module exported for CUDA, the traced program's Pallas kernels by mode)."""
    jitted = jax.jit(f)
    with backend.target("gpu"):
        module = jax.export.export(jitted, platforms=["cuda"], disabled_checks=WAIVED)(*args).mlir_module()
        return module, hlo.pallas_kernels(jitted.trace(*args).jaxpr)


def mla_shapes(mesh, B=4, T=1024, H=4):
    """MLA's head dims (qk 192, v 128) in bf16, sharded rows over `data` and heads over `tensor`."""
    tile = NamedSharding(mesh, P("data", None, "tensor", None))
    qk = jax.ShapeDtypeStruct((B, T, H, 192), jnp.bfloat16, sharding=tile)
    v = jax.ShapeDtypeStruct((B, T, H, 128), jnp.bfloat16, sharding=tile)
    return qk, qk, v, jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))


def test_fwd_and_grad_export_for_cuda_per_shard_on_data_x_tensor_mesh():
    """B=4, H=4 over data=4 x tensor=2: every Triton call sees 1 row and 2 heads (v padded to q's 192)."""
    mesh = data_tensor_mesh()
    forward = lambda q, k, v, s: attention(q, k, v, segment_ids_BT=s, impl="auto")
    loss = lambda *a: jnp.sum(forward(*a).astype(jnp.float32))
    for f, names in ((forward, set(TRITON_FWD)), (jax.grad(loss, argnums=(0, 1, 2)), TRITON_GRAD_NAMES)):
        module, traced = export_for_cuda(f, *mla_shapes(mesh))
        assert set(hlo.triton_calls(module)) == set(traced["triton"]) == names
        assert traced["mosaic"] == traced["interpret"] == {} and "tpu_custom_call" not in module
        assert 'manual_axes={"data", "tensor"}' in module
        assert triton_operand_types(module) >= {"tensor<1x1024x2x192xbf16>", "tensor<1x1024xi32>"}
        assert not any(t.startswith("tensor<4x") for t in triton_operand_types(module))


def test_the_checks_can_fail():
    """Without the mapping the kernel's calls take the global 4 rows x 4 heads (XLA would gather every row
    onto every device to run them); with interpret=True the jaxpr count reports the emulated kernel."""
    mesh = data_tensor_mesh()
    shardings = [a.sharding for a in mla_shapes(mesh)]
    plain = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in mla_shapes(mesh)]
    unwrapped = jax.jit(lambda q, k, v, s: pallas_triton.triton_local(q, k, v, segment_ids_BT=s, scale=0.1, causal=True,
                                                                       interpret=False), in_shardings=shardings)
    with backend.target("gpu"):
        module = jax.export.export(unwrapped, platforms=["cuda"], disabled_checks=WAIVED)(*plain).mlir_module()
    assert "tensor<4x1024x4x192xbf16>" in triton_operand_types(module)
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    module, traced = export_for_cuda(lambda q, s: attention(q, q, q, segment_ids_BT=s, impl="auto", interpret=True),
                                     q, seg)
    assert traced == {"mosaic": {}, "triton": {}, "interpret": TRITON_FWD} and hlo.triton_calls(module) == {}


@pytest.mark.slow
def test_interpret_numerics_on_sharded_mesh_equal_single_device():
    check_sharded_equals_single_device("pallas_triton")