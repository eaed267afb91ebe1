"""MoE: dropless dispatch equals a dense loop; routing equals transformers' KimiLinearMoE; bias balancing."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lingpack.models.moe import (MoE, MoEConfig, combine_rows, megablox_grouped_matmul, route, sort_rows,
                                  tiled_grouped_matmul, update_expert_bias)
from tests.optional import lazy

torch = lazy("torch")   # one oracle test; the others run without the parity extra

CFG = MoEConfig(num_experts=8, top_k=3, expert_dim=16, num_shared_experts=1, n_groups=4, topk_groups=2,
                routed_scaling_factor=2.5, norm_topk_prob=False)


def make_moe(cfg=CFG, D=24, seed=0):
    moe = MoE(cfg, D, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for name in ("router", "wi_gate", "wi_up", "wo"):  # O(1) activations so every term matters
        key, sub = jax.random.split(key)
        var = getattr(moe, name)
        var[...] = jax.random.normal(sub, var.shape) / np.sqrt(var.shape[-2])
    moe.expert_bias[...] = 0.1 * jax.random.normal(key, (cfg.num_experts,))
    return moe


def load_into_kimi(hf, moe) -> None:
    """Copy `moe`'s weights into transformers' KimiLinearMoE `hf` (its [out, in] layouts)."""
    with torch.no_grad():
        hf.gate.weight.copy_(torch.tensor(np.asarray(moe.router[...]).T))
        hf.gate.e_score_correction_bias.copy_(torch.tensor(np.asarray(moe.expert_bias[...])))
        gate_up = np.concatenate([np.asarray(moe.wi_gate[...]), np.asarray(moe.wi_up[...])], axis=2)
        hf.experts.gate_up_proj.copy_(torch.tensor(gate_up.transpose(0, 2, 1)))
        hf.experts.down_proj.copy_(torch.tensor(np.asarray(moe.wo[...]).transpose(0, 2, 1)))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf.shared_experts, name).weight.copy_(
                torch.tensor(np.asarray(getattr(moe.shared_experts, name).kernel[...]).T))


call = nnx.jit(lambda moe, *args: moe(*args))  # one compile per case, not one per eager op


@pytest.mark.parametrize("grouped_matmul", ["tiled", "ragged_dot", "megablox"])
def test_dispatch_equals_dense_loop_over_experts(grouped_matmul):
    moe = make_moe(dataclasses.replace(CFG, grouped_matmul=grouped_matmul))
    x = jax.random.normal(jax.random.key(5), (2, 13, 24))
    y, aux = call(moe, x)
    x_ND = x.reshape(-1, 24)
    idx, w = route(x_ND @ moe.router[...], moe.expert_bias[...], CFG)
    ref = np.zeros(x_ND.shape, np.float32)
    for e in range(CFG.num_experts):  # every expert on every token, weighted by its routing weight (0 if unrouted)
        h = jax.nn.silu(x_ND @ moe.wi_gate[e]) * (x_ND @ moe.wi_up[e])
        weight = jnp.sum(jnp.where(idx == e, w, 0.0), axis=1)
        ref += np.asarray((h @ moe.wo[e]) * weight[:, None])
    ref += np.asarray(moe.shared_experts(x_ND))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 24), ref, atol=2e-5, rtol=1e-5)
    assert aux["load_counts"].sum() == 2 * 13 * CFG.top_k


def test_router_and_output_match_transformers():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE
    hf_cfg = KimiLinearConfig(hidden_size=24, moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=3,
                              n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                              norm_topk_prob=False)
    for norm in (False, True):
        cfg = dataclasses.replace(CFG, norm_topk_prob=norm)
        hf_cfg.norm_topk_prob = norm
        moe = make_moe(cfg)
        hf = KimiLinearMoE(hf_cfg).eval()
        load_into_kimi(hf, moe)
        x = np.random.default_rng(1).standard_normal((2, 11, 24)).astype(np.float32)
        with torch.no_grad():
            _, ref_w, ref_idx = hf.gate(torch.tensor(x))
            ref = hf(torch.tensor(x)).numpy()
        idx, w = route(jnp.asarray(x.reshape(-1, 24)) @ moe.router[...], moe.expert_bias[...], cfg)
        order = np.argsort(np.asarray(idx), axis=1)
        ref_order = np.argsort(ref_idx.numpy(), axis=1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, 1),
                                      np.take_along_axis(ref_idx.numpy(), ref_order, 1))
        np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                                   np.take_along_axis(ref_w.numpy(), ref_order, 1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(call(moe, jnp.asarray(x))[0]), ref, atol=3e-5, rtol=1e-5)


def test_routing_is_fp32_for_bf16_and_follows_float64():
    """Routing is a precision choice: fp32 under bf16 compute, float64 in a float64 model, where the whole layer
    matches transformers' KimiLinearMoE run in float64 (its float32 router upcasts widened) to 1e-12."""
    from transformers import KimiLinearConfig

    from lingpack import precision
    from lingpack.parity import widen
    bf16 = MoE(CFG, 24, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert bf16.router[...].dtype == bf16.expert_bias[...].dtype == jnp.float32 and bf16.wo[...].dtype == jnp.bfloat16
    kimi = widen.module("transformers.models.kimi_linear.modeling_kimi_linear")
    hf_cfg = KimiLinearConfig(hidden_size=24, moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=3,
                              n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                              norm_topk_prob=False)
    hf = kimi.KimiLinearMoE(hf_cfg).double().eval()
    x = np.random.default_rng(1).standard_normal((2, 11, 24))
    with precision.x64(True):
        moe = MoE(CFG, 24, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        assert {v.dtype for v in jax.tree.leaves(nnx.state(moe))} == {jnp.dtype(jnp.float64)}
        moe.expert_bias[...] = 0.01 * jax.random.normal(jax.random.key(2), (CFG.num_experts,), jnp.float64)
        load_into_kimi(hf, moe)
        with torch.no_grad():
            ref = hf(torch.tensor(x)).numpy()
        y, aux = call(moe, jnp.asarray(x))
        assert y.dtype == aux["router_logits"].dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-12, rtol=1e-12)


def test_group_limit_keeps_chosen_experts_in_top_groups():
    logits = jax.random.normal(jax.random.key(0), (64, CFG.num_experts)) * 3
    idx, _ = route(logits, jnp.zeros(CFG.num_experts), CFG)
    groups_used = np.asarray(idx) // (CFG.num_experts // CFG.n_groups)
    assert max(len(set(row)) for row in groups_used) <= CFG.topk_groups


def test_stats_ignore_padding_and_bias_gets_no_gradient():
    moe = make_moe()
    x = jax.random.normal(jax.random.key(2), (2, 8, 24))
    seg = jnp.array([[1] * 5 + [0] * 3, [1] * 8])
    _, aux = call(moe, x, seg)
    assert float(aux["load_counts"].sum()) == 13 * CFG.top_k and float(aux["num_tokens"]) == 13
    logits = np.asarray(x.reshape(-1, 24) @ moe.router[...])[np.asarray(seg).reshape(-1) != 0]
    z = np.log(np.exp(logits).sum(-1)) ** 2
    np.testing.assert_allclose(float(aux["router_z_loss"]), z.sum(), rtol=1e-5)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, seg)[0] ** 2) + m(x, seg)[1]["router_z_loss"]))(moe)
    assert "expert_bias" not in dict(grads) and np.abs(np.asarray(grads["router"][...])).max() > 0


