"""Remat policies (models/remat.py): every policy trains the same model, each saves what it names, and
`train/flops.py: remat_flops` counts the recompute the traced backward pass really does."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lingpack.errors import ConfigError
from lingpack.models import remat
from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3, Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from lingpack.train.flops import remat_flops

B, T = 2, 16
# layer 0 dense (unrolled, part `mlp`), layers 1-4 K M K M scanned, one MTP layer (MLA + MoE): every part and
# both remat paths (an unrolled layer's checkpoint, the stack's). ragged_dot: its FLOPs are the experts' real work.
CFG = Ling3Config(num_layers=5, inhomogeneous_layer_cycle_interval=2, first_dense_layers=1, remat=True,
                  vocab_size=64, emb_dim=32, mlp_dim=48, kda_impl="reference", mtp_num_layers=1,
                  kda=KDAConfig(num_heads=2, head_dim=8),
                  mla=MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                v_head_dim=8),
                  moe=MoEConfig(num_experts=4, top_k=2, expert_dim=8, n_groups=2, topk_groups=1, z_loss_coef=1e-3,
                                grouped_matmul="ragged_dot"))
INPUTS = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)


def loss_fn(cfg):
    model = Ling3(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest):
        out = nnx.merge(graphdef, params, rest)(INPUTS)
        return (jnp.mean(out.logits_BTV ** 2) + jnp.mean(out.mtp_logits[0] ** 2)
                + jnp.sum(out.moe_aux["router_z_loss"]))
    return jax.value_and_grad(loss), params, rest


def dot_flops(jaxpr) -> float:
    """2 x multiply-adds of every dot_general and ragged_dot in a jaxpr, nested jaxprs (scan, cond, remat) included,
    a scan body times its length."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[d] for d in lhs_contract])
        elif name.startswith("ragged_dot"):
            rows, contract = eqn.invars[0].aval.shape
            total += 2 * rows * contract * eqn.outvars[0].aval.shape[-1]
        times = eqn.params.get("length", 1) if name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += times * dot_flops(inner)
    return total


def traced_flops(cfg) -> float:
    f, params, rest = loss_fn(cfg)
    return dot_flops(jax.make_jaxpr(f)(params, rest).jaxpr)


@pytest.fixture(scope="module")
def no_remat():
    f, params, rest = loss_fn(dataclasses.replace(CFG, remat=False))
    return jax.jit(f)(params, rest)


def assert_same(got, want):
    (value, grads), (want_value, want_grads) = got, want
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6 * np.abs(w).max())   # fp32 sums reordered by remat


@pytest.mark.parametrize("policy,overrides", [("full", {}),
                                              ("save_qkv_proj", {"remat_policy_moe": "save_moe_proj"})])
def test_policy_gives_the_loss_and_gradients_of_no_remat(no_remat, policy, overrides):
    f, params, rest = loss_fn(dataclasses.replace(CFG, remat_policy=policy, **overrides))
    assert_same(jax.jit(f)(params, rest), no_remat)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [p for p in remat.POLICIES if p not in remat.OFFLOADING and p != "full"])
def test_every_policy_gives_the_loss_and_gradients_of_no_remat(no_remat, policy):
    f, params, rest = loss_fn(dataclasses.replace(CFG, remat_policy=policy))
    assert_same(jax.jit(f)(params, rest), no_remat)


def dead_but_traced(cfg) -> float:
    """FLOPs per token of saved outputs no backward reads that the traced backward still recomputes when not saved
    (the mixers' out_proj; the SwiGLU down projections' are dropped by the trace itself): XLA removes them as dead
    code, so `remat_flops` leaves them out."""
    keep, offload = remat.saved_tags(cfg.remat_policy, cfg.remat_overrides())
    D, kda, mla = cfg.emb_dim, cfg.kda, cfg.mla
    dead = {"kda/out_proj": (2 * kda.num_heads * kda.head_dim * D, 3), "mla/out_proj": (2 * mla.num_heads * mla.v_head_dim * D, 3)}
    return sum(f * n for name, (f, n) in dead.items() if name in keep | offload)   # n: layers of CFG with that part


