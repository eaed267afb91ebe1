"""The real Ling3 through the loop on the bundled corpus, and its train state through an Orbax round trip."""

from __future__ import annotations

import jax
import numpy as np

from lingpack.data import DataConfig, bundled_corpus_prefix
from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from lingpack.train import loop as loop_lib
from lingpack.train.checkpoint import Checkpointer
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig

MODEL = Ling3Config(vocab_size=258, emb_dim=32, num_layers=2, inhomogeneous_layer_cycle_interval=2, mlp_dim=64,
                    kda=KDAConfig(num_heads=2, head_dim=16), kda_chunk_size=16, kda_impl="chunked",
                    mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                    moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, z_loss_coef=1e-3, bias_update_rate=1e-2))


def test_ling3_trains_on_bundled_corpus_and_checkpoints(tmp_path):
    data = DataConfig(source="megatron", paths=(bundled_corpus_prefix(str(tmp_path / "cache")),), seq_length=32,
                      global_batch_size=8, eod_id=256, pad_id=257, vocab_size=258, read_threads=1,
                      prefetch_buffer_size=1)
    ckpt_cfg = CheckpointConfig(directory=str(tmp_path / "ckpt"), save_every=10, keep=1)
    seen = []
    result = loop_lib.train(MODEL, data, LossConfig(), OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=3),
                            ParallelConfig(data=8), ckpt_cfg,
                            TrainConfig(steps=2, micro_batches=1, progress_bar=True, peak_flops_per_device=1e12),
                            metrics_callback=lambda step, m: seen.append((step, m)))
    assert [s for s, _ in seen] == [1, 2] and set(seen[0][1]) == set(loop_lib.METRIC_NAMES)
    m = result.final_metrics
    assert all(np.isfinite(v) for v in m.values())
    assert m["mtp_loss"] > 0 and m["moe_z_loss"] > 0 and m["mfu"] > 0 and m["segments_per_row"] >= 1
    assert result.history[1]["loss"] < result.history[0]["loss"]
    assert result.checkpoint_steps == [2]

    # the checkpoint restores every leaf (int-keyed layer dicts, expert biases, optax state) in its sharding
    from lingpack.train.sharding import make_mesh
    from lingpack.train.step import ModelDef, init_fn, state_shardings
    build = lambda: loop_lib.make_model(MODEL, 0)
    model_def = ModelDef.from_constructor(build, MODEL)
    abstract = jax.eval_shape(init_fn(build, OptimConfig(decay_steps=3), 0))
    mesh = make_mesh(ParallelConfig(data=8))
    ckpt = Checkpointer(ckpt_cfg)
    state, data_state = ckpt.restore(2, abstract, state_shardings(model_def, abstract, mesh, ParallelConfig().rules))
    ckpt.close()
    assert int(state.step) == 2 and int(state.updates) == 2 and data_state["next_index"] == 2
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(result.state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    assert set(state.rest) == {"layers", "mtp_layers"}  # expert biases of the MoE layers travel with the state

