"""Every mesh layout on 8 fake CPU devices gives the single-device loss and gradients."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from train_helpers import synthetic_batch, tiny_model_def, tree_allclose

from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig
from lingpack.train.sharding import expert_boxes, logical_to_mesh, make_mesh, mesh_shape, shard_batch
from lingpack.train.step import ModelDef, accumulate_gradients, init_fn, init_train_state, state_shardings

LAYOUTS = [
    pytest.param(dict(data=8), marks=pytest.mark.slow),
    pytest.param(dict(data=2, fsdp=2, tensor=2), marks=pytest.mark.slow),
    dict(data=1, fsdp=2, tensor=1, expert=4),
    dict(data=-1, fsdp=1, tensor=2, expert=2),
]


def _run(model_def, make, batch, parallel: ParallelConfig | None, loss_cfg=LossConfig(megatron_dp_size=2), M=2,
         from_state=None):
    devices = jax.devices() if parallel else jax.devices()[:1]
    parallel = parallel or ParallelConfig(data=1)
    mesh = make_mesh(parallel, devices=devices)
    optim = OptimConfig(decay_steps=10)
    if from_state is None:   # sharded init: every leaf created directly in its sharding
        state, shardings = init_train_state(model_def, make, optim, 0, mesh, parallel.rules)
    else:                    # reuse a state (saves an init compile), resharded onto this mesh
        shardings = state_shardings(model_def, jax.eval_shape(init_fn(make, optim, 0)), mesh, parallel.rules)
        state = jax.device_put(jax.device_get(from_state), shardings)
    sharded = shard_batch(batch, mesh, parallel.rules)
    fn = jax.jit(lambda p, r, b: accumulate_gradients(model_def, loss_cfg, p, r, b, micro_batches=M, mesh=mesh,
                                                      rules=parallel.rules, params_shardings=shardings.params)[:2])
    grads, stats = fn(state.params, state.rest, sharded)
    return jax.device_get(grads), jax.device_get(stats), state


@pytest.fixture(scope="module")
def tiny():
    model_def, make = tiny_model_def()
    batch = synthetic_batch(rows=16)
    return model_def, make, batch, _run(model_def, make, batch, None)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["data8", "data2-fsdp2-tensor2", "fsdp2-expert4", "data2-tensor2-expert2"])
def test_tiny_model_layouts_match_single_device(tiny, layout):
    model_def, make, batch, (g_ref, s_ref, _) = tiny
    grads, stats, state = _run(model_def, make, batch, ParallelConfig(**layout))
    np.testing.assert_allclose(stats["objective"], s_ref["objective"], rtol=1e-6)
    np.testing.assert_allclose(stats["lm_sum"], s_ref["lm_sum"], rtol=1e-6)
    tree_allclose(grads, g_ref, rtol=1e-5, atol=1e-7)
    specs = [leaf.sharding.spec for leaf in jax.tree.leaves(state.params)]
    assert any(spec != P() and any(s is not None for s in spec) for spec in specs) or layout == dict(data=8)


@pytest.mark.slow
def test_ling3_sharded_matches_single_device():
    from flax import nnx
    from lingpack.models.kda import KDAConfig
    from lingpack.models.ling3 import Ling3, Ling3Config
    from lingpack.models.mla import MLAConfig
    from lingpack.models.moe import MoEConfig
    # layer 0 dense and unrolled, layers 1-4 (MLA KDA MLA KDA, MoE) in the layer scan's stacks
    cfg = Ling3Config(vocab_size=258, emb_dim=32, num_layers=5, inhomogeneous_layer_cycle_interval=2, mlp_dim=64,
                      kda=KDAConfig(num_heads=2, head_dim=16), kda_chunk_size=16,
                      mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                      moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, z_loss_coef=1e-3))
    make = lambda: Ling3(cfg, rngs=nnx.Rngs(0))
    model_def = ModelDef.from_constructor(make, cfg)
    batch = synthetic_batch(rows=8, mean_length=10)
    g_ref, s_ref, state = _run(model_def, make, batch, None, M=1)
    grads, stats, sharded = _run(model_def, make, batch, ParallelConfig(data=1, fsdp=2, tensor=2, expert=2), M=1,
                                 from_state=state)
    assert cfg.scanned_layers() == range(1, 5)
    assert sharded.params["stack"]["ffn"]["mlp"]["wi_gate"].sharding.spec == P(None, "expert", "fsdp", "tensor")
    assert sharded.params["layers"][0]["mlp"]["up_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
    np.testing.assert_allclose(stats["objective"], s_ref["objective"], rtol=1e-5)
    np.testing.assert_allclose(stats["mtp_sum"], s_ref["mtp_sum"], rtol=1e-5)
    tree_allclose(grads, g_ref, rtol=1e-4, atol=1e-6)


def test_mesh_and_rules_errors():
    assert mesh_shape(ParallelConfig(data=-1, tensor=2), 8)["data"] == 4
    with pytest.raises(ValueError, match="multiply to"):
        mesh_shape(ParallelConfig(data=2, fsdp=2), 8)
    with pytest.raises(ValueError, match="at most one"):
        ParallelConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        ParallelConfig(logical_axis_rules=(("embed", "model"),))
    mesh = make_mesh(ParallelConfig(data=2, tensor=4))
    dropped = []
    assert logical_to_mesh(("vocab", "embed"), (258, 16), mesh, ParallelConfig().rules, dropped) == P(None, None)
    assert dropped and dropped[0][0] == "vocab"             # 258 % 4 != 0 -> replicated, and reported
    assert logical_to_mesh(("embed", "mlp"), (16, 32), mesh, ParallelConfig().rules) == P(None, "tensor")
    with pytest.raises(ValueError, match="no rule"):
        logical_to_mesh(("mystery",), (4,), mesh, ParallelConfig().rules)


def _extent(devices) -> tuple:
    coords = np.asarray([d.coords for d in devices])
    return tuple(int(e) for e in coords.max(axis=0) - coords.min(axis=0) + 1)


def test_expert_groups_are_compact_boxes_on_a_2d_tpu_torus():
    """64 v6e chips (an 8x8 torus, libtpu's topology, no TPU needed): fsdp=8 x expert=8 puts every expert group on
    a 2x4 box (JAX's own layout: a line of 8), every FSDP group one chip per box, each chip once. JAX's layout
    stays where another inner axis is split, on v5p's 3D cube (its expert groups are 2x2x2) and off TPU."""
    from lingpack.plan import chips
    devices = chips.tpu_devices(chips.chip("v6e"), 64)
    grid = make_mesh(ParallelConfig(data=1, fsdp=8, expert=8), devices=devices).devices.reshape(8, 8)
    assert sorted(d.id for d in grid.flat) == sorted(d.id for d in devices)
    assert {_extent(grid[f]) for f in range(8)} == {(2, 4, 1)}
    for e in range(8):
        assert len({(c[0] // 2, c[1] // 4) for c in (d.coords for d in grid[:, e])}) == 8   # one chip per box
    assert expert_boxes(devices, dict(data=1, fsdp=4, tensor=2, expert=8, context=1)) is None
    assert expert_boxes(chips.tpu_devices(chips.chip("v5p"), 64), dict(data=1, fsdp=8, tensor=1, expert=8,
                                                                         context=1)) is None
    assert expert_boxes(jax.devices(), dict(data=1, fsdp=2, tensor=1, expert=4, context=1)) is None   # no coords
