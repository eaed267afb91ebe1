"""Keeping `context` (models/remat.py) keeps the attention's VJP residuals too: flash, splash and both rings name
their output and logsumexp (`blockwise.name_residuals`), so under a policy that keeps `mla/context` the compiled
step runs the attention's forward once, as without remat, and the gradients are those of recomputing it."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack import backend
from lingpack.kernels.attention.api import attention
from lingpack.models import remat
from lingpack.parallel.context import ContextParallel, context_attention
from lingpack.plan import chips, cost, hlo
from lingpack.train.configs import ParallelConfig
from lingpack.train.flops import remat_flops
from lingpack.train.sharding import make_mesh

B, T, H, K, V = 4, 1024, 4, 128, 128   # splash's Mosaic tiles: head dims of 128
SEG = jnp.asarray(np.repeat([[1, 1, 2, 3]], B, 0).repeat(T // 4, 1), jnp.int32)   # three documents a row
SLOW = pytest.mark.slow   # XLA:TPU compiles and the rings: `make test-all`; local flash in the default suite
CASES = [("flash", None), pytest.param("splash", None, marks=SLOW), pytest.param("splash", "ring", marks=SLOW),
         pytest.param("flash", "ring", marks=SLOW), pytest.param("flash", "ulysses", marks=SLOW)]


def mixer(impl: str, strategy: str | None, tpu: bool = False):
    """q, k, v -> the attention's output tagged `context`, inside part `mla`, as models/mla.py calls it; on 4
    v5p chips with `tpu` (context=4, or data=4), else on the fake CPU devices (splash in interpret mode)."""
    mesh = make_mesh(ParallelConfig(data=1 if strategy else 4, context=4 if strategy else 1),
                     devices=chips.tpu_devices(chips.chip("v5p"), 4) if tpu else jax.devices()[:4])
    cp = strategy and ContextParallel(mesh, strategy=strategy)

    def f(q, k, v):
        with remat.part("mla"):
            kw = dict(scale=K ** -0.5, residual_name=remat.name("context"))
            if cp is None:
                o = attention(q, k, v, segment_ids_BT=SEG, impl=impl, block_size=128, **kw)
            else:
                o = context_attention(q, k, v, SEG, cp=cp, block=128, impl=impl, **kw)
            return remat.tag(o, "context")
    f.mesh, f.tpu = mesh, tpu
    return f


def grad_fn(f, policy: str | None):
    """(value, d/d(q, k, v)) of a fixed weighting of f's output, f checkpointed under `policy` (None: no remat).
    The value is returned: the forward is then needed, and a rerun in the backward is a second one."""
    g = f if policy is None else jax.checkpoint(f, policy=remat.jax_policy("full", {"mla": policy}))
    w = jnp.cos(jnp.arange(B * T * H * V, dtype=jnp.float32)).reshape(B, T, H, V)
    return jax.value_and_grad(lambda q, k, v: jnp.sum(g(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2))


def compiled(f, policy, args, platform="cpu") -> str:
    """The compiled program of f's gradient (XLA:CPU, or XLA:TPU for `platform="tpu"`: Mosaic splash kernels)."""
    with backend.target(platform), jax.default_matmul_precision("default"):   # TPU: Mosaic's bf16 matmuls
        return jax.jit(grad_fn(f, policy)).lower(*args).compile().as_text()


def forward_work(f, policy, args) -> float:
    """What the compiled gradient computes that a forward rerun would add: the XLA tiles' matmul FLOPs (flash,
    the XLA ring and Ulysses on XLA:CPU), or the runs of splash's forward kernel (XLA:TPU, v5p chips)."""
    if not f.tpu:
        return hlo.dot_flops(compiled(f, policy, args))
    ran, _ = hlo.executed(compiled(f, policy, args, "tpu"))
    return sum(e.times for e in ran if e.op.opcode == "custom-call"
               and cost.kernel_name(e.op).startswith("splash_mha_fwd"))


def inputs(f=None):
    """Random q, k, v (fp32), or for a TPU compile their shapes in bf16 over f's mesh (rows, or the sequence)."""
    if f is not None and f.tpu:
        spec = P(None, "context") if f.mesh.shape["context"] > 1 else P("data")
        return tuple(jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16, sharding=NamedSharding(f.mesh, spec))
                     for d in (K, K, V))
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(key, (B, T, H, d), jnp.float32) for key, d in zip(keys, (K, K, V)))


@pytest.mark.parametrize("impl,strategy", CASES, ids=["flash-local", "splash-local", "splash-ring", "flash-ring",
                                                       "flash-ulysses"])
def test_keeping_context_compiles_the_attention_forward_once(impl, strategy):
    """As many forward matmul FLOPs (XLA tiles) or splash forward kernel runs (XLA:TPU) as without remat. The
    XLA rings' and Ulysses' recomputed tiles XLA:CPU merges with the forward's (their `full` equals no remat)."""
    f = mixer(impl, strategy, tpu=impl == "splash")
    args = inputs(f)
    plain, kept, recomputed = (forward_work(f, p, args) for p in (None, "save_context", "full"))
    assert 0 < plain == kept <= recomputed, (plain, kept, recomputed)
    if strategy is None or impl == "splash":
        assert kept < recomputed


@pytest.mark.parametrize("impl,strategy", [("flash", None), pytest.param("splash", "ring", marks=SLOW)],
                         ids=["flash-local", "splash-ring"])
def test_keeping_context_gives_the_gradients_of_recomputing_it(impl, strategy):
    f, args = mixer(impl, strategy), inputs()
    want = jax.jit(grad_fn(f, "full"))(*args)[1]
    got = jax.jit(grad_fn(f, "save_context"))(*args)[1]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * float(jnp.abs(w).max()))


@pytest.mark.parametrize("impl", ["flash", "dot_product"])
def test_remat_flops_counts_the_kept_attention_where_it_is_named(impl):
    """Keeping MLA's `context` takes the attention's forward out of `remat_flops` for flash (which names its
    residuals), not for dot_product (plain autodiff: the backward recomputes its probabilities)."""
    from tests.models.test_remat import CFG
    cfg = dataclasses.replace(CFG, attention_impl=impl)
    kept = dataclasses.replace(cfg, remat_policy_mla="save_context")
    m, n_mla = cfg.mla, sum(kind == "mla" for kind, _ in cfg.layer_kinds()) + cfg.mtp_num_layers
    attention = 2 * 2 * m.num_heads * (m.qk_head_dim + m.v_head_dim) / 2 * T / 2 * n_mla   # per token
    saved = remat_flops(cfg, seq_len=T) - remat_flops(kept, seq_len=T)
    assert saved == pytest.approx(attention if impl == "flash" else 0.0, rel=1e-12)
