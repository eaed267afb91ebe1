"""Training losses with Megatron-LM's reduction semantics (docs/design.md#megatron-loss-reduction).

A step's global batch of B rows is split into M micro-batches of B/M rows (`step.py` scans over them);
each micro-batch's rows split further into G = `megatron_dp_size` contiguous groups, Megatron's
data-parallel ranks (its sampler orders a global batch as [micro-batch, rank, row]). With per-token
cross-entropy `l`, loss mask `w` (`targets_segmentation != 0`), and sums over a group's tokens:

  megatron, calculate_per_token_loss=False (Megatron's default):
      objective = 1/(M G) sum_{m,g} sum(l w)_{mg} / max(sum(w)_{mg}, 1)
  megatron, calculate_per_token_loss=True, and per_token:
      objective = sum(l w) / max(sum(w), 1)              over the whole step batch
  reported lm_loss (every mode, as Megatron prints it) = sum(l w) / sum(w), token-weighted.

Extra terms:
  * output z-loss (optional): `z_loss_weight * logsumexp(logits)^2` joins each loss token's `l`
    (not the reported lm_loss).
  * MTP (Megatron's gpt_model.py): depth d's loss is its masked sum over its own token count; the
    objective adds `mtp_loss_scale / D * sum_d`, reduced like lm (per group and micro-batch); with
    calculate_per_token_loss Megatron divides the MTP sums by the LM token total; per_token mode by
    each depth's own global count.
  * MoE router z-loss: `weight * sum_layers mean_tokens(logsumexp(router)^2)`; Megatron averages it over
    micro-batches (its AutoScaler scale 1/M); calculate_per_token_loss / per_token use the global token
    mean. The model sums it over a micro-batch, so with G > 1 the per-rank means are taken over the
    whole micro-batch (the lm and MTP terms stay exact; this term, weighted ~3e-6, is approximate).
All sums and logits are fp32 (float64 with float64 logits); masks are 0/1 fp32 and counts fp32, exact below 2^24.
The objective is evaluated per token: `token_weights` writes each reduction above as a weight on each
token's cross-entropy (mask over its group's or the step's count), so that a fused head can take the
weights and form its gradient in the forward (models/head.py).
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp

from lingpack.models.head import LMHead, fused_objective, token_xent, xent  # noqa: F401  (token_xent re-exported)
from lingpack.models.mtp import mtp_targets
from lingpack.precision import at_least_fp32
from lingpack.train.configs import LossConfig


class Totals(typing.NamedTuple):
    """Step-batch token counts the global-mean modes divide by (computed before the micro-batch scan)."""
    lm_tokens: jax.Array        # sum of the loss mask
    mtp_tokens: jax.Array       # [D] per MTP depth
    real_tokens: jax.Array      # inputs_segmentation != 0 (the tokens MoE statistics count)


def loss_mask(batch: dict) -> jax.Array:
    """fp32 [B, T]: 1 where the target is trained (`targets_segmentation` is the mask written as ids). A format:
    0/1 is exact in fp32 and promotes to the cross-entropy's dtype."""
    return (batch["targets_segmentation"] != 0).astype(jnp.float32)


def group_sums(x_BT: jax.Array, groups: int) -> jax.Array:
    """[G] sums over the rows of G contiguous row groups (Megatron's data-parallel ranks)."""
    B = x_BT.shape[0]
    if B % groups:
        raise ValueError(f"a micro-batch of {B} rows does not split into megatron_dp_size={groups} groups; "
                         f"make the micro-batch rows (global_batch_size / micro_batches) a multiple of {groups}")
    return jnp.sum(x_BT.reshape(groups, -1), axis=1)


def mtp_masks(batch: dict, depths: int) -> list[tuple[jax.Array, jax.Array]]:
    """[(targets, mask)] per MTP depth (targets[t + 1 + d], rolled within documents, see mtp.py)."""
    return [mtp_targets(batch["targets"], batch["targets_segmentation"], d, segment_ids_BT=batch["inputs_segmentation"])
            for d in range(depths)]


