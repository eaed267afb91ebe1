"""A PyTorch reference trainer with Megatron-LM's semantics, built from external code.

* samples: megatron-core's own `GPTDataset` (BlendedMegatronDatasetBuilder) on the same `.bin/.idx`
  files, seed and split as lingpack's pipeline; global batch k = samples [k*G, (k+1)*G);
* model: `parity/reference_model.py`'s `Ling3Reference` (transformers' KimiLinear with FLA's lower-bound
  gate, transformers' DeepseekV3Attention for RoPE MLA, the MTP layer glue), from lingpack's weights;
* packing: Megatron's varlen meaning (`cu_seqlens` from EOD: a document ends after its EOD, and every
  sample ends one) realised literally: each document runs alone in its own batch row, with the sample's
  `position_ids` (right padding is invisible to a causal model);
* MTP: megatron-core's `roll_tensor` rolls the group's ids, labels and loss mask per depth on the packed
  THD layout (`cu_seqlens` per document), as its GPTModel does; each depth's loss is its masked sum over
  the rolled mask's count, times `mtp_loss_scale / depths`, reduced like the lm loss;
* ranks: each micro-batch's rows split into `loss.megatron_dp_size` contiguous groups, one per Megatron
  data-parallel rank (its sampler's [micro-batch, rank, row] order); each group runs as its own forward;
* loss: Megatron's `loss_func` (sum(loss * mask), sum(mask)) per (micro-batch, rank), the backward
  objective the mean of their token means (or the global token mean with `calculate_per_token_loss`), the
  reported `lm loss` token-weighted;
* MoE: the router z-loss is megatron-core's `z_loss_func` per (micro-batch, rank), scaled as its
  `MoEAuxLossAutoScaler` and `finalize_model_grads` scale it in each loss mode; the expert bias moves by
  megatron-core's `get_updated_expert_bias` on the step's load counts (single-rank process group), then is
  re-centred to mean 0 as Ling3 does (a constant shift never changes a choice: glue, not semantics);
  transformers' router keeps it as `e_score_correction_bias`;
* routing: every router call is recorded (parity/routing.py); with `lock_routing` the router's top-k ids
  are replaced by lingpack's for the same tokens, weights still from this side's own scores;
* optimiser: torch AdamW driven by megatron-core's `OptimizerParamScheduler` (warmup + cosine/linear
  decay, weight decay through `wd_mult`, 0 on norms/biases/A_log/dt_bias), global-norm clipping with
  Megatron's `max_norm / (norm + 1e-6)`;
* evaluation: megatron-core's valid / test `GPTDataset` (same builder call, Megatron's split sizes), the
  k-th evaluation on valid batches [k * eval_iters, (k + 1) * eval_iters), forward only, every (loss sum,
  token count) summed over micro-batches, ranks and batches before dividing, as Megatron's `evaluate`;
* dtype: the reference network's (`Ling3Reference.dtype`, float32 or float64); every loss term, mask and
  statistic follows it, and megatron-core's functions (z-loss, bias update, roll) compute in their inputs' dtype.
"""

from __future__ import annotations

import collections
import numpy as np


class _Tokenizer:
    """The attributes megatron-core's GPTDataset reads from a tokenizer."""

    def __init__(self, eod: int, pad: int, vocab_size: int):
        self.eod, self.pad, self.vocab_size = eod, pad, vocab_size
        self.unique_identifiers = collections.OrderedDict(
            [("class", "lingpack.parity"), ("eod", eod), ("pad", pad), ("vocab_size", vocab_size)])


