"""The layer scan (`Ling3Config.scan_layers`) is the unrolled model: same loss, gradients, statistics."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex_core

from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3, Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig, update_expert_bias
from lingpack.train.optim import decay_mask
from packing_cases import packed_batch

SIZES = dict(vocab_size=64, emb_dim=32, mlp_dim=48, kda_impl="reference", mtp_num_layers=1,
             kda=KDAConfig(num_heads=2, head_dim=8),
             mla=MLAConfig(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
                           v_head_dim=8),
             moe=MoEConfig(num_experts=4, top_k=2, expert_dim=8, n_groups=2, topk_groups=1, z_loss_coef=1e-3))
# 4 layers, cycle 2, no dense layer: all scanned, KDA MLA KDA MLA (2 KDA + 2 MLA stacked).
CFG = Ling3Config(num_layers=4, inhomogeneous_layer_cycle_interval=2, first_dense_layers=0, remat=True,
                  remat_policy="dots_saveable", **SIZES)
# 10 layers, cycle 3: layer 0 (dense) unrolled, 1-9 scanned: K M K K M K K M K, a partial cycle at each end.
DEEP = Ling3Config(num_layers=10, inhomogeneous_layer_cycle_interval=3, first_dense_layers=1, **SIZES)
# One mixer only (cycle 1: every layer MLA): the scan runs without a cond.
MLA_ONLY = Ling3Config(num_layers=3, inhomogeneous_layer_cycle_interval=1, first_dense_layers=1, **SIZES)


def per_layer(model, tree=None) -> list:
    """Layer i's parameters (or the same slice of `tree`, a params-shaped state) as a pure dict, per main layer."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    view = model if tree is None else nnx.merge(graphdef, tree, rest)
    slice_of = lambda module, index: jax.tree.map(lambda a: a[index], nnx.state(module, nnx.Param).to_pure_dict())
    return [{name: slice_of(*where) for name, where in view.layer_parts(i).items()}
            for i in range(model.cfg.num_layers)]


def loss_and_grads(model, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest):  # rest through jit: remat's write-back needs variables of this trace
        out = nnx.merge(graphdef, params, rest)(batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"])
        logp = jax.nn.log_softmax(out.logits_BTV, -1)
        xent = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0] * (batch["targets_segmentation"] != 0)
        mtp = jnp.sum(out.mtp_logits[0] ** 2) * 1e-3
        return jnp.sum(xent) + mtp + jnp.sum(out.moe_aux["router_z_loss"]) * 1e-3, out.moe_aux
    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, rest)
    return value, aux, grads


def build(cfg):
    scanned, unrolled = Ling3(cfg, rngs=nnx.Rngs(0)), Ling3(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(0))
    assert scanned.stack is not None and unrolled.stack is None and len(unrolled.layers) == cfg.num_layers
    assert len(scanned.layers) == cfg.first_dense_layers
    return scanned, unrolled


@pytest.fixture(scope="module")
def models():
    assert CFG.scanned_layers() == range(0, 4) and DEEP.scanned_layers() == range(1, 10)
    return build(CFG)


def check_scanned_equals_unrolled(scanned, unrolled):
    for a, b in zip(per_layer(scanned), per_layer(unrolled)):  # one seed builds the same weights
        jax.tree.map(np.testing.assert_array_equal, a, b)
    batch = {k: jnp.asarray(v) for k, v in packed_batch([[5, 1, 14], [20]], 20, 64, np.random.default_rng(0)).items()}
    (v_s, aux_s, g_s), (v_u, aux_u, g_u) = loss_and_grads(scanned, batch), loss_and_grads(unrolled, batch)
    np.testing.assert_allclose(v_s, v_u, rtol=1e-6)
    n_moe = sum(f == "moe" for _, f in scanned.cfg.layer_kinds()) + scanned.cfg.mtp_num_layers  # main, then MTP
    assert aux_s["load_counts"].shape == (n_moe, 4)
    for key in aux_s:  # fp32 sums in another order inside the loop: router logits near 0 differ by ~1e-7 absolute
        np.testing.assert_allclose(aux_s[key], aux_u[key], rtol=1e-6, atol=1e-6 * np.abs(aux_u[key]).max(), err_msg=key)
    grads_s, grads_u = per_layer(scanned, g_s), per_layer(unrolled, g_u)
    for i, (a, b) in enumerate(zip(grads_s, grads_u)):  # fp32 sums in another order: relative to each tensor's max
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5 * np.abs(y).max(),
                                                             err_msg=f"layer {i}"), a, b)
    last = scanned.cfg.scanned_layers()[-1]
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(grads_s[last])) > 0  # a scanned layer learns

    # the expert-bias update reaches each scanned layer's own slice, as it does each unrolled layer
    update_expert_bias(scanned, aux_s["load_counts"], 0.1)
    update_expert_bias(unrolled, aux_u["load_counts"], 0.1)
    biases = lambda m: [np.asarray(moe.expert_bias[...][index]) for moe, index in m.moe_layers()]
    for a, b in zip(biases(scanned), biases(unrolled)):
        np.testing.assert_array_equal(a, b)
    assert len({tuple(b) for b in biases(scanned)}) > 1  # layers moved differently


def test_scanned_equals_unrolled_loss_grads_and_statistics(models):
    check_scanned_equals_unrolled(*models)


@pytest.mark.slow
def test_deep_scanned_equals_unrolled():
    """A dense layer unrolled before the scan, partial cycles at both ends of it."""
    check_scanned_equals_unrolled(*build(DEEP))