def check_saved_flops(cases):
    """The backward's traced matmul FLOPs against `full`'s: each policy saves exactly what `remat_flops` says
    (plus the dead outputs it saves). Unrolled layers: the layer scan's cond holds both mixers, which a trace
    cannot weigh by layer count."""
    unrolled = dataclasses.replace(CFG, scan_layers=False)
    full, saved = traced_flops(unrolled), {}
    for policy, overrides in cases:
        cfg = dataclasses.replace(unrolled, remat_policy=policy, **overrides)
        saved[policy] = full - traced_flops(cfg)
        analytic = (remat_flops(unrolled, seq_len=T) - remat_flops(cfg, seq_len=T) + dead_but_traced(cfg)) * B * T
        assert saved[policy] == pytest.approx(analytic, rel=1e-9), (policy, overrides)
    return saved


def test_saving_policies_recompute_fewer_dots_as_remat_flops_counts():
    saved = check_saved_flops([("save_qkv_proj", {}), ("save_out_proj", {}),
                               ("full", {"remat_policy_mla": "save_qkv_proj", "remat_policy_moe": "save_moe_proj"})])
    assert remat_flops(CFG, "save_out_proj", seq_len=T) == remat_flops(CFG, "full", seq_len=T)  # out_proj: dead
    assert saved["full"] > saved["save_qkv_proj"] > 0
    assert 0 < remat_flops(CFG, "minimal", seq_len=T) < remat_flops(CFG, "full", seq_len=T)
    assert remat_flops(dataclasses.replace(CFG, remat=False), seq_len=T) == 0


@pytest.mark.slow
def test_every_named_policy_saves_what_remat_flops_counts():
    # `context` is a mixer kernel's output; `remat_flops` counts the KDA kernel as recomputed whatever is kept (and
    # the attention's forward as kept only where the implementation names its residuals: test_remat_context.py),
    # while this model's reference mixers are plain matmuls whose backward reads less once their output is kept
    # (2304 FLOPs per token here): the policies keeping `context` are left out (offloading ones run on TPU / GPU)
    saved = check_saved_flops([(p, {}) for p in remat.NAMED
                               if p not in ("full", "minimal_with_context", "save_context", *remat.OFFLOADING)])
    assert saved["minimal"] > saved["save_dot_except_mlp"] > saved["save_qkv_proj"] > 0


def test_minimal_saves_the_tagged_projections():
    """The residuals `minimal` keeps are the named projection outputs of every part (JAX's saved-residuals report)."""
    from jax.ad_checkpoint import print_saved_residuals  # noqa: F401  (documents the tool; the check reads names)
    cfg = dataclasses.replace(CFG, remat_policy="minimal")
    f, params, rest = loss_fn(cfg)
    text = str(jax.make_jaxpr(f)(params, rest))
    for name in ("kda/query_proj", "kda/gate_proj", "mla/qkv_proj", "mla/kv_proj", "moe/mlpwi_0", "moe/mlpwo",
                 "mlp/mlpwi_1"):
        assert f"name={name}" in text, name


def test_offloading_on_cpu_is_a_one_line_error():
    cfg = dataclasses.replace(CFG, remat_policy="minimal_offloaded")
    with pytest.raises(ConfigError, match="offloads to host memory.*offloading policies run on TPU / GPU"):
        cfg.jax_remat_policy()
    from lingpack import backend
    with backend.target("tpu"):   # the TPU side builds JAX's save-and-offload policy
        assert callable(cfg.jax_remat_policy())


def test_unknown_policies_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"model.remat_policy='fulll' is not a remat policy; valid choices: \[.*full"):
        dataclasses.replace(CFG, remat_policy="fulll")
    with pytest.raises(ConfigError, match="model.remat_policy_mla='dots_saveable': a per-part override takes a named"):
        dataclasses.replace(CFG, remat_policy_mla="dots_saveable")
    with pytest.raises(ConfigError, match="per-part overrides need a named base policy"):
        dataclasses.replace(CFG, remat_policy="dots_saveable", remat_policy_moe="minimal")
