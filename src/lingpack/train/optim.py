"""AdamW with Megatron-LM's learning-rate schedule, weight-decay rule and gradient clipping.

* Schedule (megatron/core/optimizer_param_scheduler.py, counted in updates): linear warmup from 0 over
  `warmup_steps` (update 0 runs at lr 0 when warming up, as in Megatron), then cosine / linear decay to
  `min_lr` at `decay_steps` (warmup included), `min_lr` after; "constant" stays at `lr` after warmup.
* Weight decay: none on 1-D parameters (norm weights, A_log, dt_bias, biases; Megatron's rule is
  `name.endswith('.bias') or param.ndim == 1`) nor anything named bias / A_log / dt_bias.
* Clipping: Megatron's `clip_coeff = max_norm / (norm + 1e-6)`, applied only when < 1; the reported
  grad_norm is the norm before clipping.
* AdamW itself is decoupled (torch.optim.AdamW == optax.adamw: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd p)).
"""

from __future__ import annotations

import math
import typing

import jax
import jax.numpy as jnp
import optax

from lingpack.precision import at_least_fp32
from lingpack.train.configs import OptimConfig

NO_DECAY_NAMES = ("bias", "A_log", "dt_bias")


def resolve(cfg: OptimConfig, total_steps: int) -> OptimConfig:
    """The config with `decay_steps` filled in from the run length when it was left None."""
    if cfg.decay_steps is not None:
        return cfg
    import dataclasses
    return dataclasses.replace(cfg, decay_steps=max(total_steps, cfg.warmup_steps + 1))


def learning_rate(cfg: OptimConfig) -> typing.Callable[[jax.Array], jax.Array]:
    """Megatron's schedule as a function of the number of updates already applied (0 for the first).

    Computed in fp32, or in the master dtype when wider: Megatron's scheduler computes in Python floats, and an
    fp32 learning rate would round every float64 update by ~3e-8 of itself."""
    if cfg.decay_steps is None and cfg.schedule != "constant":
        raise ValueError(f"OptimConfig.decay_steps is None for schedule={cfg.schedule!r}; call optim.resolve(cfg, steps)")
    warmup, decay = cfg.warmup_steps, cfg.decay_steps
    dtype = at_least_fp32(cfg.master_dtype)

    def schedule(count):
        n = jnp.asarray(count, dtype)
        warm = cfg.lr * n / max(warmup, 1)
        if cfg.schedule == "constant":
            after = jnp.asarray(cfg.lr, dtype)
        else:
            ratio = jnp.clip((n - warmup) / (decay - warmup), 0.0, 1.0)
            coeff = 0.5 * (jnp.cos(math.pi * ratio) + 1.0) if cfg.schedule == "cosine" else 1.0 - ratio
            after = jnp.where(n > decay, cfg.min_lr, cfg.min_lr + coeff * (cfg.lr - cfg.min_lr))
        return jnp.where((warmup > 0) & (n <= warmup), warm, after)  # Megatron: num_steps <= warmup is warmup
    return schedule


def _leaf_name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def applies_weight_decay(name: str, ndim: int) -> bool:
    """The weight-decay rule, the one definition (lingpack pytrees and the torch reference's named parameters):
    no decay on 1-D tensors nor on anything whose name ends in bias / A_log / dt_bias."""
    return ndim > 1 and not name.endswith(NO_DECAY_NAMES)


def decay_mask(params):
    """Pytree of bools: True where weight decay applies (see `applies_weight_decay`).

    The ndim rule counts a layer's own axes: scanned layers' parameters carry leading stack axes.
    """
    from lingpack.models.ling3 import stacked_axes
    return jax.tree_util.tree_map_with_path(
        lambda path, p: applies_weight_decay(_leaf_name(path), p.ndim - stacked_axes(path)), params)


def global_norm(tree) -> jax.Array:
    """L2 norm over all leaves, accumulated in fp32 or wider (bf16 squares would lose the small gradients)."""
    leaves = jax.tree.leaves(tree)
    wide = at_least_fp32(*(x.dtype for x in leaves))
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(wide))) for x in leaves))


def clip_by_global_norm_megatron(max_norm: float) -> optax.GradientTransformation:
    """Megatron's clip_grad_norm: scale by max_norm / (norm + 1e-6) when that is below 1 (eps: no 0/0)."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        coeff = max_norm / (norm + 1e-6)
        scale = jnp.where(coeff < 1.0, coeff, 1.0)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Clip (when clip_grad_norm > 0), then AdamW with the schedule and the decay mask."""
    adamw = optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    if cfg.clip_grad_norm > 0:
        return optax.chain(clip_by_global_norm_megatron(cfg.clip_grad_norm), adamw)
    return adamw
