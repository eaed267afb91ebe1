"""Ring attention with splash tiles (parallel/ring_splash.py): against per-document SDPA on 8 fake CPU devices
(splash in interpret mode, fp32), and compiled by XLA:TPU (libtpu, no TPU attached) into splash kernels only."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack import backend, precision
from lingpack.parallel.context import ContextParallel, context_attention
from lingpack.parallel.reorder import inverse_permutation
from lingpack.plan import chips, cost, hlo, measure
from lingpack.train.configs import ParallelConfig
from lingpack.train.sharding import make_mesh
from tests.parallel import cp_cases as cc

N, T, BLOCK = 4, 1024, 128    # zigzag chunks of 128 tokens: splash's smallest tile with segment ids
# documents crossing chunk and shard boundaries, one spanning every shard, padding-only tails, 1-5 token ones
ROWS = ((100, 37, 300, 411, 90), (1000,), tuple([1, 2, 3, 4, 5] * 60))


@functools.cache
def compiled(load_balance: bool):
    cp = ContextParallel(make_mesh(ParallelConfig(data=-1, context=N)), strategy="ring", load_balance=load_balance)

    def f(q, k, v, seg, w):
        def loss(q, k, v):
            o, counts = context_attention(q, k, v, seg, cp=cp, scale=cc.SCALE, block=BLOCK, return_stats=True,
                                          impl="splash", interpret=True)
            return jnp.sum(o * w), (o, counts)
        (_, (o, counts)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (o, counts) + grads
    return jax.jit(f), cp


@pytest.mark.parametrize("load_balance", [True, False], ids=["zigzag", "contiguous"])
def test_splash_ring_matches_per_document_oracle(load_balance):
    seg = cc.segments(ROWS, T)
    q, k, v, w = (x[:, :, :2] for x in cc.inputs(len(ROWS), length=T))   # 2 heads
    ref = cc.per_document_oracle(q, k, v, seg, w)
    fn, cp = compiled(load_balance)
    perm = cp.token_index(T)
    outs = fn(*(x[:, perm] for x in (q, k, v, seg, w)))
    inv = inverse_permutation(perm)
    got = [np.asarray(x)[:, inv] for x in (outs[0],) + outs[2:]]
    cc.assert_matches(got, ref, perm, N)
    n = T // N // BLOCK
    off = n * n // 2 if load_balance else n * n   # tiles of one step past the local one
    steps = [N - 1] * N if load_balance else list(range(N))   # contiguous: device r computes r such steps
    assert np.asarray(outs[1]).tolist() == [n * (n + 1) // 2 + s * off for s in steps]


def test_splash_ring_refuses_what_splash_cannot_run():
    cp = compiled(True)[1]
    x = jnp.zeros((2, T, 2, 16), jnp.float32)
    seg = jnp.ones((2, T), jnp.int32)
    with pytest.raises(ValueError, match="model.attention_block_size to one"):
        context_attention(x, x, x, seg, cp=cp, scale=1.0, block=64, impl="splash", interpret=True)
    with precision.x64(True), pytest.raises(ValueError, match="float64 inputs would be rounded"):
        jax.eval_shape(lambda a: context_attention(a, a, a, seg, cp=cp, scale=1.0, block=BLOCK, impl="splash",
                                                   interpret=True), jax.ShapeDtypeStruct(x.shape, jnp.float64))


def test_splash_ring_compiles_to_splash_kernels_and_permutes():
    """On 8 v5p chips (context=8, zigzag) XLA:TPU compiles the ring's tiles to splash kernels: per device one
    causal local tile and 7 half tiles, forward, dq and dkv each, and collective-permutes; no all-gather. The
    cost model reads every splash call's shape (square: causal, else full) and sums to the FLOPs of the tiles
    the ring computes, with the planner's weights (the early-block branch of each step's cond)."""
    H, K, V, B, T_tpu, block = 2, 192, 128, 1, 16384, 512   # MLA's head dims, 2048 tokens per chip
    cp = ContextParallel(make_mesh(ParallelConfig(data=1, context=8), devices=chips.tpu_devices(chips.chip("v5p"), 8)))

    def loss(q, k, v, w, seg):
        o = context_attention(q, k, v, seg, cp=cp, scale=K ** -0.5, block=block, impl="splash", interpret=False)
        return jnp.sum(o.astype(jnp.float32) * w)

    row = NamedSharding(cp.mesh, P(None, "context"))
    x = lambda d, dt=jnp.bfloat16: jax.ShapeDtypeStruct((B, T_tpu, H, d), dt, sharding=row)
    seg = jax.ShapeDtypeStruct((B, T_tpu), jnp.int32, sharding=row)
    with backend.target("tpu"), jax.default_matmul_precision("default"):   # Mosaic's bf16 matmuls, as a run
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x(K), x(K), x(V), x(V, jnp.float32), seg) \
            .compile().as_text()
    assert "collective-permute" in text and "all-gather" not in text and "all-to-all" not in text
    # no step copies a K block back into the head-dim-minor layout (K 192 wide: lane-padded) that XLA:TPU keeps
    # off the wire: splash reads K seq-minor and the steps are unrolled (docs/parallelism.md, the splash ring)
    k_block = f"bf16[{B},{H},{T_tpu // 8},{K}]{{3,2,1,0:"
    assert [line for line in text.splitlines() if f" = {k_block}" in line and " copy(" in line] == []
    ran, unknown = hlo.executed(text, branch_weights=measure.branch_weights(None))
    calls = [e for e in ran if e.op.opcode == "custom-call" and cost.kernel_name(e.op).startswith("splash_mha")]
    assert unknown == 0 and calls
    n = T_tpu // 8 // block                        # blocks of one device's 2048 tokens
    pairs = H * block ** 2 * (n * (n + 1) // 2 + 7 * n * n // 2)   # the causal local tile, 7 half tiles
    # per score pair: forward s and p v; dq s, dp and ds k; dkv s, dp, p^T do and ds^T q
    expected = {"splash_mha_fwd": 2 * pairs * (K + V), "splash_mha_dq": 2 * pairs * (2 * K + V),
                "splash_mha_dkv": 2 * pairs * (2 * K + 2 * V)}
    got = {}
    for e in calls:
        name = cost.kernel_name(e.op)
        prefix = next(p for p in expected if name.startswith(p))
        got[prefix] = got.get(prefix, 0.0) + e.times * cost.splash_cost(e.op, name)[0]
    assert got == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow   # two interpret-mode rings (30 s here); only experiments/plan/ops.py runs the peer
def test_the_benchmarks_peer_formulation_computes_the_same():
    """experiments/plan/ops.py's peer ring (a lax.scan over the steps, splash reading K head-dim minor) gives the
    outputs and gradients of the ring the model runs (unrolled, K seq-minor), on 4 fake devices in fp32."""
    from jax.sharding import Mesh

    from lingpack.parallel import ring_splash
    mesh = Mesh(jax.devices()[:N], ("context",))
    x, row = P(None, None, "context", None), P(None, "context")
    seg = cc.segments(ROWS, T)[:1]
    q, k, v, w = (jnp.swapaxes(a[:1, :, :2], 1, 2) for a in cc.inputs(1, length=T))   # [1, 2 heads, T, *]

    def grads(unroll):
        ring = ring_splash.SplashRing("context", N, True, cc.SCALE, BLOCK, True, unroll=unroll, k_seq_minor=unroll)

        def loss(q, k, v):
            o = jax.shard_map(lambda *a: ring_splash.splash_ring_attention(*a, ring), mesh=mesh,
                              in_specs=(x, x, x, row), out_specs=x, check_vma=False)(q, k, v, jnp.asarray(seg))
            return jnp.sum(o * w), o
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, o_ref), g_ref = grads(True)
    (_, o), g = grads(False)
    for got, ref in zip((o, *g), (o_ref, *g_ref)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
