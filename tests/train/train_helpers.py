"""Shared pieces of the training tests: a small stand-in NNX LM with Ling3's output contract, tiny configs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingpack.models.head import LMHead
from lingpack.models.ling3 import Ling3Output
from lingpack.models.moe import ExpertBias, MoEConfig

SEQ = 32
VOCAB = 258  # the byte tokenizer's vocabulary (eod 256, pad 257)


def partitioned(init, axes):
    return nnx.with_partitioning(init, axes, eager_sharding=False)


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = VOCAB
    emb_dim: int = 16
    hidden: int = 32
    mtp_num_layers: int = 1
    moe: MoEConfig = MoEConfig(num_experts=4, top_k=1, expert_dim=8, z_loss_coef=1e-2, bias_update_rate=1e-2)
    kda_impl: str = "chunked"           # the step drops overflow for "chunked_aligned" (see step.kernel_max_segs)
    kda_max_segs: int | None = None
    kda_chunk_size: int = 16

    def make_model(self, rngs):  # the loop's hook for non-Ling3 models
        return TinyLM(self, rngs)


class TinyRouter(nnx.Module):
    """Router statistics like moe.MoE (z-loss over real tokens, load counts) and a routed scale."""

    def __init__(self, cfg: TinyConfig, rngs):
        E = cfg.moe.num_experts
        self.router = nnx.Param(partitioned(nnx.initializers.normal(0.5), ("embed", "exp"))(rngs.params(), (cfg.emb_dim, E)))
        self.expert_bias = ExpertBias(partitioned(nnx.initializers.zeros, ("exp",))(None, (E,), jnp.float32))
        self.expert_scale = nnx.Param(partitioned(nnx.initializers.ones, ("exp",))(None, (E,), jnp.float32))

    def __call__(self, x_BTD, seg_BT):
        logits = x_BTD.reshape(-1, x_BTD.shape[-1]) @ self.router[...]
        choice = jnp.argmax(jax.nn.sigmoid(logits) + self.expert_bias[...], axis=-1)
        real = (seg_BT != 0).reshape(-1)
        load = jnp.sum(jax.nn.one_hot(choice, logits.shape[-1]) * real[:, None], axis=0)
        z = jnp.sum(jnp.where(real, jax.nn.logsumexp(logits, axis=-1) ** 2, 0.0))
        scale = self.expert_scale[...][choice].reshape(x_BTD.shape[:2])[..., None]
        aux = {"router_z_loss": z, "load_counts": jax.lax.stop_gradient(load), "num_tokens": jnp.sum(real) * 1.0}
        return x_BTD * scale, aux


class TinyLM(nnx.Module):
    """Embedding -> previous-token mix within a segment -> MLP -> routed scale -> logits, + one MTP head."""

    def __init__(self, cfg: TinyConfig, rngs: nnx.Rngs):
        D, V, H = cfg.emb_dim, cfg.vocab_size, cfg.hidden
        init = nnx.initializers.normal(0.3)
        self.cfg = cfg
        self.embed = nnx.Param(partitioned(init, ("vocab", "embed"))(rngs.params(), (V, D)))
        self.mix = nnx.Param(partitioned(init, ("embed", "heads"))(rngs.params(), (D, D)))
        self.up = nnx.Param(partitioned(init, ("embed", "mlp"))(rngs.params(), (D, H)))
        self.up_bias = nnx.Param(partitioned(nnx.initializers.zeros, ("mlp",))(None, (H,), jnp.float32))
        self.down = nnx.Param(partitioned(init, ("mlp", "embed"))(rngs.params(), (H, D)))
        self.norm = nnx.Param(partitioned(nnx.initializers.ones, ("norm",))(None, (D,), jnp.float32))
        self.moe = TinyRouter(cfg, rngs)
        self.lm_head = nnx.Param(partitioned(init, ("embed", "vocab"))(rngs.params(), (D, V)))
        self.mtp_proj = nnx.Param(partitioned(init, (None, "embed"))(rngs.params(), (2 * D, D)))

    def moe_layers(self):
        return [self.moe]

    def __call__(self, inputs_BT, segment_ids_BT, positions_BT):
        x = self.embed[...][inputs_BT]
        prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        same = jnp.pad(segment_ids_BT, ((0, 0), (1, 0)), constant_values=-1)[:, :-1] == segment_ids_BT
        x = x + jnp.where(same[..., None], prev, 0.0) @ self.mix[...]
        x = x + jnp.tanh(x @ self.up[...] + self.up_bias[...]) @ self.down[...]
        x, aux = self.moe(x, segment_ids_BT)
        h = x * self.norm[...]
        nxt = jnp.pad(self.embed[...][inputs_BT], ((0, 0), (0, 1), (0, 0)))[:, 1:]
        mtp_h = jnp.concatenate([h, nxt], axis=-1) @ self.mtp_proj[...]
        stack = lambda v: jnp.asarray(v)[None]
        moe_aux = {k: stack(v) for k, v in aux.items()}
        return Ling3Output(LMHead(h, self.lm_head[...]), [LMHead(mtp_h, self.lm_head[...])], moe_aux, x)


def tiny_model_def(cfg: TinyConfig = TinyConfig(), seed: int = 0):
    from lingpack.train.step import ModelDef
    make = lambda: TinyLM(cfg, nnx.Rngs(seed))
    return ModelDef.from_constructor(make, cfg), make


def synthetic_batch(rows: int = 8, seq: int = SEQ, seed: int = 0, mean_length: float = 12.0) -> dict:
    """One packed batch from the real data pipeline (synthetic source)."""
    from lingpack.data import DataConfig, make_iterator
    cfg = DataConfig(source="synthetic", seq_length=seq, global_batch_size=rows, seed=seed,
                     synthetic_mean_length=mean_length, synthetic_num_documents=200, read_threads=1,
                     prefetch_buffer_size=1)
    return next(make_iterator(cfg, process_index=0, process_count=1))


def to_jnp(batch: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in batch.items()}


def tree_allclose(a, b, rtol=1e-5, atol=1e-6) -> None:
    """Same tree structure (keys, nesting, leaf count) and every leaf close."""
    assert jax.tree.structure(a) == jax.tree.structure(b), f"{jax.tree.structure(a)} != {jax.tree.structure(b)}"
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=str(path))
