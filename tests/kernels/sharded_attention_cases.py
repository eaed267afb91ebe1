"""Shared by the sharded Pallas attention tests (splash on TPU, pallas_triton on GPU): the mesh and the
interpret-mode check that a kernel under the mapping helper equals one device."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lingpack.kernels.attention.api import attention
from tests.kernels.kda_cases import segments_from_lengths


def data_tensor_mesh(data=4, tensor=2):
    return Mesh(np.asarray(jax.devices()[:data * tensor]).reshape(data, tensor), ("data", "tensor"))


def check_sharded_equals_single_device(impl: str) -> None:
    """Packed rows with padding and a document crossing a 128 tile, on data 4 x tensor 2 in interpret mode:
    outputs and dq, dk, dv equal one device's (and the output keeps the rows x heads sharding)."""
    B, T, H, K, V = 4, 256, 2, 16, 8
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    w_o = rng.standard_normal((B, T, H, V)).astype(np.float32)
    seg = segments_from_lengths([[100, 60, 1, 80], [T], [3, 200], []], T)

    def loss(q, k, v, seg):
        o = attention(q, k, v, segment_ids_BT=seg, impl=impl, interpret=True)
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
