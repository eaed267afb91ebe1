"""A PyTorch reference trainer with Megatron-LM's semantics, built from external code.

* samples: megatron-core's own `GPTDataset` (BlendedMegatronDatasetBuilder) on the same `.bin/.idx`
  files, seed and split as lingpack's pipeline; global batch k = samples [k*G, (k+1)*G);
* packing: Megatron's varlen meaning (`cu_seqlens` from EOD: a document ends after its EOD, and every
  sample ends one) realised literally: transformers' `KimiLinearForCausalLM` runs each document alone,
  in its own batch row from position 0 (right padding is invisible to a causal model);
* loss: Megatron's `loss_func` (sum(loss * mask), sum(mask)) per micro-batch, the backward objective
  the mean of micro-batch token means (or the global token mean with `calculate_per_token_loss`), the
  reported `lm loss` token-weighted; MoE router z-loss and the auxiliary-loss-free expert-bias update as
  Ling3 defines them (transformers' router keeps `e_score_correction_bias` as a buffer we update);
* optimiser: torch AdamW, Megatron's warmup + cosine/linear decay, no decay on norms/biases/A_log/dt_bias,
  global-norm clipping with Megatron's `max_norm / (norm + 1e-6)`.
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


def megatron_train_dataset(data_cfg, num_samples: int, cache_dir: str | None = None):
    """megatron-core's GPTDataset for the train split of `data_cfg` (single prefix or blend)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    config = GPTDatasetConfig(
        random_seed=data_cfg.seed, sequence_length=data_cfg.seq_length,
        blend=get_blend_from_list(list(data_cfg.paths)), split=data_cfg.split, path_to_cache=cache_dir,
        tokenizer=_Tokenizer(data_cfg.eod_id, data_cfg.pad_id, data_cfg.vocab_size),
        reset_position_ids=data_cfg.reset_position_ids, reset_attention_mask=data_cfg.reset_attention_mask,
        eod_mask_loss=data_cfg.eod_mask_loss, create_attention_mask=False)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()
    return train


def documents(tokens: np.ndarray, eod_id: int, reset_attention_mask: bool) -> list[tuple[int, int]]:
    """[start, end) spans of the documents in one sample: each ends after its EOD and at the sample end."""
    if not reset_attention_mask:
        return [(0, len(tokens))]
    ends = [int(i) + 1 for i in np.nonzero(tokens == eod_id)[0] if i + 1 < len(tokens)] + [len(tokens)]
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


class MegatronReferenceTrainer:
    """Trains a transformers KimiLinearForCausalLM exactly as Megatron-LM would on packed samples."""

    def __init__(self, hf_model, data_cfg, optim_cfg, loss_cfg, *, micro_batches: int, num_samples: int,
                 moe_z_loss_weight: float = 0.0, expert_bias_rate: float = 0.0, cache_dir: str | None = None):
        import torch
        self.torch = torch
        self.model, self.data_cfg, self.optim_cfg, self.loss_cfg = hf_model, data_cfg, optim_cfg, loss_cfg
        self.micro_batches, self.moe_z_weight, self.bias_rate = micro_batches, moe_z_loss_weight, expert_bias_rate
        self.dataset = megatron_train_dataset(data_cfg, num_samples, cache_dir)
        from lingpack.train.optim import learning_rate
        self.schedule = learning_rate(optim_cfg)  # Megatron's schedule (checked against it in tests/train)
        decay, no_decay = [], []
        for name, param in hf_model.named_parameters():  # Megatron/Ling3: no decay on norms, biases, A_log, dt_bias
            plain = param.ndim < 2 or name.endswith(("bias", "A_log", "dt_bias"))
            (no_decay if plain else decay).append(param)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=optim_cfg.lr, betas=(optim_cfg.b1, optim_cfg.b2), eps=optim_cfg.eps)
        self.routers = [m for m in hf_model.modules() if type(m).__name__ == "KimiLinearTopkRouter"]
        self._captured: list = []
        for router in self.routers:
            router.register_forward_hook(lambda module, args, out: self._captured.append((module, out)))

    def _micro_batch(self, samples: list[dict]):
        """Per-token losses of one micro-batch with every document in its own row, starting at position 0.

        Rows are right-padded to the longest document; the model is causal, so padding after a document
        cannot change its logits, and padded positions are masked out of the loss and the router statistics.
        Returns (loss sum, loss count, router z-loss sum per router, real token count, loads per router).
        """
        torch = self.torch
        docs = [(s["tokens"][a:b], s["labels"][a:b], s["loss_mask"][a:b].float()) for s in samples
                for a, b in documents(s["tokens"].numpy(), self.data_cfg.eod_id, self.data_cfg.reset_attention_mask)]
        length = max(len(d[0]) for d in docs)
        pad = lambda x: torch.nn.functional.pad(x, (0, length - len(x)))
        tokens = torch.stack([pad(d[0]) for d in docs])
        labels = torch.stack([pad(d[1]) for d in docs])
        mask = torch.stack([pad(d[2]) for d in docs])                    # 0 on padding
        real = torch.stack([pad(torch.ones(len(d[0]))) for d in docs]).bool().reshape(-1)
        self._captured.clear()
        logits = self.model(input_ids=tokens).logits.float()             # fp32 logits
        xent = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 reduction="none").reshape(labels.shape)
        z_sum, loads = {}, {}
        for module, (router_logits, _, topk) in self._captured:
            z_sum[module] = torch.sum(torch.logsumexp(router_logits[real], dim=-1) ** 2)
            loads[module] = torch.bincount(topk[real].reshape(-1), minlength=module.num_experts)
        return torch.sum(xent * mask), torch.sum(mask), z_sum, int(real.sum()), loads

    def step(self, step: int) -> dict:
        """One optimizer step on global batch `step`; returns Megatron's reported metrics."""
        torch = self.torch
        G = self.data_cfg.global_batch_size
        rows = [self.dataset[i] for i in range(step * G, (step + 1) * G)]
        per_micro = G // self.micro_batches
        self.optimizer.zero_grad(set_to_none=True)
        results = [self._micro_batch(rows[m * per_micro:(m + 1) * per_micro]) for m in range(self.micro_batches)]
        total_count = sum(r[1] for r in results)
        objective = torch.zeros(())
        for loss_sum, count, z_sum, z_tokens, _ in results:
            if self.loss_cfg.mode == "per_token" or self.loss_cfg.calculate_per_token_loss:
                objective = objective + loss_sum / total_count
            else:  # Megatron default: each micro-batch's token mean, scaled by 1/num_micro_batches
                objective = objective + loss_sum / count / self.micro_batches
            if self.moe_z_weight:
                objective = objective + self.moe_z_weight * sum(z / z_tokens for z in z_sum.values()) / self.micro_batches
        objective.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.sqrt(sum(torch.sum(p.grad.double() ** 2) for p in params)))
        clip = self.optim_cfg.clip_grad_norm
        if clip and grad_norm > 0:
            coeff = clip / (grad_norm + 1e-6)
            if coeff < 1.0:
                for p in params:
                    p.grad.mul_(coeff)
        lr = float(self.schedule(step))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.bias_rate:
            with torch.no_grad():
                for router in self.routers:
                    load = sum(r[4][router] for r in results).float()
                    bias = router.e_score_correction_bias + self.bias_rate * torch.sign(load.mean() - load)
                    router.e_score_correction_bias.copy_(bias - bias.mean())
        lm_loss = float(sum(r[0].detach() for r in results) / total_count)
        return {"step": step, "lm_loss": lm_loss, "grad_norm": grad_norm, "lr": lr, "loss_tokens": float(total_count)}
