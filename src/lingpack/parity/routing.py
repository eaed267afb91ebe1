"""The routing trace: which experts each side chose, per step, MoE layer and token, and where they differ.

Both sides record every step in the step batch's own layout (numpy):

    expert_ids     int   [L, B, T, k]   the experts each token was sent to (L MoE layers, B rows, T tokens)
    router_logits  fp32  [L, B, T, E]   the router logits they were chosen from
    expert_bias    fp32  [L, E]         the balancing bias that took part in the choice

lingpack's comes out of the train step itself (`loop.train(routing_callback=...)`, `from_lingpack`), so it
is exactly the routing the step trained with; the reference records what its own router chose (also when
`parity.lock_routing` makes it use lingpack's selections instead). `compare` finds the first step and layer
where the chosen SETS differ and measures how close to a tie each flipped token was (`decision_margin`), and
follows the expert biases apart: they decide the choices without touching the loss until a choice flips, so a
bias update that differs is seen here first (`bias_rel_diff_per_step`).
"""

from __future__ import annotations

import numpy as np

KEYS = ("expert_ids", "router_logits", "expert_bias")


def from_lingpack(routing: dict, seq_length: int) -> dict:
    """The train step's routing ([M, L, R*T, ...] per micro-batch, R rows each) in the [L, B, T, ...] layout."""
    ids, logits, bias = (np.asarray(routing[k]) for k in KEYS)
    M, L, N, k = ids.shape
    if N % seq_length:
        raise ValueError(f"routing holds {N} tokens per micro-batch, not a multiple of seq_length={seq_length}")
    if not np.array_equal(bias, np.broadcast_to(bias[:1], bias.shape)):
        raise ValueError("expert_bias changed between the micro-batches of one step; it moves once per step")
    to_rows = lambda x: np.moveaxis(x.reshape(M, L, N // seq_length, seq_length, -1), 1, 0).reshape(
        L, M * (N // seq_length), seq_length, -1)
    return {"expert_ids": to_rows(ids), "router_logits": to_rows(logits), "expert_bias": bias[0]}


def decision_margin(logits: np.ndarray, bias: np.ndarray, moe_cfg) -> np.ndarray:
    """[...] how far each token's choice was from a tie: the smaller of the group gap and the expert gap.

    Choice scores are `sigmoid(logits) + bias` (moe.py). With groups, the gap between the last kept and the
    first dropped group score (sum of a group's 2 best); then, among the kept groups, the gap between the
    k-th and (k+1)-th expert. A gap that does not exist (everything kept) counts as +inf. float64.
    """
    E, k, G, kept_groups = logits.shape[-1], moe_cfg.top_k, moe_cfg.n_groups, moe_cfg.topk_groups
    choice = 1.0 / (1.0 + np.exp(-logits.astype(np.float64))) + bias.astype(np.float64)
    margin = np.full(logits.shape[:-1], np.inf)
    if G > 1:
        group_scores = np.sort(choice.reshape(*choice.shape[:-1], G, E // G), axis=-1)[..., -2:].sum(-1)
        order = np.argsort(-group_scores, axis=-1, kind="stable")
        if kept_groups < G:
            ranked = np.take_along_axis(group_scores, order, axis=-1)
            margin = ranked[..., kept_groups - 1] - ranked[..., kept_groups]
        keep = np.zeros(group_scores.shape, bool)
        np.put_along_axis(keep, order[..., :kept_groups], True, axis=-1)
        choice = np.where(np.repeat(keep, E // G, axis=-1), choice, -np.inf)
    if k < E:
        ranked = -np.sort(-choice, axis=-1)
        margin = np.minimum(margin, ranked[..., k - 1] - ranked[..., k])  # a dropped group's -inf: gap +inf
    return margin


def flipped(a_ids: np.ndarray, b_ids: np.ndarray) -> np.ndarray:
    """bool [...]: the two sides chose different expert SETS for the token (the order of the k is free)."""
    return np.any(np.sort(a_ids, axis=-1) != np.sort(b_ids, axis=-1), axis=-1)


def compare(lingpack: dict, reference: dict, moe_cfg) -> dict:
    """Routing difference report over `{step: trace}` dicts (both sides, same steps).

    Returns the first step and MoE layer whose selections differ (None when none ever do), how many
    tokens flipped there, their decision margins on both sides, the largest router-logit difference
    between the sides on those tokens and over the whole step, per-step flip counts, and per step the largest
    expert-bias difference relative to the largest bias (0 while both are all zero), and its maximum.
    """
    steps = sorted(set(lingpack) & set(reference))
    if not steps:
        raise ValueError("routing compare: the two traces share no step")
    per_step, first = {}, None
    for step in steps:
        ours, theirs = lingpack[step], reference[step]
        if ours["expert_ids"].shape != theirs["expert_ids"].shape:
            raise ValueError(f"step {step}: routing layouts differ: {ours['expert_ids'].shape} vs "
                             f"{theirs['expert_ids'].shape}")
        flips_LBT = flipped(ours["expert_ids"], theirs["expert_ids"])
        per_step[step] = int(flips_LBT.sum())
        if first is None and per_step[step]:
            layer = int(np.nonzero(flips_LBT.reshape(flips_LBT.shape[0], -1).any(-1))[0][0])
            first = _flip_detail(step, layer, ours, theirs, flips_LBT[layer], moe_cfg)
    logit_diff = {s: float(np.max(np.abs(lingpack[s]["router_logits"] - reference[s]["router_logits"])))
                  for s in steps}
    bias_diff = {s: bias_rel_diff(lingpack[s]["expert_bias"], reference[s]["expert_bias"]) for s in steps}
    return {"steps": len(steps), "first_flip": first, "flips_per_step": per_step,
            "total_flips": sum(per_step.values()), "max_logit_diff_per_step": logit_diff,
            "bias_rel_diff_per_step": bias_diff, "bias_max_rel_diff": max(bias_diff.values())}


def bias_rel_diff(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max |ours - theirs| / max |theirs| over every layer and expert (0 when both biases are all zero). float64."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    diff, scale = float(np.max(np.abs(ours - theirs))), float(np.max(np.abs(theirs)))
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


def _flip_detail(step: int, layer: int, ours: dict, theirs: dict, flips_BT: np.ndarray, moe_cfg) -> dict:
    logits_a, logits_b = ours["router_logits"][layer][flips_BT], theirs["router_logits"][layer][flips_BT]
    margin_a = decision_margin(logits_a, ours["expert_bias"][layer], moe_cfg)
    margin_b = decision_margin(logits_b, theirs["expert_bias"][layer], moe_cfg)
    rows, positions = np.nonzero(flips_BT)
    return {"step": step, "layer": layer, "tokens": int(flips_BT.sum()),
            "where": [(int(r), int(t)) for r, t in zip(rows[:8], positions[:8])],
            "lingpack_margin_max": float(np.max(margin_a)), "reference_margin_max": float(np.max(margin_b)),
            "flipped_logit_diff_max": float(np.max(np.abs(logits_a - logits_b))),
            "bias_diff_max": float(np.max(np.abs(ours["expert_bias"][layer] - theirs["expert_bias"][layer])))}


def summary_line(report: dict) -> str:
    first = report["first_flip"]
    if first is None:
        return f"routing trace: identical expert selections on every token for {report['steps']} steps"
    return (f"routing trace: first flip at step {first['step']}, MoE layer {first['layer']}: {first['tokens']} "
            f"token(s), decision margin <= {first['lingpack_margin_max']:.2e} (lingpack) / "
            f"{first['reference_margin_max']:.2e} (reference), router logits differ by <= "
            f"{first['flipped_logit_diff_max']:.2e} there; {report['total_flips']} flipped token-layers in all")
