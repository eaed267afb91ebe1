"""lingpack.hlo counts the collectives a compiled program executes, with their bytes and loop trip counts."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack import hlo


def _mesh():
    return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))


def test_a_contraction_sharded_over_its_inner_dim_all_reduces_its_partial_products_once():
    mesh = _mesh()
    x = jax.device_put(np.ones((16, 64), np.float32), NamedSharding(mesh, P(None, "d")))
    w = jax.device_put(np.ones((64, 32), np.float32), NamedSharding(mesh, P("d", None)))
    matmul = jax.jit(lambda x, w: jnp.dot(x, w, out_sharding=P()))
    with jax.set_mesh(mesh):
        got = hlo.collectives(matmul.lower(x, w).compile().as_text())
    assert got["by_kind"] == {"all-reduce": {"count": 1, "bytes": 16 * 32 * 4}}   # each device's [16, 32] partial


def test_a_loop_multiplies_by_its_trip_count_and_result_dims_are_read():
    mesh = _mesh()
    x = jax.device_put(np.ones((16, 64), np.float32), NamedSharding(mesh, P(None, "d")))
    w = jax.device_put(np.ones((64, 64), np.float32), NamedSharding(mesh, P("d", None)))

    def body(_, x):
        y = jnp.dot(x, w, out_sharding=P())
        return jax.sharding.reshard(jnp.tanh(y), P(None, "d"))
    looped = jax.jit(lambda x: jax.lax.fori_loop(0, 5, body, x))
    with jax.set_mesh(mesh):
        text = looped.lower(x).compile().as_text()
    ops, unknown = hlo.collective_ops(text)
    reduces = [op for op in ops if op.kind == "all-reduce"]
    assert unknown == 0 and [(op.times, op.dims, op.bytes) for op in reduces] == [(5, [(16, 64)], 16 * 64 * 4)]
    assert hlo.collectives(text)["by_kind"]["all-reduce"]["count"] == 5
