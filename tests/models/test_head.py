"""The vocabulary-chunked head and cross-entropy, and the fused head (gradient formed in the forward),
(models/head.py) against the whole-vocabulary one.

Oracle: `token_xent` of the materialised [B, T, V] logits, differentiated by autodiff. Bars: loss within
1e-6 and every gradient within 1e-5 (relative to the largest entry), alone (chunks that divide V, that do
not, one chunk wider than V, a [D, V] head and a [V, D] tied table) and as a Ling3 train step's gradients
and statistics (z-loss, MTP, both loss modes, tied embeddings), also on a mesh whose `tensor` axis splits
the vocabulary (the per-device max / sum / target logit combined across devices). The train-step cases
compile a Ling3 twice each (slow); tests/train/test_batch_sharding.py compiles the chunked head on every
conf/parallel layout in the default suite.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import Mesh

from lingpack.models.head import LMHead, fused_objective, token_xent
from lingpack.parallel.layout import Layout, activation_layout
from lingpack.models.kda import KDAConfig
from lingpack.models.ling3 import Ling3Config
from lingpack.models.mla import MLAConfig
from lingpack.models.moe import MoEConfig
from lingpack.models.mtp import MTPConfig
from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig, TrainConfig
from lingpack.train.program import TrainProgram
from lingpack.train.step import accumulate_gradients
from tests.models.test_remat import dot_flops

B, T, D, V = 2, 24, 16, 100


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def head_loss(chunk: int, vocab_axis: int):
    """Masked mean cross-entropy + a z-loss (so the logsumexp's own gradient path is used), and its gradient."""
    def loss(h, w, targets, mask):
        xent, lse = LMHead(h, w, vocab_axis, chunk).xent(targets)
        return jnp.sum(xent * mask) / jnp.sum(mask) + 0.1 * jnp.mean(lse ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("vocab_axis", [1, 0])          # a [D, V] head; a tied [V, D] embedding table
@pytest.mark.parametrize("chunk", [16, 25, 128])         # does not divide V (the last chunk overlaps); divides; > V
def test_chunked_xent_equals_whole_vocabulary(chunk, vocab_axis):
    keys = jax.random.split(jax.random.key(chunk + vocab_axis), 3)
    h = jax.random.normal(keys[0], (B, T, D))
    w = jax.random.normal(keys[1], (D, V) if vocab_axis == 1 else (V, D))
    targets = jax.random.randint(keys[2], (B, T), 0, V)
    mask = (jnp.arange(T) % 5 != 0).astype(jnp.float32)[None].repeat(B, 0)
    (loss, (dh, dw)), (ref_loss, (ref_dh, ref_dw)) = (head_loss(c, vocab_axis)(h, w, targets, mask) for c in (chunk, 0))
    assert rel(loss, ref_loss) <= 1e-6
    assert rel(dh, ref_dh) <= 1e-5 and rel(dw, ref_dw) <= 1e-5, (rel(dh, ref_dh), rel(dw, ref_dw))
    xent, lse = LMHead(h, w, vocab_axis, chunk).xent(targets)
    ref_xent, ref_lse = token_xent(h @ (w if vocab_axis == 1 else w.T), targets)
    assert rel(xent, ref_xent) <= 1e-6 and rel(lse, ref_lse) <= 1e-6


@pytest.mark.parametrize("vocab,chunk,columns", [(100, 16, 105), (100, 25, 100), (100, 128, 100),
                                                  (157184, 16384, 157440), (1000, 251, 1000)])
def test_chunks_are_equal_and_overlap_by_less_than_a_lane_each(vocab, chunk, columns):
    """Forward, backward recompute, dh and dw: 4 x 2 N D x columns matmul FLOPs. ceil(V / C) equal chunks: 7 of 15
    for V = 100, C = 16 (not 7 of 16, 12 columns twice); the flagship's 10 of 15744 (a multiple of 128), 256
    columns twice where chunks of 16384 count 6656; 4 of 250 for V = 1000, C = 251 (256 would pass C)."""
    h, w = jax.ShapeDtypeStruct((1, 8, D), jnp.float32), jax.ShapeDtypeStruct((D, vocab), jnp.float32)
    targets = jnp.zeros((1, 8), jnp.int32)
    step = jax.value_and_grad(lambda h, w: LMHead(h, w, 1, chunk).xent(targets)[0].sum(), (0, 1))
    assert dot_flops(jax.make_jaxpr(step)(h, w).jaxpr) == 4 * 2 * 8 * D * columns


def test_target_outside_the_vocabulary_is_nan_like_the_whole_vocabulary():
    h, w = jnp.ones((1, 3, D)), jnp.ones((D, V))
    targets = jnp.array([[0, V, -1]])
    xent, _ = LMHead(h, w, 1, 16).xent(targets)
    assert np.isfinite(xent[0, 0]) and np.isnan(xent[0, 1:]).all()


def fused_case(vocab_axis: int, seed: int = 0, B: int = B):
    """Two heads sharing w (main and MTP), their targets and per-token weights (z-loss on the first only), and
    the oracle: autodiff of sum(cx xent + cz lse^2) over the materialised logits."""
    k = jax.random.split(jax.random.key(seed), 6)
    hs = [jax.random.normal(k[0], (B, T, D)), jax.random.normal(k[1], (B, T, D))]
    w = jax.random.normal(k[2], (D, V) if vocab_axis == 1 else (V, D))
    ts = [jax.random.randint(k[3], (B, T), 0, V), jax.random.randint(k[4], (B, T), 0, V)]
    cx = jax.random.uniform(k[5], (B, T)) * (jnp.arange(T) % 5 != 0)   # masked tokens weigh 0
    weights, z_weights = [cx, 0.3 * cx], [0.1 * cx, jnp.zeros_like(cx)]

    def oracle(hs, w):
        w_DV = w if vocab_axis == 1 else w.T
        terms = [(token_xent(h @ w_DV, t), c, z) for h, t, c, z in zip(hs, ts, weights, z_weights)]
        return sum(jnp.sum(c * x + z * lse ** 2) for (x, lse), c, z in terms)

    def fused(rows):
        return lambda hs, w: fused_objective([LMHead(h, w, vocab_axis, 0, rows) for h in hs], ts, weights, z_weights)[0]
    return hs, w, oracle, fused


# row blocks that do not divide the 96 rows (padded), divide them, or hold them all; [D, V] heads and [V, D] tables
@pytest.mark.parametrize("rows, vocab_axis", [(7, 1), (48, 0), (1000, 1)])
def test_fused_head_equals_autodiff_of_the_whole_vocabulary(rows, vocab_axis):
    hs, w, oracle, fused = fused_case(vocab_axis, rows)
    (loss, (dh, dw)), (ref, (ref_dh, ref_dw)) = (jax.value_and_grad(f, (0, 1))(hs, w) for f in (fused(rows), oracle))
    assert rel(loss, ref) <= 1e-6
    assert max(rel(a, b) for a, b in zip(dh, ref_dh)) <= 1e-5 and rel(dw, ref_dw) <= 1e-5
    _, xent, lse = fused_objective([LMHead(h, w, vocab_axis, 0, rows) for h in hs], [jnp.zeros((B, T), jnp.int32)] * 2,
                                   [jnp.ones((B, T))] * 2, [jnp.zeros((B, T))] * 2)
    ref_xent, ref_lse = token_xent(hs[1] @ (w if vocab_axis == 1 else w.T), jnp.zeros((B, T), jnp.int32))
    assert rel(xent[1], ref_xent) <= 1e-6 and rel(lse[1], ref_lse) <= 1e-6


def test_fused_head_runs_three_head_matmuls_where_the_chunks_run_four():
    """Forward logits, dh and dw, all in the forward; the backward only scales them (no recomputed logits)."""
    hs, w, _, fused = fused_case(1)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(fused(48), (0, 1)))(hs, w).jaxpr
    assert dot_flops(jaxpr) == 3 * 2 * (2 * B * T) * D * V


@pytest.mark.parametrize("tie", [False, True])
def test_fused_head_on_a_mesh_splitting_rows_and_vocabulary_equals_one_device(tie):
    """Rows over 4 devices, the vocabulary over 2 (`tensor`, 50 columns a shard): the per-device max, sum and
    target logit combined across vocabulary shards, dw summed over row shards, as one device computes it."""
    hs, w, _, fused = fused_case(0 if tie else 1, 3, B=4)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    rules = (("batch", "fsdp"), ("length", None), ("vocab", "tensor"), ("embed", None))

    def on_mesh(hs, w):
        with activation_layout(Layout(mesh, rules)):
            return jax.value_and_grad(fused(5), (0, 1))(hs, w)
    loss, (dh, dw) = jax.jit(on_mesh)(hs, w)
    ref_loss, (ref_dh, ref_dw) = jax.value_and_grad(fused(1000), (0, 1))(hs, w)
    assert rel(loss, ref_loss) <= 1e-6 and rel(dw, ref_dw) <= 1e-5
    assert max(rel(a, b) for a, b in zip(dh, ref_dh)) <= 1e-5


MODEL = Ling3Config(vocab_size=256, emb_dim=32, num_layers=2, inhomogeneous_layer_cycle_interval=2, mlp_dim=64,
                    kda=KDAConfig(num_heads=2, head_dim=16), kda_chunk_size=16, attention_block_size=16,
                    mla=MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                    moe=MoEConfig(num_experts=8, top_k=2, expert_dim=16, n_groups=2, topk_groups=1, z_loss_coef=1e-3),
                    mtp_num_layers=1, mtp=MTPConfig(use_moe=True))
ROWS, SEQ = 8, 64


def step_gradients(model: Ling3Config, loss: LossConfig, axes: dict, devices: int):
    """(gradients, statistics) of one train step on a fixed packed batch, `devices` devices under `axes`."""
    program = TrainProgram.build(model, loss, OptimConfig(decay_steps=10), ParallelConfig(**axes), TrainConfig(),
                                 rows=ROWS, seq_length=SEQ, devices=jax.devices()[:devices])
    state = jax.jit(program.init, out_shardings=program.shardings)()
    rng = np.random.default_rng(0)
    lengths = [20, 30, 14]   # three documents per row, the last one padding-free
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None].repeat(ROWS, 0)
    pos = np.concatenate([np.arange(n) for n in lengths])[None].repeat(ROWS, 0)
    inputs = rng.integers(0, model.vocab_size, (ROWS, SEQ))
    batch = {"inputs": inputs, "targets": np.roll(inputs, -1, axis=1), "inputs_segmentation": seg,
             "targets_segmentation": np.where(pos == np.roll(pos, -1, axis=1) - 1, seg, 0), "inputs_position": pos}
    batch = {k: jax.device_put(jnp.asarray(v, jnp.int32), program.batch_sharding) for k, v in batch.items()}
    fn = jax.jit(lambda p, r, b: accumulate_gradients(program.model_def, loss, p, r, b, micro_batches=1,
                                                      mesh=program.mesh, rules=ParallelConfig(**axes).rules,
                                                      params_shardings=program.shardings.params)[:2])
    return jax.device_get(fn(state.params, state.rest, batch))