def test_bias_update_moves_load_toward_balance():
    cfg = dataclasses.replace(CFG, n_groups=1, topk_groups=1, top_k=2)
    moe = make_moe(cfg)
    moe.expert_bias[...] = jnp.zeros(cfg.num_experts)
    x = jax.random.normal(jax.random.key(9), (4, 64, 24)) + 1.0  # a shifted input: a skewed router load
    imbalance = []
    for _ in range(60):
        _, aux = call(moe, x)
        load = np.asarray(aux["load_counts"])
        imbalance.append(load.max() / load.mean())
        update_expert_bias(moe, aux["load_counts"][None], rate=0.01)
    assert imbalance[0] > 1.5, imbalance[0]                  # the test starts unbalanced
    assert imbalance[-1] < 0.6 * imbalance[0], (imbalance[0], imbalance[-1])
    assert abs(float(moe.expert_bias[...].mean())) < 1e-6   # re-centred


def test_sort_and_combine_rows_equal_gathers_and_einsum():
    """`sort_rows` / `combine_rows` (slab sums, one-gather backward) against plain gathers and the einsum, values
    and gradients, with padding places (from = M) whose cotangent must be exactly zero."""
    rng = np.random.default_rng(3)
    N, k, D, P_ = 6, 3, 5, 24
    to_M = jnp.asarray(rng.permutation(P_)[:N * k], jnp.int32)              # distinct places; 6 padding places
    from_P = jnp.full((P_,), N * k, jnp.int32).at[to_M].set(jnp.arange(N * k, dtype=jnp.int32))
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((P_, D)), jnp.float32)
    w = jnp.asarray(rng.random((N, k)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)

    def ours(x, y, w):
        return jnp.sum(sort_rows(x, from_P, to_M)[to_M].reshape(N, k, D).sum(1) * cot) + jnp.sum(
            combine_rows(y, to_M, from_P, w) * cot)

    def plain(x, y, w):
        sorted_P = x[jnp.minimum(from_P // k, N - 1)]
        return jnp.sum(sorted_P[to_M].reshape(N, k, D).sum(1) * cot) + jnp.sum(
            jnp.einsum("nkd,nk->nd", y[to_M].reshape(N, k, D), w) * cot)

    np.testing.assert_allclose(ours(x, y, w), plain(x, y, w), rtol=1e-5)
    got, want = jax.grad(ours, argnums=(0, 1, 2))(x, y, w), jax.grad(plain, argnums=(0, 1, 2))(x, y, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    padding = np.asarray(from_P) == N * k
    assert padding.sum() == P_ - N * k and not np.asarray(got[1])[padding].any()


@pytest.mark.parametrize("block", [None, 1, 2])   # tiles per loop step: E (default), one, a count not dividing them
@pytest.mark.parametrize("sizes", [[0, 10, 1, 26, 0], [40, 0, 0], [8, 8, 8]])  # empty groups, whole tiles
def test_tiled_grouped_matmul_equals_ragged_dot(sizes, block):
    rng = np.random.default_rng(len(sizes))
    M, E = sum(sizes), len(sizes)
    x = jnp.asarray(rng.standard_normal((M, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, 8, 6)), jnp.float32)
    groups = jnp.asarray(sizes, jnp.int32)
    tiled = jax.jit(lambda x, w: tiled_grouped_matmul(x, w, groups, tile=8, block=block))
    ragged = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, groups))
    np.testing.assert_allclose(tiled(x, w), ragged(x, w), atol=1e-5, rtol=1e-5)
    grads = lambda f: jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))(x, w)
    for a, b in zip(grads(tiled), grads(ragged)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_megablox_grouped_matmul_equals_ragged_dot():
    """Megablox's gmm (TPU's grouped matmul; interpret mode here): ragged_dot's rows and gradients, including
    an empty group and free rows past the groups (a receive buffer's), which come back zero."""
    rng = np.random.default_rng(7)
    sizes, M = [30, 0, 100, 50], 200                   # 20 free rows at the end
    x = jnp.asarray(rng.standard_normal((M, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), 64, 48)), jnp.float32)
    groups = jnp.asarray(sizes, jnp.int32)
    mega = jax.jit(lambda x, w: megablox_grouped_matmul(x, w, groups))
    ragged = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, groups))
    got = np.asarray(mega(x, w))
    np.testing.assert_allclose(got, ragged(x, w), atol=1e-4, rtol=1e-5)
    assert np.all(got[sum(sizes):] == 0)
    grads = lambda f: jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))(x, w)
    for a, b in zip(grads(mega), grads(ragged)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)