def totals(batch: dict, mtp_depths: int) -> Totals:
    """Token counts of a whole step batch (any leading shape works: sums run over everything)."""
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}
    mtp = [jnp.sum(mask) for _, mask in mtp_masks(flat, mtp_depths)]
    return Totals(jnp.sum(loss_mask(flat)),
                  jnp.stack(mtp) if mtp else jnp.zeros((0,), jnp.float32),
                  jnp.sum(flat["inputs_segmentation"] != 0).astype(jnp.float32))


def _per_row(x_G: jax.Array, B: int) -> jax.Array:
    """[B, 1]: each row's group value (G contiguous groups of B / G rows)."""
    return jnp.repeat(x_G, B // x_G.shape[0])[:, None]


def token_weights(masks: list, cfg: LossConfig, step_totals: Totals, num_micro_batches: int) -> list:
    """Per head (main, then each MTP depth), [B, T]: the objective's derivative in each token's cross-entropy,
    i.e. the objective is sum over heads and tokens of weight * xent (+ z_loss_weight * the main head's
    weight * lse^2). The module docstring's reductions written per token: a masked token's weight is 0."""
    M, G, D = num_micro_batches, cfg.megatron_dp_size, len(masks) - 1
    scale = [1.0] + [cfg.mtp_loss_scale / max(D, 1)] * D  # Megatron: mtp_loss_scaling_factor / mtp_num_layers per depth
    if cfg.mode == "megatron" and not cfg.calculate_per_token_loss:   # mean over groups of each group's token mean
        B = masks[0].shape[0]
        # max(., 1): an all-masked group adds 0, as Megatron's clamp
        return [c * m / _per_row(G * M * jnp.maximum(group_sums(m, G), 1.0), B) for c, m in zip(scale, masks)]
    wide = masks[0].dtype
    lm_total = jnp.maximum(step_totals.lm_tokens.astype(wide), 1.0)  # an all-masked step gives 0, not NaN
    # Megatron's per-token mode divides MTP sums by the LM token total; per_token by each depth's own.
    mtp_den = [lm_total if cfg.mode == "megatron" else jnp.maximum(step_totals.mtp_tokens[d].astype(wide), 1.0)
               for d in range(D)]
    return [c * m / den for c, m, den in zip(scale, masks, [lm_total, *mtp_den])]


def micro_batch_loss(logits_BTV, mtp_logits: list, moe_aux: dict | None, batch: dict, cfg: LossConfig,
                     step_totals: Totals, *, num_micro_batches: int, moe_z_loss_weight: float = 0.0
                     ) -> tuple[jax.Array, dict]:
    """(this micro-batch's share of the step objective, additive statistics) for one micro-batch.

    `logits_BTV` and each of `mtp_logits`: fp32 [B, T, V] logits, or the model's unevaluated `LMHead`
    (models/head.py: its cross-entropy may run one vocabulary chunk at a time, or, with `fused_rows`, form
    its gradient in the forward from the per-token weights). Summing the first output over the step's
    micro-batches gives the objective (the module docstring); the statistics add up across micro-batches and
    go to `metrics`.
    """
    M, G = num_micro_batches, cfg.megatron_dp_size
    mtp = mtp_masks(batch, len(mtp_logits))
    heads = [logits_BTV, *mtp_logits]
    targets = [batch["targets"], *(t for t, _ in mtp)]
    wide = at_least_fp32((logits_BTV.h_BTD if isinstance(logits_BTV, LMHead) else logits_BTV).dtype)
    masks = [loss_mask(batch), *(m for _, m in mtp)]
    # in the logits' dtype (fp32, or float64): 0/1 masks are exact in any float
    weights = token_weights([m.astype(wide) for m in masks], cfg, step_totals, M)
    z_weights = [cfg.z_loss_weight * weights[0]] + [jnp.zeros_like(w) for w in weights[1:]]
    if isinstance(logits_BTV, LMHead) and logits_BTV.fused_rows:
        objective, xents, lses = fused_objective(heads, targets, weights, z_weights)
    else:
        xents, lses = zip(*(xent(h, t) for h, t in zip(heads, targets)))
        objective = sum(jnp.sum(w * x + z * lse ** 2) for w, z, x, lse in zip(weights, z_weights, xents, lses))

    mask_BT, D = masks[0], len(mtp_logits)
    lm_sum_G, count_G = group_sums(xents[0] * mask_BT, G), group_sums(mask_BT, G)
    if D:
        mtp_sum_DG = jnp.stack([group_sums(x * m, G) for x, m in zip(xents[1:], masks[1:])])
        mtp_count_DG = jnp.stack([group_sums(m, G) for m in masks[1:]])
    else:
        mtp_sum_DG = mtp_count_DG = jnp.zeros((0, G), jnp.float32)

    if moe_aux is not None and moe_aux["router_z_loss"].size:
        z_dtype = at_least_fp32(moe_aux["router_z_loss"].dtype)   # the router's dtype: fp32, or float64
        moe_z_L, moe_n_L = moe_aux["router_z_loss"].astype(z_dtype), moe_aux["num_tokens"].astype(z_dtype)
    else:
        moe_z_L = moe_n_L = jnp.zeros((0,), jnp.float32)
    if cfg.mode == "megatron" and not cfg.calculate_per_token_loss:
        objective += moe_z_loss_weight * jnp.sum(moe_z_L / jnp.maximum(moe_n_L, 1.0)) / M
    else:
        lm_total = jnp.maximum(step_totals.lm_tokens, 1.0)
        z_den = lm_total if cfg.mode == "megatron" else jnp.maximum(step_totals.real_tokens, 1.0)
        objective += moe_z_loss_weight * jnp.sum(moe_z_L) / z_den

    stats = {
        "objective": objective,
        "lm_sum": jnp.sum(lm_sum_G),
        "lm_tokens": jnp.sum(count_G),
        "mtp_sum": jnp.sum(mtp_sum_DG, axis=1),
        "mtp_tokens": jnp.sum(mtp_count_DG, axis=1),
        # Megatron's MTP tracker: per-(micro-batch, rank) token means, later averaged over both.
        "mtp_group_mean_sum": jnp.sum(mtp_sum_DG / jnp.maximum(mtp_count_DG, 1.0), axis=1),
        "moe_z_sum": moe_z_L,
        "moe_z_tokens": moe_n_L,
    }
    return objective, stats


def metrics(stats: dict, cfg: LossConfig, *, num_micro_batches: int) -> dict:
    """Reported loss metrics from statistics summed over a step's micro-batches."""
    lm_loss = stats["lm_sum"] / jnp.maximum(stats["lm_tokens"], 1.0)  # token-weighted, as Megatron prints it
    if stats["mtp_sum"].size:
        if cfg.mode == "megatron":
            per_depth = stats["mtp_group_mean_sum"] / (num_micro_batches * cfg.megatron_dp_size)
        else:
            per_depth = stats["mtp_sum"] / jnp.maximum(stats["mtp_tokens"], 1.0)
        mtp_loss = jnp.mean(per_depth)  # unscaled, averaged over depths
    else:
        mtp_loss = jnp.float32(0.0)
    if stats["moe_z_sum"].size:
        moe_z = jnp.mean(stats["moe_z_sum"] / jnp.maximum(stats["moe_z_tokens"], 1.0))  # unweighted, mean over layers
    else:
        moe_z = jnp.float32(0.0)
    return {"loss": stats["objective"], "lm_loss": lm_loss, "mtp_loss": mtp_loss, "moe_z_loss": moe_z,
            "loss_tokens": stats["lm_tokens"]}


def moe_weights(moe_cfg) -> tuple[float, float]:
    """(router z-loss weight, expert-bias update rate) of the model's MoEConfig; (0, 0) without MoE."""
    return float(getattr(moe_cfg, "z_loss_coef", 0.0)), float(getattr(moe_cfg, "bias_update_rate", 0.0))
