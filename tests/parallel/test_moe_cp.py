"""MoE under context parallelism: every device dispatches its own tokens (models/moe.py) == one device.

Mesh data=2 x context=4, rows of 32 tokens: outputs, aux statistics and the gradients of the input and of
every expert / router weight (summed over devices by the shard_map transpose).
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lingpack.models.moe import MoE, MoEConfig
from lingpack.parallel.context import ContextParallel, context_parallel

CFG = MoEConfig(num_experts=4, top_k=2, expert_dim=8, n_groups=2, topk_groups=1)


def test_moe_under_context_parallel_matches_one_device():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context"))
    moe = MoE(CFG, 16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(moe)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 32, 16)), jnp.float32)
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 10 + [0] * 2], 2, axis=0), jnp.int32)
    w = jnp.asarray(rng.standard_normal((2, 32, 16)), jnp.float32)

    def loss(params, x, seg, cp):
        with context_parallel(cp):
            y, aux = nnx.merge(graphdef, params)(x, seg)
        return jnp.sum(y * w) + aux["router_z_loss"], (y, aux["load_counts"], aux["num_tokens"])

    grad = lambda cp: jax.jit(jax.grad(lambda p, x, s: loss(p, x, s, cp), argnums=(0, 1), has_aux=True))
    (g_params, g_x), ref = grad(None)(params, x, seg)
    row = NamedSharding(mesh, P("data", "context"))
    cp = ContextParallel(mesh, batch_axes=("data",))
    (c_params, c_x), out = grad(cp)(params, jax.device_put(x, row), jax.device_put(seg, row))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c_x, g_x, rtol=1e-5, atol=1e-6)
    for (path, r), c in zip(jax.tree_util.tree_leaves_with_path(g_params), jax.tree.leaves(c_params)):
        np.testing.assert_allclose(c, r, rtol=1e-5, atol=1e-6 * np.abs(r).max(), err_msg=jax.tree_util.keystr(path))
