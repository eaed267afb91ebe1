"""Ling3 (KDA + MLA with RoPE + MoE + MTP) under context parallelism == the single-device model, exactly."""
import dataclasses

import jax
import numpy as np
import pytest

from lingpack.data import DataConfig, bundled_corpus_prefix
from flax import nnx

from lingpack.models.ling3 import Ling3
from lingpack.models.mla import MLA, MLAConfig
from lingpack.parallel.context import ContextParallel, context_parallel
from lingpack.parallel.reorder import reorder_batch
from lingpack.train import loop as loop_lib
from lingpack.train.configs import CheckpointConfig, LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.sharding import make_mesh
from lingpack.train.step import ModelDef, accumulate_gradients, split_model
from tests.models.packing_cases import packed_batch
from tests.train.test_train_ling3 import MODEL

# Documents crossing the 8-token zigzag chunks of T=64 over context=4; a one-token document; padding.
ROWS = [[10, 30, 20], [64], [1, 2, 3, 4, 5, 40], [7]]


def _gradients(batch, parallel=None, load_balance=True):
    model_def = ModelDef.from_constructor(lambda: Ling3(MODEL, rngs=None), MODEL)
    params, rest = split_model(Ling3(MODEL))
    kw = {}
    if parallel is not None:
        mesh = make_mesh(parallel)
        kw = dict(mesh=mesh, rules=parallel.rules, context=ContextParallel.from_config(parallel, mesh))
        if load_balance:
            batch = reorder_batch(batch, parallel.context)
    fn = jax.jit(lambda p, r, b: accumulate_gradients(model_def, LossConfig(), p, r, b, micro_batches=1, **kw)[:2])
    return jax.device_get(fn(params, rest, batch))


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_mla_layer_context_parallel_uses_permuted_rope_positions(strategy):
    """MLA with RoPE on a zigzag row (context=4): outputs and parameter grads equal the single-device layer."""
    batch = packed_batch(ROWS, 64, 16)
    x = np.random.default_rng(0).standard_normal((len(ROWS), 64, 32)).astype(np.float32)
    mla = MLA(MLAConfig(num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8), 32,
              attention_block=8, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(mla)
    parallel = ParallelConfig(data=2, context=4, context_strategy=strategy)
    cp = ContextParallel.from_config(parallel, make_mesh(parallel))
    w = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)

    def run(params, x, seg, pos, w, context):
        def loss(params):
            with context_parallel(context):
                y = nnx.merge(graphdef, params)(x, seg, pos)
            return (y * w).sum(), y
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    seg, pos = batch["inputs_segmentation"], batch["inputs_position"]
    (_, ref_y), ref_g = run(params, x, seg, pos, w, None)
    z = reorder_batch(dict(x=x, seg=seg, pos=pos, w=w, ref_y=np.asarray(ref_y)), cp.size)
    (_, y), g = run(params, z["x"], z["seg"], z["pos"], z["w"], cp)
    np.testing.assert_allclose(y, z["ref_y"], rtol=1e-5, atol=1e-6)
    for r, a in zip(jax.tree.leaves(ref_g), jax.tree.leaves(g)):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5 * np.abs(r).max())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_ling3_context_parallel_matches_single_device(strategy):
    batch = packed_batch(ROWS, 64, MODEL.vocab_size)
    ref_grads, ref_stats = _gradients(batch)
    grads, stats = _gradients(batch, ParallelConfig(data=2, context=4, context_strategy=strategy))
    assert set(stats) == set(ref_stats)
    for key in ref_stats:
        np.testing.assert_allclose(stats[key], ref_stats[key], rtol=1e-5, err_msg=key)
    leaves = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, r), g in zip(leaves, jax.tree.leaves(grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * np.abs(r).max(), err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_loop_with_context_parallel_reproduces_single_device_losses(tmp_path):
    data = DataConfig(source="megatron", paths=(bundled_corpus_prefix(str(tmp_path / "cache")),), seq_length=64,
                      global_batch_size=2, eod_id=256, pad_id=257, vocab_size=258, read_threads=1,
                      prefetch_buffer_size=1)
    runs = {}
    for name, parallel in {"single": ParallelConfig(data=1), "cp": ParallelConfig(data=2, context=4)}.items():
        result = loop_lib.train(MODEL, data, LossConfig(), OptimConfig(lr=1e-2, warmup_steps=0, decay_steps=3),
                                parallel, CheckpointConfig(enabled=False),
                                TrainConfig(steps=2, progress_bar=False, handle_signals=False))
        runs[name] = result.history
    for a, b in zip(runs["single"], runs["cp"]):
        assert a["data_fingerprint"] == b["data_fingerprint"]
        for key in ("loss", "lm_loss", "mtp_loss", "grad_norm", "segments_per_row", "invalid_rows"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)


def test_loop_rejects_rows_that_do_not_split():
    with pytest.raises(ValueError, match="sequence length 36 must divide by 2 x context=4 = 8"):
        loop_lib.train(MODEL, dataclasses.replace(DataConfig(), seq_length=36), LossConfig(), OptimConfig(),
                       ParallelConfig(data=2, context=4), CheckpointConfig(enabled=False), TrainConfig(steps=1))