def assert_step_matches(chunked, whole):
    (grads, stats), (ref_grads, ref_stats) = chunked, whole
    for key in ref_stats:
        if key.startswith("dropped"):
            continue
        assert rel(stats[key], ref_stats[key]) <= 1e-6, (key, rel(stats[key], ref_stats[key]))
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads), strict=True):
        assert rel(g, r) <= 1e-5, (jax.tree_util.keystr(path), rel(g, r))


CASES = [pytest.param(dict(), LossConfig(z_loss_weight=1e-3), id="megatron-zloss"),
         pytest.param(dict(tie_embeddings=True), LossConfig(mode="per_token", z_loss_weight=1e-3), id="tied-per_token"),
         pytest.param(dict(), LossConfig(megatron_dp_size=2, calculate_per_token_loss=True), id="megatron-dp2-cptl")]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, loss", CASES)
def test_train_step_with_vocabulary_chunks_or_fused_head_equals_whole_vocabulary(overrides, loss):
    model = dataclasses.replace(MODEL, **overrides)
    whole = step_gradients(model, loss, dict(data=1), 1)
    chunked = step_gradients(dataclasses.replace(model, vocab_chunk_size=48), loss, dict(data=1), 1)  # 48 does not divide 256
    assert_step_matches(chunked, whole)
    fused = step_gradients(dataclasses.replace(model, fused_head_rows=100), loss, dict(data=1), 1)  # 100 of 512 rows a head
    assert_step_matches(fused, whole)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_vocabulary_parallel_chunks_and_fused_head_on_a_mesh_equal_one_device(tie):
    """data 2 x fsdp 2 x tensor 2: rows over data x fsdp, the vocabulary over tensor (two shards of 128 columns,
    chunks of 43: every shard's last chunk overlaps its predecessor by 1 column)."""
    model = dataclasses.replace(MODEL, tie_embeddings=tie)
    loss = LossConfig(z_loss_weight=1e-3)
    whole = step_gradients(model, loss, dict(data=1), 1)
    chunked = step_gradients(dataclasses.replace(model, vocab_chunk_size=48), loss, dict(data=2, fsdp=2, tensor=2), 8)
    assert_step_matches(chunked, whole)
    fused = step_gradients(dataclasses.replace(model, fused_head_rows=40), loss, dict(data=2, fsdp=2, tensor=2), 8)
    assert_step_matches(fused, whole)
