"""Matmul precision, block shapes and per-step work of the Pallas KDA kernels, read from the traced
`pallas_call`s (tracing only: no TPU, no compile). Whether those blocks fit each TPU generation's VMEM is
Mosaic's to say: tests/kernels/test_mosaic_compile.py compiles them.
"""
import math

import jax
import jax.numpy as jnp
import pytest

from lingpack.kernels.kda import api, pallas_common

H, K, V, C = 4, 128, 128, 64


def kernel_eqns(impl, T, dtype=jnp.bfloat16, grad=True, **kw):
    """The pallas_call equations of forward (+ gradient) at [1, T, H, K]."""
    shapes = [jax.ShapeDtypeStruct((1, T, H, K), dtype)] * 3 + [jax.ShapeDtypeStruct((1, T, H, K), jnp.float32),
                                                                jax.ShapeDtypeStruct((1, T, H), jnp.float32)]
    seg = jnp.ones((1, T), jnp.int32)

    def loss(*a):
        o, s = api.chunk_kda(*a, segment_ids=seg, impl=impl, chunk_size=C, max_segs=64, output_final_state=True,
                             interpret=False, **kw)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
    fn = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)) if grad else loss
    return pallas_common.pallas_calls(jax.make_jaxpr(fn)(*shapes).jaxpr)


def traced_kernels(impl, T):
    """{kernel name: (its blocks, vmem_limit_bytes, per-step cost)} of forward + gradient at [1, T]."""
    return {eqn.params["name"]: ([(bm.block_shape, bm.array_aval.dtype) for bm in eqn.params["grid_mapping"].block_mappings],
                                 eqn.params["compiler_params"].vmem_limit_bytes,
                                 pallas_common.jaxpr_cost(eqn.params["jaxpr"]))
            for eqn in kernel_eqns(impl, T)}


@pytest.mark.parametrize("impl", ["pallas_segment", "pallas_varlen"])
def test_blocks_and_per_step_work_constant_up_to_1m_tokens(impl):
    """Per-chunk tables are fetched 8 chunks per block: neither the blocks nor a step's work grow with T."""
    short, long = traced_kernels(impl, 8192), traced_kernels(impl, 1 << 20)
    assert len(short) == 3 and short == long, (short.keys(), long.keys())


def dot_precisions(eqn) -> list:
    """(operand dtype, precision) of every matmul in a kernel body."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                precision = e.params["precision"]
                found.append((str(e.invars[0].aval.dtype), precision[0] if isinstance(precision, tuple) else precision))
            for value in e.params.values():
                inner = value if hasattr(value, "eqns") else getattr(value, "jaxpr", None)
                if hasattr(inner, "eqns"):
                    walk(inner)
    walk(eqn.params["jaxpr"])
    return found


@pytest.mark.parametrize("dtype,precision,bulk", [(jnp.bfloat16, None, "bfloat16"), (jnp.bfloat16, "highest", None),
                                                  (jnp.float32, None, None), (jnp.float32, "default", "bfloat16")])
def test_precision_policy_keeps_only_the_cumsum_and_wy_inverse_in_fp32(dtype, precision, bulk):
    (fwd,) = kernel_eqns("pallas_segment", 256, dtype, grad=False, precision=precision)
    dots = dot_precisions(fwd)
    fp32 = [d for d in dots if d[0] == "float32"]
    assert all(p == jax.lax.Precision.HIGHEST for _, p in fp32)
    # per head: the chunk cumsum (1 matmul) and the inverse's block doubling (2 per level, log2(C) levels) stay fp32
    heads = pallas_common.heads_per_step(1, H)
    assert heads == 2    # H=4 heads, B=1: two per step leave a leading parallel axis of 2
    assert len(fp32) == (heads * (1 + 2 * int(math.log2(C))) if bulk else len(dots))
    assert all(d == ("bfloat16", jax.lax.Precision.DEFAULT) for d in dots if d[0] != "float32")
    per_step = pallas_common.jaxpr_cost(fwd.params["jaxpr"])
    assert per_step["mxu_pass_flops"] == (6 * per_step["mxu_flops"] if not bulk else
                                          per_step["mxu_flops"] + 5 * heads * (2 * C * C * K + 24 * C ** 3))


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match="highest"):
        kernel_eqns("pallas_segment", 64, grad=False, precision="fp32")
