"""The loss-parity experiment: lingpack's JAX run against the PyTorch reference with Megatron semantics.

Both sides start from the same weights (lingpack's initial Ling3, converted with `parity.convert`), read
the same samples (lingpack's Grain pipeline vs megatron-core's GPTDataset on the same files and seed) and
train the same number of steps; the per-step `lm_loss` and its relative difference are logged to W&B
(the reference as its own `job_type=megatron_reference` run in the same group), written to
`parity/parity.csv` and plotted to `parity/parity.png` in the run directory.
"""

from __future__ import annotations

import time
from pathlib import Path


def reference_model(model_cfg, jax_model):
    """transformers' KimiLinearForCausalLM (fp32, CPU) holding exactly `jax_model`'s weights."""
    import torch
    from transformers import KimiLinearForCausalLM

    from lingpack.parity.convert import kimi_config_from_ling3, to_hf_state_dict
    if model_cfg.mtp_num_layers:
        raise ValueError("transformers' KimiLinear has no MTP head: set model.mtp_num_layers=0 for loss parity")
    hf_model = KimiLinearForCausalLM(kimi_config_from_ling3(model_cfg)).float()
    state = {k: torch.from_numpy(v.copy()) for k, v in to_hf_state_dict(jax_model).items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("e_score_correction_bias")]  # buffers start at 0 on both sides
    if missing or unexpected:
        raise ValueError(f"weight conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return hf_model.train()


def run_parity(rc, history: list[dict], metrics_logger=None, initial_model=None) -> dict:
    """Train the reference for len(history) steps and compare with lingpack's per-step lm_loss."""
    import torch

    from lingpack.parity.megatron_reference import MegatronReferenceTrainer
    from lingpack.tracking.parity import compute_parity, write_parity_csv
    from lingpack.tracking.plots import plot_loss_curves, plot_parity
    from lingpack.train import loop, loss as loss_lib, optim as optim_lib

    torch.manual_seed(0)
    steps = len(history)
    jax_model = initial_model if initial_model is not None else loop.make_model(rc.model, rc.train.seed)
    hf_model = reference_model(rc.model, jax_model)
    z_weight, bias_rate = loss_lib.resolve_moe_weights(rc.loss, rc.model.moe)
    num_samples = rc.data.num_samples or steps * rc.data.global_batch_size
    trainer = MegatronReferenceTrainer(
        hf_model, rc.data, optim_lib.resolve(rc.optim, rc.train.steps), rc.loss,
        micro_batches=rc.train.micro_batches, num_samples=num_samples, moe_z_loss_weight=z_weight,
        expert_bias_rate=bias_rate, cache_dir=rc.data.cache_dir)
    reference_wandb = _reference_wandb(rc)
    reference = []
    start = time.perf_counter()
    for step in range(steps):
        record = trainer.step(step)
        record["step"] = int(history[step].get("step", step + 1))  # lingpack numbers steps from 1
        ours = float(history[step]["lm_loss"])
        record.update(lingpack_lm_loss=ours, rel_diff=abs(ours - record["lm_loss"]) / abs(record["lm_loss"]),
                      tokens=history[step].get("tokens", (step + 1) * rc.data.global_batch_size * rc.data.seq_length))
        reference.append(record)
        if reference_wandb is not None:
            reference_wandb.log(step, {k: v for k, v in record.items() if k != "step"})
    seconds = time.perf_counter() - start
    result = compute_parity({r["step"]: r["lm_loss"] for r in reference},
                            {r["step"]: r["lingpack_lm_loss"] for r in reference},
                            tolerance=rc.parity.tolerance, mode="pointwise")
    out = Path(rc.run_dir) / "parity"
    out.mkdir(parents=True, exist_ok=True)
    write_parity_csv(result, out / "parity.csv")
    plot_parity(result, out / "parity.png", title=f"lm loss parity vs Megatron-semantics reference ({rc.name})")
    plot_loss_curves({"lingpack (JAX)": history, "Megatron-semantics reference (PyTorch)": reference},
                     out / "loss_curves.png", metric="lm_loss", title="lm loss: lingpack vs reference")
    summary = {"parity_max_rel": result.max_rel, "parity_mean_rel": result.mean_rel,
               "parity_passed": bool(result.passed), "parity_tolerance": rc.parity.tolerance,
               "parity_steps": steps, "reference_seconds": seconds}
    if reference_wandb is not None:
        reference_wandb.summary(summary)
        reference_wandb.finish()
    if metrics_logger is not None:
        metrics_logger.summary(summary)
    print(result.summary())
    return summary


def _reference_wandb(rc):
    if rc.logger.kind != "wandb" or rc.logger.mode == "disabled":
        return None
    from lingpack.tracking.wandb_logger import WandbLogger
    return WandbLogger(project=rc.logger.project, group=rc.logger.group or rc.name, job_type="megatron_reference",
                       name=f"{rc.name}-megatron-reference", dir=rc.run_dir, mode=rc.logger.mode,
                       step_metric="tokens")