def megatron_datasets(data_cfg, sizes: list, cache_dir: str | None = None):
    """megatron-core's (train, valid, test) GPTDatasets of `data_cfg` (single prefix or blend), `sizes` samples
    each (Megatron's `train_valid_test_num_samples`; megatron-core builds every split independently)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    config = GPTDatasetConfig(
        random_seed=data_cfg.seed, sequence_length=data_cfg.seq_length,
        blend=get_blend_from_list(list(data_cfg.paths)), split=data_cfg.split, path_to_cache=cache_dir,
        tokenizer=_Tokenizer(data_cfg.eod_id, data_cfg.pad_id, data_cfg.vocab_size),
        reset_position_ids=data_cfg.reset_position_ids, reset_attention_mask=data_cfg.reset_attention_mask,
        eod_mask_loss=data_cfg.eod_mask_loss, create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, config).build()


def documents(tokens: np.ndarray, eod_id: int, reset_attention_mask: bool) -> list[tuple[int, int]]:
    """[start, end) spans of the documents in one sample: each ends after its EOD and at the sample end."""
    if not reset_attention_mask:
        return [(0, len(tokens))]
    ends = [int(i) + 1 for i in np.nonzero(tokens == eod_id)[0] if i + 1 < len(tokens)] + [len(tokens)]
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


class MegatronReferenceTrainer:
    """Trains the reference Ling3 (reference_model.Ling3Reference) exactly as Megatron-LM would on packed samples."""

    def __init__(self, hf_model, data_cfg, optim_cfg, loss_cfg, *, micro_batches: int, num_samples: int,
                 moe_z_loss_weight: float = 0.0, expert_bias_rate: float = 0.0, cache_dir: str | None = None,
                 eval_samples: dict | None = None, dataset=None):
        """`hf_model`: a `reference_model.Ling3Reference`. `eval_samples`: {"valid": n, "test": m}, the sizes the
        evaluation splits are built with (none: no evaluation; megatron-core then builds them one epoch long,
        unused). `dataset`: training samples in GPTDataset's format (dicts of tokens, labels, loss_mask,
        position_ids tensors) instead of megatron-core's GPTDataset (tests; no evaluation splits)."""
        import torch
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from lingpack.train.optim import applies_weight_decay
        self.torch = torch
        self.model, self.data_cfg, self.optim_cfg, self.loss_cfg = hf_model, data_cfg, optim_cfg, loss_cfg
        self.micro_batches, self.moe_z_weight, self.bias_rate = micro_batches, moe_z_loss_weight, expert_bias_rate
        self.dataset, self.eval_datasets = dataset, {}
        if dataset is None:
            eval_samples = eval_samples or {}
            self.dataset, *evaluation = megatron_datasets(
                data_cfg, [num_samples, eval_samples.get("valid"), eval_samples.get("test")], cache_dir)
            self.eval_datasets = dict(zip(("valid", "test"), evaluation))
        decay, no_decay = [], []
        for name, param in hf_model.named_parameters():
            (decay if applies_weight_decay(name, param.ndim) else no_decay).append(param)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay}, {"params": no_decay, "wd_mult": 0.0}],
            lr=optim_cfg.lr, betas=(optim_cfg.b1, optim_cfg.b2), eps=optim_cfg.eps)
        decay_steps = max(optim_cfg.decay_steps or 0, optim_cfg.warmup_steps + 1)  # "constant" never reads it
        self.scheduler = OptimizerParamScheduler(  # counted in updates (Megatron counts samples: same ratios)
            self.optimizer, init_lr=0.0, max_lr=optim_cfg.lr, min_lr=optim_cfg.min_lr,
            lr_warmup_steps=optim_cfg.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=optim_cfg.schedule,
            start_wd=optim_cfg.weight_decay, end_wd=optim_cfg.weight_decay, wd_incr_steps=decay_steps,
            wd_incr_style="constant")
        self.routers = [m for m in hf_model.modules() if type(m).__name__ == "KimiLinearTopkRouter"]
        self._captured: list = []
        self._lock = None  # (flat indices of the real tokens, per-router lingpack ids) during a locked forward
        for router in self.routers:
            router.register_forward_hook(self._router_hook)
        if self.bias_rate and self.routers:
            _single_rank_megatron()

    def _router_hook(self, module, args, out):
        """Record the router's own choice; with a lock, hand the experts lingpack's ids instead."""
        router_logits, weights, own_ids = out
        self._captured.append((router_logits, own_ids))
        if self._lock is None:
            return None
        index, locked = self._lock
        ids = own_ids.clone()
        ids[index] = locked[len(self._captured) - 1]
        weights = router_logits.sigmoid().gather(1, ids)  # transformers' weighting, on the locked ids
        if module.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, weights * module.routed_scaling_factor, ids

    def _group(self, samples: list[dict], locked_ids=None, z_weight: float | None = None):
        """One (micro-batch, rank) group, every document in its own row, starting at position 0.

        Rows are right-padded to the longest document; the model is causal, so padding after a document
        cannot change its logits, and padded positions are masked out of the loss and the router statistics.
        `locked_ids` [L, R, T, k] (lingpack's choice for these R rows) replaces the routers' own. `z_weight`
        replaces the router z-loss weight (evaluation reports it unweighted).
        Returns (loss sum, loss count, real tokens, per-router z-loss, per-router loads, routing [L, R, T, .],
        per MTP depth (masked loss sum, rolled mask count), per-router unweighted z-loss sum over the real tokens).
        """
        torch = self.torch
        spans = [(r, a, b) for r, s in enumerate(samples)
                 for a, b in documents(s["tokens"].numpy(), self.data_cfg.eod_id, self.data_cfg.reset_attention_mask)]
        length = max(b - a for _, a, b in spans)
        T = len(samples[0]["tokens"])
        index = torch.zeros(len(samples) * T, dtype=torch.long)  # lingpack token (r, t) -> padded flat position
        for d, (r, a, b) in enumerate(spans):
            index[r * T + a:r * T + b] = d * length + torch.arange(b - a)
        pad = lambda x: torch.nn.functional.pad(x, (0, length - len(x)))
        tokens = torch.stack([pad(samples[r]["tokens"][a:b]) for r, a, b in spans])
        labels = torch.stack([pad(samples[r]["labels"][a:b]) for r, a, b in spans])
        dtype = self.model.dtype
        mask = torch.stack([pad(samples[r]["loss_mask"][a:b].to(dtype)) for r, a, b in spans])  # 0 on padding
        positions = torch.stack([pad(samples[r]["position_ids"][a:b]) for r, a, b in spans])
        padding = torch.ones(len(spans) * length, dtype=torch.bool)
        padding[index] = False
        rows = lambda flat: torch.zeros(len(spans) * length, dtype=flat.dtype).index_put((index,), flat).reshape(
            len(spans), length)                                          # packed [R*T] -> one document per row
        mtp = _mtp_rolls(samples, spans, len(self.model.mtp), dtype)
        self._captured.clear()
        locked = None if locked_ids is None else [torch.as_tensor(ids).reshape(-1, ids.shape[-1]).long()
                                                  for ids in locked_ids]      # per router [R*T, k]
        self._lock = None if locked is None else (index, locked)
        try:
            logits, mtp_logits = self.model(tokens, positions, [(rows(ids), rows(keep)) for ids, _, _, keep in mtp])
        finally:
            self._lock = None
        xent = lambda logits, labels: torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").reshape(labels.shape)
        mtp_terms = [(torch.sum(xent(d_logits, rows(d_labels)) * rows(d_mask)), d_mask.sum())
                     for d_logits, (_, d_labels, d_mask, _) in zip(mtp_logits, mtp, strict=True)]
        from megatron.core.transformer.moe.moe_utils import z_loss_func
        z, z_sums, loads, routing = [], [], [], {k: [] for k in ("expert_ids", "router_logits")}
        for n, (router_logits, own_ids) in enumerate(self._captured):
            own = own_ids[index]                                         # [R*T, k] in lingpack's token order
            used = own if locked is None else locked[n]
            weight = self.moe_z_weight if z_weight is None else z_weight
            z.append(z_loss_func(router_logits, weight, padding_mask=padding))  # weight * mean over real tokens
            z_sums.append(float(z_loss_func(router_logits.detach(), 1.0, padding_mask=padding)) * int((~padding).sum()))
            loads.append(torch.bincount(used.reshape(-1), minlength=self.routers[n].num_experts))
            routing["expert_ids"].append(own.reshape(len(samples), T, -1).numpy())
            routing["router_logits"].append(router_logits[index].detach().reshape(len(samples), T, -1).numpy())
        lm_sum = torch.sum(xent(logits, labels) * mask)
        return lm_sum, torch.sum(mask), int((~padding).sum()), z, loads, routing, mtp_terms, z_sums

    def step(self, step: int, locked: dict | None = None) -> tuple[dict, dict]:
        """One optimizer step on global batch `step` -> (Megatron's reported metrics, this side's routing or None).

        `locked`: lingpack's routing of this step (routing.py layout); its expert ids replace the routers'.
        """
        torch = self.torch
        B, M, G = self.data_cfg.global_batch_size, self.micro_batches, self.loss_cfg.megatron_dp_size
        rows = [self.dataset[i] for i in range(step * B, (step + 1) * B)]
        per_group = B // (M * G)
        bias = np.stack([r.e_score_correction_bias.numpy().copy() for r in self.routers]) if self.routers else None
        self.optimizer.zero_grad(set_to_none=True)
        results = []
        for u in range(M * G):  # Megatron's order: micro-batch, then rank
            chunk = slice(u * per_group, (u + 1) * per_group)
            results.append(self._group(rows[chunk], None if locked is None else locked["expert_ids"][:, chunk]))
        lm_total = sum(r[1] for r in results)
        objective = megatron_objective([r[:4] + (r[6],) for r in results], self.loss_cfg, M * G,
                                       with_z=bool(self.moe_z_weight))
        objective.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.sqrt(sum(torch.sum(p.grad.double() ** 2) for p in params)))
        clip = self.optim_cfg.clip_grad_norm
        if clip and grad_norm > 0:
            coeff = clip / (grad_norm + 1e-6)
            if coeff < 1.0:
                for p in params:
                    p.grad.mul_(coeff)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step(increment=1)
        if self.bias_rate and self.routers:
            self._update_expert_bias([sum(r[4][n] for r in results) for n in range(len(self.routers))])
        lm_loss = float(sum(r[0].detach() for r in results) / lm_total)
        routing = None
        if self.routers:  # [L, rows of each group, T, .] -> [L, B, T, .]
            routing = {k: np.concatenate([np.stack(r[5][k]) for r in results], axis=1)
                       for k in ("expert_ids", "router_logits")}
            routing["expert_bias"] = bias
        record = {"step": step, "lm_loss": lm_loss, "grad_norm": grad_norm, "lr": lr, "loss_tokens": float(lm_total)}
        if self.routers:  # as lingpack's moe_z_loss: unweighted, token mean over the step, mean over MoE layers
            real = sum(r[2] for r in results)
            record["moe_z_loss"] = float(np.mean([sum(r[7][n] for r in results) / max(real, 1)
                                                  for n in range(len(self.routers))]))
        if self.model.mtp:  # Megatron's MTP tracker: per-(micro-batch, rank) token means, averaged, then over depths
            record["mtp_loss"] = float(np.mean([[float(s.detach()) / max(float(c), 1.0) for s, c in r[6]] for r in results]))
        return record, routing

    def evaluate(self, split: str, index: int, eval_batches: int) -> dict:
        """Megatron's `evaluate` with the current weights: evaluation `index` of `split`, no gradient.

        Reads global batches [index * eval_batches, (index + 1) * eval_batches) of megatron-core's dataset (the
        never-rewound valid iterator; `eval_sample_range`), runs them in training's (micro-batch, rank) groups
        and sums every loss sum and token count over groups and batches before dividing. Returns
        `train/evaluate.py`'s metrics (val_* or test_*): lm loss, PPL, tokens and the unweighted router z-loss
        (mean over MoE layers, token-weighted) and, with an MTP head, the MTP loss (mean over depths).
        """
        torch = self.torch
        from lingpack.train.evaluate import eval_metrics
        dataset = self.eval_datasets.get(split)
        B, groups = self.data_cfg.global_batch_size, self.micro_batches * self.loss_cfg.megatron_dp_size
        samples = eval_sample_range(index, eval_batches, B)
        if dataset is None or samples.stop > len(dataset):
            raise ValueError(f"evaluation {index} needs {split} samples up to {samples.stop} but megatron-core built "
                             f"{0 if dataset is None else len(dataset)}: pass eval_samples={{{split!r}: ...}}")
        per_group = B // groups
        totals = np.zeros(3)                     # lm loss sum, loss tokens, real tokens
        z_sum = np.zeros(len(self.routers))      # per MoE layer: sum of logsumexp^2 over real tokens
        mtp = np.zeros((2, len(self.model.mtp)))  # per MTP depth: masked loss sum, rolled mask count
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in samples[::per_group]:  # Megatron's order: batch, micro-batch, rank
                    loss_sum, count, real, z, _, _, mtp_terms, _ = self._group(
                        [dataset[i] for i in range(start, start + per_group)], z_weight=1.0)
                    totals += [float(loss_sum), float(count), real]
                    mtp += np.array([[float(v), float(c)] for v, c in mtp_terms]).reshape(-1, 2).T
                    z_sum += np.array([float(v) * real for v in z])  # z_loss_func's mean over real tokens -> sum
        finally:
            self.model.train(was_training)
        stats = {"lm_sum": totals[0], "lm_tokens": totals[1], "mtp_sum": mtp[0], "mtp_tokens": mtp[1],
                 "moe_z_sum": z_sum, "moe_z_tokens": np.full(len(z_sum), totals[2])}
        return eval_metrics(stats, "val" if split == "valid" else split)

    def _update_expert_bias(self, loads: list) -> None:
        """megatron-core's update on the step's loads [L, E], re-centred (Ling3), into the routers' buffers."""
        torch = self.torch
        from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
        biases = torch.stack([r.e_score_correction_bias for r in self.routers])
        updated = get_updated_expert_bias(torch.stack(loads).to(biases.dtype), biases, self.bias_rate)  # counts: exact
        with torch.no_grad():
            for router, bias in zip(self.routers, updated):
                router.e_score_correction_bias.copy_(bias - bias.mean())


