"""Evaluation like Megatron-LM's: `eval_batches` global batches of the valid (or test) split, no gradient.

Megatron (megatron/training/training.py `evaluate`) runs `eval_iters` forward-only iterations and sums
every loss entry's (numerator, denominator) pair over micro-batches, iterations and data-parallel ranks
before dividing: the reported validation loss is token-weighted over everything evaluated, in both
`calculate_per_token_loss` modes. PPL is `exp(min(20, loss))`. Its valid iterator is never rewound: the
k-th evaluation reads valid batches [k * eval_iters, (k + 1) * eval_iters), which is why the valid split
is built with `(train_iters // eval_interval + 1) * eval_iters * global_batch_size` samples (the +1 is the
end-of-training evaluation) and the test split with `eval_iters * global_batch_size`. Here the batch index
is a function of k alone (Grain's random-access dataset), so a resumed run evaluates exactly the batches an
uninterrupted one does, and evaluation never touches the training iterator.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from lingpack import distributed
from lingpack.data.config import DataConfig
from lingpack.errors import ConfigError
from lingpack.models.head import LMHead
from lingpack.parallel.context import context_parallel
from lingpack.parallel.layout import Layout, activation_layout
from lingpack.parallel.reorder import reorder_batch
from lingpack.train import loss as loss_lib
from lingpack.train import sharding as shard_lib
from lingpack.train.configs import LossConfig, TrainConfig
from lingpack.train.step import drop_overflow, kernel_max_segs

log = logging.getLogger("lingpack.train")
PPL_CAP = 20.0  # Megatron prints exp(min(20, loss)): PPL of an untrained large-vocab model stays finite


def split_sample_counts(train_cfg: TrainConfig, global_batch_size: int) -> dict[str, int]:
    """Megatron's valid and test sample counts (`get_train_valid_test_num_samples`)."""
    per_eval = train_cfg.eval_batches * global_batch_size
    return {"valid": (train_cfg.steps // train_cfg.eval_every + 1) * per_eval, "test": per_eval}


def eval_num_samples(data_cfg: DataConfig, train_cfg: TrainConfig, split: str) -> int:
    """Samples the `split` dataset is built with: data.eval_num_samples, else Megatron's count."""
    return data_cfg.eval_num_samples or split_sample_counts(train_cfg, data_cfg.global_batch_size)[split]


def make_eval_step(model_def, loss_cfg: LossConfig, *, micro_batches: int, mesh=None, rules=None, context=None):
    """Jitted `(params, rest, batch) -> additive loss statistics` of one global batch, forward only.

    `context`: traced under context parallelism (parallel/context.py); the batch is then in its layout."""
    model_cfg = model_def.config
    moe_z_weight, _ = loss_lib.moe_weights(getattr(model_cfg, "moe", None))
    depths = getattr(model_cfg, "mtp_num_layers", 0) or 0
    M = micro_batches

    def step(params, rest, batch):
        B = batch["inputs"].shape[0]
        micro = {k: v.reshape(M, B // M, *v.shape[1:]) for k, v in batch.items()}
        if mesh is not None:
            spec = NamedSharding(mesh, P(None, *shard_lib.batch_spec(mesh, rules)))
            micro = {k: jax.lax.with_sharding_constraint(v, spec) for k, v in micro.items()}
        micro, dropped = drop_overflow(micro, kernel_max_segs(model_cfg), context)  # as training leaves them out
        totals = loss_lib.totals(micro, depths)
        model = model_def.merge(params, rest)

        def body(acc, mb):
            out = model(mb["inputs"], mb["inputs_segmentation"], mb["inputs_position"])
            # no gradient here: the heads' plain cross-entropy, not the fused one's three matmuls
            heads = [h.replace(fused_rows=0) if isinstance(h, LMHead) else h for h in (out.head, *out.mtp_heads)]
            _, stats = loss_lib.micro_batch_loss(heads[0], heads[1:], out.moe_aux, mb, loss_cfg,
                                                 totals, num_micro_batches=M, moe_z_loss_weight=moe_z_weight)
            stats = {k: stats[k] for k in STAT_KEYS}
            return stats if acc is None else jax.tree.map(jnp.add, acc, stats), None

        first, _ = body(None, jax.tree.map(lambda v: v[0], micro))
        if M > 1:
            first, _ = jax.lax.scan(body, first, jax.tree.map(lambda v: v[1:], micro))
        return dict(first, **dropped)

    layout = Layout(mesh, rules) if mesh is not None else None

    def traced(params, rest, batch):
        with context_parallel(context), activation_layout(layout):   # the training step's activation layout
            return step(params, rest, batch)

    return jax.jit(traced)


STAT_KEYS = ("lm_sum", "lm_tokens", "mtp_sum", "mtp_tokens", "moe_z_sum", "moe_z_tokens")


def eval_metrics(stats: dict, prefix: str) -> dict:
    """Token-weighted losses from statistics summed over every evaluated micro-batch (Megatron's eval)."""
    lm = float(stats["lm_sum"]) / max(float(stats["lm_tokens"]), 1.0)
    out = {f"{prefix}_lm_loss": lm, f"{prefix}_ppl": math.exp(min(PPL_CAP, lm)),
           f"{prefix}_tokens": int(stats["lm_tokens"])}
    if stats["mtp_sum"].size:  # reported apart, unscaled, mean over depths
        out[f"{prefix}_mtp_loss"] = float(jnp.mean(stats["mtp_sum"] / jnp.maximum(stats["mtp_tokens"], 1.0)))
    if stats["moe_z_sum"].size:  # unweighted router z-loss, mean over MoE layers
        out[f"{prefix}_moe_z_loss"] = float(jnp.mean(stats["moe_z_sum"] / jnp.maximum(stats["moe_z_tokens"], 1.0)))
    if int(stats.get("dropped_documents", 0)):  # documents beyond the kernel's max_segs, left out as in training
        out[f"{prefix}_dropped_documents"] = int(stats["dropped_documents"])
        out[f"{prefix}_dropped_tokens"] = int(stats["dropped_tokens"])
    return out


@dataclasses.dataclass
class Evaluator:
    """Evaluates the model on one split; `evaluate(state, k)` reads that split's batches of evaluation k."""

    split: str
    dataset: object            # Grain MapDataset of this host's batches (random access)
    eval_batches: int
    eval_step: object
    mesh: object = None
    rules: object = None
    context: object = None     # parallel.context.ContextParallel: batches are reordered like training's
    global_rows: int | None = None  # rows of a global batch (this host holds `distributed.process_rows` of them)

    def evaluate(self, state, index: int) -> dict:
        first = index * self.eval_batches
        if (index + 1) * self.eval_batches > len(self.dataset):
            raise ConfigError(f"evaluation {index} needs {self.split} batches up to {(index + 1) * self.eval_batches}"
                              f" but the split has {len(self.dataset)}; raise data.eval_num_samples")
        total = None
        for b in range(first, first + self.eval_batches):
            batch = self.dataset[b]
            if self.context is not None and self.context.load_balance:
                batch = reorder_batch(batch, self.context.size)
            if self.mesh is not None:
                batch = shard_lib.shard_batch(batch, self.mesh, self.rules, self.global_rows)
            stats = self.eval_step(state.params, state.rest, batch)
            total = stats if total is None else jax.tree.map(jnp.add, total, stats)
        return eval_metrics(distributed.fetch(total), "val" if self.split == "valid" else self.split)


def eval_dataset(data_cfg: DataConfig, train_cfg: TrainConfig, split: str, rows: tuple[int, ...] | None = None):
    """This host's batches of `split` (its `rows` of each), sized as Megatron sizes it (unless
    data.eval_num_samples is set)."""
    from lingpack.data.pipeline import make_dataset
    cfg = dataclasses.replace(data_cfg, eval_num_samples=eval_num_samples(data_cfg, train_cfg, split), num_epochs=None)
    try:
        return make_dataset(cfg, split=split, rows=rows)
    except ValueError as error:
        raise ConfigError(f"evaluation (train.eval_every={train_cfg.eval_every}) cannot read the {split} split of "
                          f"data.split={data_cfg.split!r}: {error}. Give the {split} split a non-zero weight in "
                          "data.split, or set train.eval_every=0") from error


def make_evaluators(model_def, data_cfg: DataConfig, loss_cfg: LossConfig, train_cfg: TrainConfig, *,
                    mesh=None, rules=None, context=None) -> dict[str, Evaluator]:
    """{"valid": ..., "test": ...} for the splits evaluation needs ({} when `train.eval_every` is 0)."""
    if not train_cfg.eval_every:
        return {}
    from lingpack.data.indices import split_bookends
    step = make_eval_step(model_def, loss_cfg, micro_batches=train_cfg.micro_batches, mesh=mesh, rules=rules,
                          context=context)
    # Megatron evaluates the test split only when it owns data (its test dataset is None otherwise).
    has_test = split_bookends(data_cfg.split)[2] is not None
    B = data_cfg.global_batch_size
    rows = None if mesh is None else distributed.process_rows(shard_lib.batch_sharding(mesh, rules), B)
    evaluators = {"valid": Evaluator("valid", eval_dataset(data_cfg, train_cfg, "valid", rows), train_cfg.eval_batches,
                                     step, mesh, rules, context, B)}
    if train_cfg.eval_test and has_test:
        try:
            evaluators["test"] = Evaluator("test", eval_dataset(data_cfg, train_cfg, "test", rows),
                                           train_cfg.eval_batches, step, mesh, rules, context, B)
        except ValueError as error:  # a small corpus can leave the (tiny) test share empty: say so, go on
            log.warning("no test evaluation (train.eval_test=false silences this): %s", error.__cause__ or error)
    return evaluators


def megatron_line(prefix: str, metrics: dict, key: str = "val", note: str = "") -> str:
    """Megatron's console line, e.g. ` validation loss at iteration 20 | lm loss value: ... | lm loss PPL: ... |`,
    then `note` (what was evaluated: a periodic and an end-of-run evaluation at one iteration read other batches)."""
    return (f" validation loss at {prefix} | lm loss value: {metrics[f'{key}_lm_loss']:.6E} | "
            f"lm loss PPL: {metrics[f'{key}_ppl']:.6E} | {note}")


def batches_note(when: str, split: str, index: int, eval_batches: int) -> str:
    """`(periodic: valid batches 6-7)`: which batches of the split evaluation `index` read."""
    first, last = index * eval_batches, (index + 1) * eval_batches - 1
    return f"({when}: {split} batch{'es' if last > first else ''} {first}{f'-{last}' if last > first else ''})"
