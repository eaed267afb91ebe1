"""Config field -> Megatron-LM argument: one rule for every field of the resolved run config.

A rule maps a field to `pretrain_gpt.py` flags (`maps`), says why the field does not change the loss
(`no_loss`), or is mapped together with another field's rule (`part_of`); `maps(..., unmapped=...)` adds
the note printed when this run's value is one Megatron-LM cannot reproduce. What the facts rest on
(NVIDIA/Megatron-LM, read at the commits megatron_arguments.txt records):
- data: `--data-path` takes the same blend syntax (`0.3 a 0.7 b`); pretrain_gpt.py seeds its GPTDataset
  indices from `--seed`; NullTokenizer takes the vocabulary, EOD and pad ids of pre-tokenized data
  (megatron/core/tokenizers/text/libraries/null_tokenizer.py); `--dataloader-inter-document-masking` gives
  the layers cu_seqlens at document ends (megatron/core/datasets/gpt_dataset.py).
- MoE routing (megatron/core/transformer/moe/moe_utils.py): sigmoid scores are renormalised over the top-k
  whenever top-k > 1; the expert bias moves by `rate * sign(mean load - load)` (lingpack re-centres it to
  mean 0 after, which shifts every expert's score equally and so routes the same).
- MLA's RoPE (megatron/core/models/common/embeddings/rope_utils.py) rotates the first rotary_percent of the
  rope dimensions as interleaved pairs, frequencies base^(-2i/rotary dim), as lingpack's rope_interleaved.
- RoPE (megatron/core/models/gpt/gpt_model.py) is computed from the sequence length, restarting per
  document only in packed (THD, cu_seqlens) mode: position ids alone do not move it.
- Initialisation (megatron/core/transformer/transformer_config.py): normal(0, init_method_std), output
  projections divided by sqrt(2 x num_layers).
- Linear attention: Megatron-LM's experimental attention variants are Gated DeltaNet (main: gdn, gdn2, dsa;
  dev: gated_delta_net, dsa, dsv4_hybrid), laid out by `--linear-attention-freq` N: layer i is softmax
  attention iff (i + 1) % N == 0 (megatron/core/models/gpt/experimental_attention_variant_module_specs.py),
  as lingpack's inhomogeneous_layer_cycle_interval; there is no KDA layer.
"""

from __future__ import annotations

import dataclasses
import os
import typing

from lingpack.kernels.kda import api as kda_api


@dataclasses.dataclass(frozen=True)
class Rule:
    flags: typing.Callable | None = None      # rc -> [(flag, value or None for a switch)]
    unmapped: typing.Callable | None = None   # rc -> why Megatron-LM does not reproduce this run's value, or None
    no_loss: str | None = None                # why the loss does not depend on the field
    part_of: str | None = None                # the field whose rule maps this one too

    def apply(self, rc) -> tuple[list, str | None]:
        return (list(self.flags(rc)) if self.flags else []), (self.unmapped(rc) if self.unmapped else None)


def maps(flags, unmapped=None) -> Rule:
    return Rule(flags=flags, unmapped=unmapped)


def unmapped(note) -> Rule:
    return Rule(unmapped=note)


def no_loss(why: str) -> Rule:
    return Rule(no_loss=why)


def part_of(field: str, unmapped=None) -> Rule:
    return Rule(part_of=field, unmapped=unmapped)


def has_kda(m) -> bool:
    """Some decoder layer is KDA: layer i is MLA iff (i + 1) % interval == 0."""
    return any((i + 1) % m.inhomogeneous_layer_cycle_interval for i in range(m.num_layers))


def has_moe(m) -> bool:
    return m.first_dense_layers < m.num_layers


def _when(condition: bool, *pairs) -> list:
    return list(pairs) if condition else []


def _data_flags(rc) -> list:
    d = rc.data
    if d.source != "megatron":
        return []
    here = os.getcwd() + os.sep   # a prefix under the working directory (the bundled corpus) is written relative
    return [("--data-path", [os.path.relpath(p) if p.startswith(here) else p for p in d.paths])]


