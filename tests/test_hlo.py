"""lingpack.plan.hlo counts the collectives a compiled program executes, with their bytes and loop trip counts."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack.plan import hlo


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


def test_matmul_flops_count_every_trip_and_a_weighted_conditional_counts_its_share():
    """3 trips of two [64, 128] x [128, 32]-sized matmuls; then a loop of 4 trips whose cond takes a branch of two
    such matmuls or one of none: every branch counted by default, by the given share with `branch_weights`."""
    x, w = jnp.ones((64, 128)), jnp.ones((128, 32))
    looped = jax.jit(lambda x, w: jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ w) @ w.T + 1, x))
    compiled = looped.lower(x, w).compile()
    one = 2 * 64 * 128 * 32
    assert hlo.dot_flops(compiled.as_text()) == 3 * 2 * one
    assert compiled.cost_analysis()["flops"] < 3 * 2 * one        # XLA's count: the loop body once

    def body(i, y):
        with jax.named_scope("weighed"):
            return jax.lax.cond(i % 4 == 3, lambda y: jnp.tanh(y @ w) @ w.T, lambda y: jnp.sin(y), y)
    text = jax.jit(lambda x: jax.lax.fori_loop(0, 4, body, x)).lower(x).compile().as_text()
    share = lambda op, scope: [0.75, 0.25] if "/weighed/" in scope + "/" else None
    assert hlo.dot_flops(text) == 4 * 2 * one                     # as if the matmul branch ran every trip
    assert hlo.dot_flops(text, share) == 4 * 0.25 * 2 * one      # the trips that take it


def test_memory_traffic_counts_an_in_place_row_update_at_the_row_size():
    """64 trips writing one 4 KiB row of a 256 KiB buffer: about 2 x 4 KiB a trip, not the whole buffer."""
    def body(i, buf):
        return jax.lax.dynamic_update_slice(buf, jnp.full((1, 1024), i, jnp.float32), (i, 0))
    text = jax.jit(lambda b: jax.lax.fori_loop(0, 64, body, b)).lower(jnp.zeros((64, 1024))).compile().as_text()
    whole = 64 * 1024 * 4
    assert 64 * 4096 <= hlo.memory_traffic(text) < 64 * whole / 8


IN_PLACE_UNDER_CONVERTS = """HloModule m

%fused_update (param_0: bf16[129,16,32,1536], param_1: f32[1,16,32,1536], param_2: s32[]) -> bf16[129,16,32,1536] {
  %param_0 = bf16[129,16,32,1536]{3,2,1,0} parameter(0)
  %convert.1 = f32[129,16,32,1536]{3,2,1,0} convert(%param_0)
  %param_1 = f32[1,16,32,1536]{3,2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %dynamic-update-slice = f32[129,16,32,1536]{3,2,1,0} dynamic-update-slice(%convert.1, %param_1, %param_2, %zero, %zero, %zero)
  ROOT %convert.2 = bf16[129,16,32,1536]{3,2,1,0} convert(%dynamic-update-slice)
}

ENTRY %main (p0: bf16[129,16,32,1536], p1: f32[1,16,32,1536], p2: s32[]) -> bf16[129,16,32,1536] {
  %p0 = bf16[129,16,32,1536]{3,2,1,0} parameter(0)
  %p1 = f32[1,16,32,1536]{3,2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  ROOT %fusion = bf16[129,16,32,1536]{3,2,1,0} fusion(%p0, %p1, %p2), kind=kLoop, calls=%fused_update
}
"""


def test_an_in_place_update_under_converts_moves_its_update_not_the_buffer():
    """A fusion whose root converts a dynamic-update-slice of its converted buffer parameter (how XLA:CPU fuses a
    bf16 buffer's f32 row update) updates the buffer in place: it reads the f32 row and writes it as bf16, not
    the whole [129, 16, 32, 1536] buffer twice."""
    row = 16 * 32 * 1536
    assert hlo.memory_traffic(IN_PLACE_UNDER_CONVERTS) == row * 4 + row * 2 + 4


def test_a_conditional_without_its_own_name_stack_is_found_by_its_branches():
    """XLA:TPU drops the op_name of conditionals it clones or sinks into a loop (the layer stack's forward and
    remat mixer conds in the flagship step): the cond's scope then comes from its branches' instructions."""
    x, w = jnp.ones((64, 128)), jnp.ones((128, 32))

    def body(i, y):
        with jax.named_scope("weighed"):
            return jax.lax.cond(i % 4 == 3, lambda y: jnp.tanh(y @ w) @ w.T, lambda y: jnp.sin(y), y)
    text = jax.jit(lambda x: jax.lax.fori_loop(0, 4, body, x)).lower(x).compile().as_text()
    conds = [line for line in text.splitlines() if " conditional(" in line]
    assert conds and all("/weighed/cond" in hlo.op_name(line) for line in conds)
    stripped = re.sub(r'(conditional\(.*?)op_name="[^"]*"', r'\1op_name="conditional.4"', text)
    assert all(hlo.op_name(line) == "conditional.4" for line in stripped.splitlines() if " conditional(" in line)
    scopes = []
    share = lambda op, scope: scopes.append(scope) or ([0.75, 0.25] if "/weighed/" in scope + "/" else None)
    one = 2 * 64 * 128 * 32
    assert hlo.dot_flops(stripped, share) == 4 * 0.25 * 2 * one
    assert any(scope.endswith("weighed/cond") for scope in scopes), scopes


def test_a_while_weighted_n_runs_n_times():
    """A loop whose weight is [0] (the expert-parallel overflow rounds, not taken in the expected step) adds no
    FLOPs, [3] adds three trips; unweighted, a loop of unknown trip count counts once."""
    def f(x, w, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    text = jax.jit(f).lower(x, x, jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
    one = 2 * 64 ** 3
    weigh = lambda n: (lambda op, scope: [n] if op.opcode == "while" else None)
    assert hlo.dot_flops(text) == one
    assert hlo.dot_flops(text, weigh(0.0)) == 0
    assert hlo.dot_flops(text, weigh(3.0)) == 3 * one