def eval_sample_range(index: int, eval_batches: int, global_batch_size: int) -> range:
    """Samples of evaluation `index`: Megatron's valid iterator is never rewound, so evaluation k reads global
    batches [k * eval_batches, (k + 1) * eval_batches) (the test split is evaluated once, k = 0)."""
    return range(index * eval_batches * global_batch_size, (index + 1) * eval_batches * global_batch_size)


def _mtp_rolls(samples: list[dict], spans: list[tuple[int, int, int]], depths: int, dtype=None) -> list[tuple]:
    """Per MTP depth (ids, labels, loss mask, keep), each packed [R*T]: megatron-core's `roll_tensor` applied
    once more per depth to the group's THD-flattened samples, one sequence per document (`spans`); `keep`
    is a rolled vector of ones (0 where the roll left the document); mask and keep in `dtype` (fp32 by default)."""
    if not depths:
        return []
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import roll_tensor
    T = len(samples[0]["tokens"])
    cu = torch.tensor([r * T + a for r, a, _ in spans] + [len(samples) * T], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    flat = lambda key: torch.cat([s[key] for s in samples])[None]
    dtype = dtype or torch.float32
    rolled = (flat("tokens"), flat("labels"), flat("loss_mask").to(dtype), torch.ones(1, len(samples) * T, dtype=dtype))
    out = []
    for _ in range(depths):
        rolled = tuple(roll_tensor(x, shifts=-1, dims=-1, packed_seq_params=params)[0] for x in rolled)
        out.append(tuple(x[0] for x in rolled))
    return out


def megatron_objective(groups: list, loss_cfg, num_groups: int, *, with_z: bool = True):
    """The step objective from per-(micro-batch, rank) results (loss sum, loss count, real tokens, z-losses
    [, MTP terms: per depth (masked loss sum, rolled mask count)]).

    Each z-loss is megatron-core's `z_loss_func` value (weight x mean over the group's real tokens), one
    per MoE layer. Megatron default: lm token means and z-losses summed over groups / num_groups (the
    AutoScaler's 1/num_micro_batches, then the data-parallel average); calculate_per_token_loss: sums over
    the step's loss tokens (the AutoScaler gets z * num_tokens, finalize_model_grads divides by the total);
    lingpack's per_token mode: lm over loss tokens, z over real tokens (train/loss.py). MTP (Megatron's
    GPTModel, MTPLossAutoScaler): `mtp_loss_scale / depths` times each depth's sum over its count, reduced
    like the lm term; calculate_per_token_loss: the sums over the step's lm tokens; per_token: over the
    depth's own step count.
    """
    import torch
    lm_total = sum(g[1] for g in groups)
    real_total = sum(g[2] for g in groups)
    mtp_totals = [sum(g[4][d][1] for g in groups) for d in range(len(groups[0][4]))] if len(groups[0]) > 4 else []
    per_token = loss_cfg.mode == "per_token" or loss_cfg.calculate_per_token_loss
    objective = torch.zeros((), dtype=groups[0][0].dtype)   # the loss sums' dtype (the reference's)
    for loss_sum, count, real, z, *mtp in groups:
        mtp = mtp[0] if mtp else []
        mtp_weight = loss_cfg.mtp_loss_scale / max(len(mtp), 1)
        if per_token:
            objective = objective + loss_sum / torch.clamp(lm_total, min=1.0)
            for (mtp_sum, _), mtp_total in zip(mtp, mtp_totals):
                den = mtp_total if loss_cfg.mode == "per_token" else lm_total
                objective = objective + mtp_weight * mtp_sum / torch.clamp(torch.as_tensor(den), min=1.0)
        else:  # Megatron default: each (micro-batch, rank) token mean; grads / num_micro_batches, DP-averaged
            objective = objective + loss_sum / torch.clamp(count, min=1.0) / num_groups
            for mtp_sum, mtp_count in mtp:
                objective = objective + mtp_weight * mtp_sum / torch.clamp(torch.as_tensor(mtp_count), min=1.0) / num_groups
        if with_z and z:
            z_mean = sum(z)
            if loss_cfg.mode == "per_token":      # lingpack's global per-token mean over real tokens
                objective = objective + z_mean * real / max(real_total, 1)
            elif loss_cfg.calculate_per_token_loss:  # z * num_tokens, then finalize / total loss tokens
                objective = objective + z_mean * real / torch.clamp(lm_total, min=1.0)
            else:                                  # AutoScaler scale 1/num_micro_batches, DP average
                objective = objective + z_mean / num_groups
    return objective


def _single_rank_megatron() -> None:
    """A one-process gloo group and megatron-core's parallel state (its bias update all-reduces over it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