@pytest.mark.slow
def test_single_mixer_stack_equals_unrolled():
    """The scan without a cond (no default config has one mixer only)."""
    assert MLA_ONLY.scanned_layers() == range(1, 3)
    scanned, unrolled = build(MLA_ONLY)
    assert scanned.stack.kda is None and scanned.stack.mixers == ("mla", "mla")  # no cond in the scan
    check_scanned_equals_unrolled(scanned, unrolled)


def test_stacked_parameters_keep_sharding_names_and_decay_rule(models):
    scanned, _ = models
    params = nnx.state(scanned, nnx.Param)
    specs = nnx.get_partition_spec(params).to_pure_dict()
    values = params.to_pure_dict()
    assert values["stack"]["ffn"]["mlp"]["wi_gate"].shape == (4, 4, 32, 8)   # [layers, E, D, I]
    assert values["stack"]["kda"]["self_attn"]["q_proj"]["kernel"].shape == (2, 32, 16)  # [KDA layers, D, H*K]
    assert values["stack"]["mla"]["self_attn"]["o_proj"]["kernel"].shape == (2, 16, 32)
    assert set(values["stack"]["kda"]) == {"input_layernorm", "self_attn"}
    assert tuple(specs["stack"]["ffn"]["mlp"]["wi_gate"]) == (None, "exp", "embed", "mlp")
    assert tuple(specs["stack"]["mla"]["self_attn"]["o_proj"]["kernel"]) == (None, "heads", "embed")
    mask = decay_mask(values)
    assert mask["stack"]["kda"]["input_layernorm"]["weight"] is False          # a norm weight, stacked to 2-D
    assert mask["stack"]["ffn"]["post_attention_layernorm"]["weight"] is False
    assert mask["stack"]["kda"]["self_attn"]["A_log"] is False
    assert mask["stack"]["mla"]["self_attn"]["kv_b_proj"]["kernel"] is True
    assert mask["stack"]["ffn"]["mlp"]["router"] is True and mask["norm"]["weight"] is False


def test_remat_policy_is_validated():
    with pytest.raises(ValueError, match="remat_policy"):
        dataclasses.replace(CFG, remat_policy="everything")


def _zero_filled_cond_outputs(jaxpr) -> list:
    """Shapes of activation-sized (3+ dims) cond-branch outputs made as broadcast zeros, in a jaxpr and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            for branch in eqn.params["branches"]:
                zeros = {id(e.outvars[0]): e.outvars[0].aval.shape for e in branch.jaxpr.eqns
                         if e.primitive.name == "broadcast_in_dim" and len(e.outvars[0].aval.shape) >= 3}
                found += [zeros[id(v)] for v in branch.jaxpr.outvars if id(v) in zeros]
        for sub in jex_core.jaxprs_in_params(eqn.params):
            found += _zero_filled_cond_outputs(sub)
    return found


def _grad_jaxpr(cfg):
    """(the model, the jaxpr of its parameters' gradient) for a sum of squared logits on two packed rows of 20."""
    model = Ling3(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = {k: jnp.asarray(v) for k, v in packed_batch([[5, 1, 14], [20]], 20, 64, np.random.default_rng(0)).items()}

    def loss(params):
        out = nnx.merge(graphdef, params, rest)(batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"])
        return jnp.sum(out.logits_BTV ** 2)
    return model, jax.make_jaxpr(jax.grad(loss))(params).jaxpr


def test_layer_scan_backward_fills_no_residuals_of_the_other_mixer():
    """Under remat the backward recomputes each layer; linearising the KDA/MLA cond there would return the union
    of both mixers' residuals, the branch taken filling the other's with zeros (activation-sized buffers written
    every layer). Each mixer is checkpointed inside the cond instead, its output saved by the layer."""
    _, jaxpr = _grad_jaxpr(dataclasses.replace(DEEP, remat=True, remat_policy="nothing_saveable"))
    assert _zero_filled_cond_outputs(jaxpr) == []


def _barriers_holding(jaxpr, shape) -> list:
    """Operand counts of the optimization barriers (in a jaxpr and those nested in it) with a `shape` operand."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "optimization_barrier" and any(v.aval.shape == shape for v in eqn.invars):
            found.append(len(eqn.invars))
        for sub in jex_core.jaxprs_in_params(eqn.params):
            found += _barriers_holding(sub, shape)
    return found


def test_unrolled_layers_hand_on_their_input_cotangent_with_their_weight_gradients():
    """Each unrolled layer's backward passes its input's cotangent on only together with its parameters'
    gradients (one barrier over both): XLA:TPU otherwise held every unrolled layer's unreduced fp32 weight
    gradients from its backward to the update (docs/parallelism.md#its-memory-on-xlatpu)."""
    cfg = dataclasses.replace(DEEP, num_layers=3, remat=True, remat_policy="nothing_saveable", scan_layers=False,
                              mtp_num_layers=0)   # a dense layer, then KDA and MLA MoE layers
    model, jaxpr = _grad_jaxpr(cfg)
    layer_params = [len(jax.tree.leaves(nnx.state(layer, nnx.Param))) for layer in model.layers]
    held = _barriers_holding(jaxpr, (2, 20, cfg.emb_dim))
    held = sorted(n for n in held if n > 1)   # the checkpoint's other barriers hold one array each
    assert len(held) == len(layer_params) and all(n > p for n, p in zip(held, sorted(layer_params))), (held, layer_params)