def _batch_flags(rc) -> list:
    d, t, ranks = rc.data, rc.train, rc.loss.megatron_dp_size
    return [("--micro-batch-size", d.global_batch_size // t.micro_batches // ranks),
            ("--global-batch-size", d.global_batch_size)]


def _tokenizer_flags(rc) -> list:
    d = rc.data
    return [("--tokenizer-type", "NullTokenizer"), ("--vocab-size", d.vocab_size),
            ("--null-tokenizer-eod-id", d.eod_id), ("--null-tokenizer-pad-id", d.pad_id),
            ("--padded-vocab-size", rc.model.vocab_size)]


def _samples_note(rc) -> str | None:
    d, t = rc.data, rc.train
    if d.source == "megatron" and d.num_samples is not None and d.num_samples != t.steps * d.global_batch_size:
        return (f"data.num_samples={d.num_samples}: Megatron-LM builds its sample index for --train-iters x "
                f"--global-batch-size = {t.steps * d.global_batch_size} samples, so its samples differ")
    return None


def _positions_note(rc) -> str | None:
    d = rc.data
    if d.reset_position_ids == d.reset_attention_mask or rc.model.mla.rope_type == "none":
        return None
    return (f"data.reset_position_ids={d.reset_position_ids} with reset_attention_mask={d.reset_attention_mask}: "
            "Megatron-LM's RoPE restarts per document exactly when it packs documents (cu_seqlens); its GPT model "
            "takes rotary positions from the sequence length, not from position ids")


def _eval_flags(rc) -> list:
    t = rc.train
    if not t.eval_every:
        return [("--eval-iters", 0)]
    return [("--eval-interval", t.eval_every), ("--eval-iters", t.eval_batches)]


def _precision_flags(rc) -> list:
    return {"bfloat16": [("--bf16", None)], "float16": [("--fp16", None)]}.get(rc.model.dtype, [])


def _precision_note(rc) -> str | None:
    m, o = rc.model, rc.optim
    if m.dtype == "float64" or o.master_dtype == "float64":
        return "model.dtype=float64 (or optim.master_dtype): Megatron-LM trains in fp32, bf16 or fp16"
    if m.param_dtype != m.dtype and m.param_dtype != "float32":
        return f"model.param_dtype={m.param_dtype} with dtype={m.dtype}: Megatron-LM has no such mix"
    if o.master_dtype != "float32":
        return f"optim.master_dtype={o.master_dtype}: Megatron-LM keeps fp32 main parameters (as lingpack's default)"
    return None


def _kda_flags(rc) -> list:
    m = rc.model
    if not has_kda(m):
        return []
    k = m.kda
    return [("--experimental-attention-variant", "gated_delta_net"),
            ("--linear-attention-freq", m.inhomogeneous_layer_cycle_interval),
            ("--linear-num-key-heads", k.num_heads), ("--linear-num-value-heads", k.num_heads),
            ("--linear-key-head-dim", k.head_dim), ("--linear-value-head-dim", k.head_dim),
            ("--linear-conv-kernel-dim", k.conv_size)]


def _kda_note(rc) -> str | None:
    if not has_kda(rc.model):
        return None
    gate = "safe gate, lower bound %g" % rc.model.kda.lower_bound if rc.model.kda.lower_bound is not None \
        else "softplus gate"
    return ("model.kda: Megatron-LM has no KDA (Kimi Delta Attention) layer: the command's linear-attention "
            "layers are its "
            f"Gated DeltaNet (one decay per head; lingpack's KDA decays per channel, {gate}, "
            f"{rc.model.kda.gate_activation} output gate). Same layout and sizes, a different model: compare the "
            "two loss curves as two models, not for parity")


def _mla_flags(rc) -> list:
    a = rc.model.mla
    flags = [("--multi-latent-attention", None), ("--num-attention-heads", a.num_heads)]
    flags += _when(bool(a.q_lora_rank), ("--q-lora-rank", a.q_lora_rank))
    flags += [("--kv-lora-rank", a.kv_lora_rank), ("--qk-head-dim", a.qk_nope_head_dim),
              ("--qk-pos-emb-head-dim", a.qk_rope_head_dim), ("--v-head-dim", a.v_head_dim),
              ("--qk-layernorm", None)]   # Megatron-LM's MLA q/kv latent norms (lingpack always has them)
    if a.rope_type == "rope":
        flags += [("--position-embedding-type", "rope"), ("--rope-type", "rope"),
                  ("--rotary-base", int(a.rope_theta)), ("--rotary-percent", a.partial_rotary_factor)]
        flags.append(("--no-rope-fusion", None))   # Megatron-LM's fused MLA RoPE is YaRN only (its config refuses it)
        # Megatron-LM's MLA always rotates (x[2i], x[2i+1]) pairs (rope_utils.py de-interleaves, then rotates
        # halves: the same q.k); its config refuses --rotary-interleaved with MLA
    return flags


def _rope_note(rc) -> str | None:
    a = rc.model.mla
    if a.rope_type == "none":
        return "model.mla.rope_type=none (NoPE MLA): Megatron-LM's MLA always rotates its qk_pos_emb dimensions"
    if not a.rope_interleaved:
        return ("model.mla.rope_interleaved=false: Megatron-LM's MLA always rotates interleaved pairs "
                "(x[2i], x[2i+1]) and refuses --rotary-interleaved, its switch for the other layout")
    if a.rope_theta != int(a.rope_theta):
        return f"model.mla.rope_theta={a.rope_theta}: Megatron-LM's --rotary-base is an integer"
    return None


def _moe_flags(rc) -> list:
    m = rc.model
    if not has_moe(m):
        return []
    e = m.moe
    dense = m.first_dense_layers
    flags = [("--num-experts", e.num_experts), ("--moe-router-topk", e.top_k), ("--moe-ffn-hidden-size", e.expert_dim),
             ("--moe-layer-freq", f"([0]*{dense}+[1]*{m.num_layers - dense})"),
             ("--moe-router-score-function", "sigmoid"), ("--moe-router-dtype", "fp32"),
             ("--moe-router-load-balancing-type", "none"), ("--moe-aux-loss-coeff", 0.0)]
    flags += _when(e.num_shared_experts > 0,
                   ("--moe-shared-expert-intermediate-size", e.num_shared_experts * e.expert_dim))
    flags += _when(e.n_groups > 1, ("--moe-router-num-groups", e.n_groups), ("--moe-router-group-topk", e.topk_groups))
    flags += _when(e.routed_scaling_factor != 1.0, ("--moe-router-topk-scaling-factor", e.routed_scaling_factor))
    flags += _when(e.bias_update_rate > 0, ("--moe-router-enable-expert-bias", None),
                   ("--moe-router-bias-update-rate", e.bias_update_rate))
    flags += _when(e.z_loss_coef > 0, ("--moe-z-loss-coeff", e.z_loss_coef))
    return flags


def _topk_note(rc) -> str | None:
    e = rc.model.moe
    if has_moe(rc.model) and not e.norm_topk_prob and e.top_k > 1:
        return ("model.moe.norm_topk_prob=false: Megatron-LM renormalises sigmoid scores over the top-k "
                "whenever top-k > 1 "
                "(no argument turns it off), so its expert weights differ by that sum")
    return None


def _mtp_flags(rc) -> list:
    n = rc.model.mtp_num_layers
    return _when(n > 0, ("--mtp-num-layers", n), ("--mtp-loss-scaling-factor", rc.loss.mtp_loss_scale))


def _overflow_note(rc) -> str | None:
    if kda_api.needs_max_segs(rc.kernel.name):
        return (f"kernel={rc.kernel.name} leaves documents past kernel.max_segs={rc.kernel.max_segs} out of a step "
                "(summary.json's dropped_tokens): the loss is Megatron-LM's only when none were dropped")
    return None


_MESH = "the loss does not depend on lingpack's mesh; the Megatron-LM run picks its own parallelism"
_PERF = "how the same numbers are computed (speed and memory, fp32 rounding at most)"
_EVAL = "evaluation only: the training loss does not depend on it"
_RUNTIME = "the runtime (logging, checkpoints, launch), not the numbers"

# Architecture lingpack has no config key for: (flag, value, why).
FIXED = (
    ("--normalization", "RMSNorm", "every norm is an RMSNorm"),
    ("--swiglu", None, "dense and expert FFNs are SwiGLU"),
    ("--disable-bias-linear", None, "no linear layer has a bias"),
    ("--hidden-dropout", 0.0, "no dropout (Megatron-LM's default is 0.1)"),
    ("--attention-dropout", 0.0, "no dropout (Megatron-LM's default is 0.1)"),
    ("--init-method-std", 0.02, "every weight starts normal(0, 0.02) (models/layers.py DEFAULT_INIT)"),
    ("--optimizer", "adam", "AdamW: Megatron-LM's adam decouples weight decay"),
    ("--log-interval", 1, "every iteration's lm loss, as lingpack's metrics.jsonl, for tracking.compare"),
)

RULES: dict[str, Rule] = {
    # top level
    "name": no_loss("the run's name"),
    "seed": unmapped(lambda rc: f"seed={rc.seed} (lingpack's initialisation): Megatron-LM draws its weights "
                                "from --seed with "
                                "torch's generator and scales output projections by 1/sqrt(2 x num_layers); the two "
                                "runs start from different weights"),
    "run_dir": no_loss(_RUNTIME), "notes": no_loss("messages of the config check"),
    "model.init_from": unmapped(lambda rc: None if not rc.model.init_from else
                                f"model.init_from={rc.model.init_from}: the run starts from these transformers "
                                "weights; Megatron-LM starts from them only once they are converted to a Megatron "
                                "checkpoint passed as --pretrained-checkpoint (no converter ships here)"),
    # data
    "data.source": maps(_data_flags, lambda rc: None if rc.data.source == "megatron" else
                        f"data.source={rc.data.source}: Megatron-LM reads .bin/.idx datasets; write the same documents "
                        "with `python -m lingpack.data.preprocess` and train on data=megatron"),
    "data.paths": part_of("data.source"),
    "data.split": maps(lambda rc: [("--split", rc.data.split)]),
    "data.seq_length": maps(lambda rc: [("--seq-length", rc.data.seq_length),
                                        ("--max-position-embeddings", rc.data.seq_length)]),
    "data.global_batch_size": maps(_batch_flags),
    "data.seed": maps(lambda rc: [("--seed", rc.data.seed)]),
    "data.eod_id": maps(_tokenizer_flags), "data.pad_id": part_of("data.eod_id"),
    "data.vocab_size": part_of("data.eod_id"),
    "data.eod_mask_loss": maps(lambda rc: _when(rc.data.eod_mask_loss, ("--eod-mask-loss", None))),
    "data.reset_attention_mask": maps(lambda rc: _when(rc.data.reset_attention_mask, ("--reset-attention-mask", None),
                                                       ("--dataloader-inter-document-masking", None))),
    "data.reset_position_ids": maps(lambda rc: _when(rc.data.reset_position_ids, ("--reset-position-ids", None)),
                                    _positions_note),
    "data.cache_dir": maps(lambda rc: _when(rc.data.index_mode == "mmap_npy" and bool(rc.data.cache_dir),
                                            ("--data-cache-path", rc.data.cache_dir))),
    "data.index_mode": part_of("data.cache_dir"),
    "data.num_samples": unmapped(_samples_note),
    "data.num_epochs": unmapped(lambda rc: None if rc.data.num_epochs is None else
                                f"data.num_epochs={rc.data.num_epochs}: Megatron-LM sizes its index from --train-iters"),
    "data.eval_num_samples": unmapped(lambda rc: None if rc.data.eval_num_samples is None else
                                      f"data.eval_num_samples={rc.data.eval_num_samples}: Megatron-LM sizes validation "
                                      "from --eval-interval and --eval-iters"),
    **{f"data.synthetic_{k}": part_of("data.source") for k in
       ("num_documents", "length_distribution", "mean_length", "length_sigma", "min_length", "max_length")},
    "data.worker_count": no_loss(_PERF), "data.read_threads": no_loss(_PERF),
    "data.prefetch_buffer_size": no_loss(_PERF), "data.check_token_range": no_loss("a check of the data"),
    "data.packing": unmapped(lambda rc: None if rc.data.packing == "samples" else
                             f"data.packing={rc.data.packing}: Megatron-LM cuts samples from the document stream "
                             "(data.packing=samples); it has no whole-document packing"),
    "data.packing_open_rows": part_of("data.packing"),
    # loss
    "loss.mode": maps(lambda rc: _when(rc.loss.global_token_mean, ("--calculate-per-token-loss", None))),
    "loss.calculate_per_token_loss": part_of("loss.mode"),
    "loss.megatron_dp_size": part_of("data.global_batch_size"),   # and the launch line's rank count
    "loss.z_loss_weight": unmapped(lambda rc: None if not rc.loss.z_loss_weight else
                                   f"loss.z_loss_weight={rc.loss.z_loss_weight}: Megatron-LM has no output-logit "
                                   "z-loss (only --moe-z-loss-coeff on the router)"),
    "loss.mtp_loss_scale": part_of("model.mtp_num_layers"),
    # optimizer and schedule
    "optim.lr": maps(lambda rc: [("--lr", rc.optim.lr)]),
    "optim.min_lr": maps(lambda rc: [("--min-lr", rc.optim.min_lr)]),
    "optim.warmup_steps": maps(lambda rc: [("--lr-warmup-iters", rc.optim.warmup_steps)]),
    "optim.decay_steps": maps(lambda rc: [("--lr-decay-iters", rc.optim.decay_steps)]),
    "optim.schedule": maps(lambda rc: [("--lr-decay-style", rc.optim.schedule)]),
    "optim.weight_decay": maps(lambda rc: [("--weight-decay", rc.optim.weight_decay)]),
    "optim.b1": maps(lambda rc: [("--adam-beta1", rc.optim.b1)]),
    "optim.b2": maps(lambda rc: [("--adam-beta2", rc.optim.b2)]),
    "optim.eps": maps(lambda rc: [("--adam-eps", rc.optim.eps)]),
    "optim.clip_grad_norm": maps(lambda rc: [("--clip-grad", rc.optim.clip_grad_norm)]),
    "optim.master_dtype": part_of("model.dtype"),
    # training loop
    "train.steps": maps(lambda rc: [("--train-iters", rc.train.steps)]),
    "train.micro_batches": part_of("data.global_batch_size"),
    "train.seed": part_of("seed"),
    "train.eval_every": maps(_eval_flags), "train.eval_batches": part_of("train.eval_every"),
    "train.eval_test": no_loss(_EVAL),
    "train.log_every": no_loss("console lines; metrics.jsonl holds every step (the command logs every iteration)"),
    "train.nan_policy": no_loss("what happens after a non-finite loss"),
    "train.peak_flops_per_device": no_loss("the MFU estimate"), "train.progress_bar": no_loss(_RUNTIME),
    "train.handle_signals": no_loss(_RUNTIME), "train.profile_steps": no_loss(_RUNTIME),
    "train.profile_dir": no_loss(_RUNTIME), "train.overflow_policy": part_of("kernel.name"),
    # KDA kernel
    "kernel.name": unmapped(_overflow_note), "kernel.max_segs": part_of("kernel.name"),
    "kernel.chunk_size": no_loss(_PERF), "kernel.interpret": no_loss(_PERF), "kernel.short_conv": no_loss(_PERF),
    # model
    "model.vocab_size": part_of("data.eod_id"),
    "model.emb_dim": maps(lambda rc: [("--hidden-size", rc.model.emb_dim)]),
    "model.num_layers": maps(lambda rc: [("--num-layers", rc.model.num_layers)]),
    "model.inhomogeneous_layer_cycle_interval": part_of("model.kda.num_heads"),
    "model.first_dense_layers": part_of("model.moe.num_experts"),
    "model.mlp_dim": maps(lambda rc: [("--ffn-hidden-size", rc.model.mlp_dim)]),
    "model.norm_eps": maps(lambda rc: [("--norm-epsilon", rc.model.norm_eps)]),
    "model.dtype": maps(_precision_flags, _precision_note), "model.param_dtype": part_of("model.dtype"),
    "model.mtp_num_layers": maps(_mtp_flags),
    "model.tie_embeddings": maps(lambda rc: _when(not rc.model.tie_embeddings,
                                                  ("--untie-embeddings-and-output-weights", None))),
    **{f"model.{k}": no_loss(_PERF) for k in
       ("kda_impl", "kda_chunk_size", "kda_max_segs", "kda_interpret", "kda_short_conv", "attention_impl",
        "attention_block_size", "remat", "remat_policy", "remat_policy_kda", "remat_policy_mla", "remat_policy_moe",
        "scan_layers", "vocab_chunk_size", "fused_head_rows")},
    "model.kda.num_heads": maps(_kda_flags, _kda_note), "model.kda.head_dim": part_of("model.kda.num_heads"),
    "model.kda.conv_size": part_of("model.kda.num_heads"),
    "model.kda.lower_bound": part_of("model.kda.num_heads"),
    "model.kda.gate_activation": part_of("model.kda.num_heads"),
    "model.mla.num_heads": maps(_mla_flags, _rope_note),
    **{f"model.mla.{k}": part_of("model.mla.num_heads") for k in
       ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_type",
        "rope_theta", "partial_rotary_factor", "rope_interleaved")},
    "model.mla.latent_norm_eps": unmapped(lambda rc: None if rc.model.mla.latent_norm_eps == rc.model.norm_eps else
                                          f"model.mla.latent_norm_eps={rc.model.mla.latent_norm_eps} differs from "
                                          f"model.norm_eps={rc.model.norm_eps}: Megatron-LM has one --norm-epsilon"),
    "model.moe.num_experts": maps(_moe_flags),
    **{f"model.moe.{k}": part_of("model.moe.num_experts") for k in
       ("top_k", "expert_dim", "num_shared_experts", "n_groups", "topk_groups", "routed_scaling_factor",
        "bias_update_rate", "z_loss_coef")},
    "model.moe.norm_topk_prob": unmapped(_topk_note),
    "model.moe.grouped_matmul": no_loss(_PERF), "model.moe.expert_parallel": no_loss(_PERF),
    "model.moe.expert_parallel_chunks": no_loss(_PERF), "model.moe.expert_parallel_slices": no_loss(_PERF),
    "model.moe.expert_parallel_capacity": no_loss(_PERF), "model.moe.expert_parallel_exchange": no_loss(_PERF),
    "model.mtp.use_moe": unmapped(lambda rc: None if rc.model.mtp.use_moe or not rc.model.mtp_num_layers else
                                  "model.mtp.use_moe=false: Megatron-LM builds its MTP layer from the decoder's layer spec "
                                  "(MoE in an MoE model); no argument gives it a dense FFN"),
    # progressive context
    "schedule.stages": unmapped(lambda rc: None if not rc.schedule.enabled else
                                "schedule.stages (progressive context): Megatron-LM trains one --seq-length"),
    # groups the loss does not read
    **{f"parallel.{k}": no_loss(_MESH) for k in
       ("data", "fsdp", "tensor", "expert", "context", "logical_axis_rules", "context_strategy", "context_ulysses",
        "load_balance", "cpu_devices")},
    "checkpoint": no_loss(_RUNTIME), "logger": no_loss(_RUNTIME), "distributed": no_loss(_RUNTIME),
    "parity": no_loss("the loss-parity check beside the run"),
}
