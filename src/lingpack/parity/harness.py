"""The loss-parity experiment: lingpack's JAX run against the PyTorch reference with Megatron semantics.

Both sides start from the same weights (lingpack's initial Ling3, converted with `parity.convert`), read
the same samples (lingpack's Grain pipeline vs megatron-core's GPTDataset on the same files and seed) and
train the same number of steps; the per-step `lm_loss` and its relative difference are logged to W&B
(the reference as its own `job_type=megatron_reference` run in the same group), written to
`parity/parity.csv` and plotted to `parity/parity.png` in the run directory.

Validation: the reference evaluates megatron-core's valid split at lingpack's eval steps (every
`train.eval_every` steps, `train.eval_batches` global batches, evaluation k on valid batches
[k * eval_batches, (k + 1) * eval_batches), as Megatron's never-rewound valid iterator) and, after its last
step, the next valid batches and the test split when lingpack did; Megatron's token-weighted eval reduction.
The reference routes its evaluations itself, also under `parity.lock_routing` (lingpack's are not traced).
Its `val_lm_loss` / `test_lm_loss` are compared with lingpack's apart from training (`tracking.compare`'s
validation parity): `parity/validation_parity.csv` and the summary's `val_parity_*`.

Routing: given lingpack's routing trace (`RoutingRecorder`, fed by the training loop), the reference's
own choices are compared with it token by token (`parity/routing.py`): the first step and MoE layer where
the chosen experts differ, how close to a tie those tokens were, and the loss difference before and after,
go to the summary, `parity/routing.json` and the plot. `parity.lock_routing=true` makes the reference use
lingpack's selections (its own gate weights, bias update and z-loss unchanged), which isolates every
difference other than a routing flip.
"""

from __future__ import annotations

import time
from pathlib import Path


def reference_dtype(rc) -> str:
    """The reference's dtype: `parity.reference_dtype`, else float64 for a float64 model and float32 otherwise
    (bf16 compute is compared with the fp32 reference)."""
    chosen = getattr(rc.parity, "reference_dtype", None)
    return chosen or ("float64" if rc.model.dtype == "float64" else "float32")


def reference_model(model_cfg, jax_model, dtype: str = "float32"):
    """The PyTorch Ling3 (parity/reference_model.py: transformers' KimiLinear, FLA's gate, DeepseekV3Attention,
    MTP glue; float32 or float64, CPU) holding exactly `jax_model`'s weights."""
    from lingpack.parity import reference_model as reference_lib
    return reference_lib.build(model_cfg, jax_model, reference_lib.DTYPES[dtype])


def dtypes_used(jax_model, hf_model) -> dict:
    """The dtypes the two sides actually hold their parameters in (read from the arrays, not the config)."""
    import jax
    from flax import nnx
    ours = ",".join(sorted({str(x.dtype) for x in jax.tree.leaves(nnx.state(jax_model, nnx.Param))}))
    theirs = ",".join(sorted({str(p.dtype).removeprefix("torch.") for p in hf_model.parameters()}))
    return {"parity_lingpack_param_dtypes": ours, "parity_reference_param_dtypes": theirs,
            "parity_jax_x64": bool(jax.config.jax_enable_x64)}


def has_moe(model_cfg) -> bool:
    """Whether the model routes any token (only then is there a routing trace)."""
    kinds = [f for _, f in model_cfg.layer_kinds()]
    return "moe" in kinds or bool(model_cfg.mtp_num_layers and model_cfg.mtp.use_moe)


class RoutingRecorder:
    """`loop.train(routing_callback=recorder)`: keeps lingpack's routing per step (routing.py layout)."""

    def __init__(self, seq_length: int):
        self.seq_length, self.steps = seq_length, {}

    def __call__(self, step: int, routing: dict) -> None:
        from lingpack.parity.routing import from_lingpack
        self.steps[step] = from_lingpack(routing, self.seq_length)


def run_parity(rc, history: list[dict], metrics_logger=None, initial_model=None, routing: dict | None = None,
               final_eval: dict | None = None) -> dict:
    """Train the reference for len(history) steps and compare with lingpack's per-step lm_loss and its
    validation losses (history's `val_lm_loss`).

    `routing`: lingpack's `{step: trace}` (a RoutingRecorder's `steps`); required by `parity.lock_routing`.
    `final_eval`: lingpack's end-of-run evaluations (`TrainResult.final_eval`); the reference evaluates the same
    splits after its last step. The reference runs with `parity.reference_threads` torch threads (restored after).
    """
    import torch
    threads, previous = getattr(rc.parity, "reference_threads", None), torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run_parity(rc, history, metrics_logger, initial_model, routing, final_eval)
    finally:
        torch.set_num_threads(previous)


def _run_parity(rc, history, metrics_logger, initial_model, routing, final_eval) -> dict:
    import json

    import torch

    from lingpack.parity import routing as routing_lib
    from lingpack.parity.megatron_reference import MegatronReferenceTrainer
    from lingpack.tracking.parity import compute_parity, write_parity_csv
    from lingpack.tracking.plots import plot_loss_curves, plot_parity
    from lingpack.train import loop, loss as loss_lib, optim as optim_lib
    from lingpack.train.evaluate import eval_num_samples

    torch.manual_seed(0)
    steps = len(history)
    eval_every, eval_batches, final_eval = rc.train.eval_every, rc.train.eval_batches, final_eval or {}
    if final_eval and steps != rc.train.steps:
        raise ValueError(f"final_eval is lingpack's evaluation after train.steps={rc.train.steps}; the reference "
                         f"would evaluate after {steps} steps: pass the whole run's history")
    lock = getattr(rc.parity, "lock_routing", False)
    if lock and (routing is None or any(int(h.get("step", i + 1)) not in routing for i, h in enumerate(history))):
        raise ValueError("parity.lock_routing=true needs lingpack's routing for every step: train with "
                         "loop.train(..., routing_callback=RoutingRecorder(seq_length)) and pass its .steps")
    jax_model = initial_model if initial_model is not None else loop.make_model(rc.model, rc.train.seed)
    hf_model = reference_model(rc.model, jax_model, reference_dtype(rc))
    z_weight, bias_rate = loss_lib.moe_weights(rc.model.moe)
    num_samples = rc.data.num_samples or steps * rc.data.global_batch_size
    splits = ["valid"] + (["test"] if "test_lm_loss" in final_eval else [])  # test only where lingpack had one
    eval_samples = {s: eval_num_samples(rc.data, rc.train, s) for s in splits} if eval_every else None
    trainer = MegatronReferenceTrainer(
        hf_model, rc.data, optim_lib.resolve(rc.optim, rc.train.steps), rc.loss,
        micro_batches=rc.train.micro_batches, num_samples=num_samples, moe_z_loss_weight=z_weight,
        expert_bias_rate=bias_rate, cache_dir=rc.data.cache_dir, eval_samples=eval_samples)
    reference_wandb = _reference_wandb(rc)
    reference, reference_routing = [], {}
    start = time.perf_counter()
    for step in range(steps):
        number = int(history[step].get("step", step + 1))  # lingpack numbers steps from 1
        record, reference_routing[number] = trainer.step(step, routing[number] if lock else None)
        record["step"] = number
        ours = float(history[step]["lm_loss"])
        record.update(lingpack_lm_loss=ours, rel_diff=abs(ours - record["lm_loss"]) / abs(record["lm_loss"]),
                      tokens=history[step].get("tokens", (step + 1) * rc.data.global_batch_size * rc.data.seq_length))
        if eval_every and number % eval_every == 0:  # Megatron's eval_interval, as lingpack's loop
            record.update(trainer.evaluate("valid", number // eval_every - 1, eval_batches))
        reference.append(record)
        if reference_wandb is not None:
            reference_wandb.log(step, {k: v for k, v in record.items() if k != "step"})
    reference_final = {}  # Megatron's end-of-training evaluations: the next valid batches, the test split's first
    if "val_lm_loss" in final_eval:
        reference_final.update(trainer.evaluate("valid", rc.train.steps // eval_every, eval_batches))
    if "test_lm_loss" in final_eval:
        reference_final.update(trainer.evaluate("test", 0, eval_batches))
    seconds = time.perf_counter() - start
    result = compute_parity({r["step"]: r["lm_loss"] for r in reference},
                            {r["step"]: r["lingpack_lm_loss"] for r in reference},
                            tolerance=rc.parity.tolerance, mode="pointwise")
    out = Path(rc.run_dir) / "parity"
    out.mkdir(parents=True, exist_ok=True)
    write_parity_csv(result, out / "parity.csv")
    terms = _term_parity(history, reference, rc.parity.tolerance, out)
    validation = _validation_parity(history, reference, reference_final, final_eval, rc.parity.tolerance, out)
    trace = None
    if routing is not None and trainer.routers:
        trace = routing_lib.compare(routing, reference_routing, rc.model.moe)
        trace["loss_rel_diff"] = _around_flip(reference, trace["first_flip"])
        (out / "routing.json").write_text(json.dumps(trace, indent=1))
        print(routing_lib.summary_line(trace))
    flip = trace and trace["first_flip"]
    marks = {flip["step"]: f"first routing flip (MoE layer {flip['layer']})"} if flip else None
    plot_parity(result, out / "parity.png", marks=marks,
                title=f"lm loss parity vs Megatron-semantics reference ({rc.name}{', routing locked' if lock else ''})")
    plot_loss_curves({"lingpack (JAX)": history, "Megatron-semantics reference (PyTorch)": reference},
                     out / "loss_curves.png", metric="lm_loss", title="lm loss: lingpack vs reference")
    summary = {"parity_max_rel": result.max_rel, "parity_mean_rel": result.mean_rel,
               "parity_passed": bool(result.passed), "parity_tolerance": rc.parity.tolerance,
               "parity_steps": steps, "reference_seconds": seconds, "parity_lock_routing": bool(lock),
               "parity_reference_dtype": reference_dtype(rc), "parity_lingpack_compute_dtype": rc.model.dtype,
               **dtypes_used(jax_model, hf_model)}
    summary.update(terms)
    summary.update(validation)
    if trace is not None:
        summary.update(routing_first_flip_step=flip["step"] if flip else None,
                       routing_first_flip_layer=flip["layer"] if flip else None,
                       routing_first_flip_margin=flip["lingpack_margin_max"] if flip else None,
                       routing_total_flips=trace["total_flips"], expert_bias_parity_max_rel=trace["bias_max_rel_diff"],
                       expert_bias_parity_passed=trace["bias_max_rel_diff"] <= rc.parity.tolerance)
    if reference_wandb is not None:
        reference_wandb.summary(summary)
        reference_wandb.finish()
    if metrics_logger is not None:
        metrics_logger.summary({k: v for k, v in summary.items() if v is not None})
    print(result.summary())
    return summary


TERMS = ("lm_loss", "mtp_loss", "moe_z_loss")   # the per-step loss terms both sides report (parity/terms.csv)


def _term_parity(history: list[dict], reference: list[dict], tolerance: float, out: Path) -> dict:
    """Per step, each loss term of both sides and its relative difference -> `parity/terms.csv`; summary keys
    `<term>_parity_max_rel` for the MTP and router z-loss terms (lm_loss is the main comparison's)."""
    from lingpack.tracking.metrics import write_csv
    rows, summary = [], {}
    for h, r in zip(history, reference):
        row = {"step": r["step"]}
        for term in TERMS:
            if term in h and term in r:
                ours, theirs = float(h[term]), float(r[term])
                row.update({f"{term}_lingpack": ours, f"{term}_reference": theirs,
                            f"{term}_rel_diff": abs(ours - theirs) / abs(theirs) if theirs else abs(ours - theirs)})
        rows.append(row)
    for term in TERMS[1:]:
        diffs = [row[f"{term}_rel_diff"] for row in rows if f"{term}_rel_diff" in row]
        if diffs:
            summary[f"{term.removesuffix('_loss')}_parity_max_rel"] = max(diffs)
            summary[f"{term.removesuffix('_loss')}_parity_passed"] = max(diffs) <= tolerance
    write_csv(rows, out / "terms.csv")
    return summary


def _validation_parity(history: list[dict], reference: list[dict], reference_final: dict, final_eval: dict,
                       tolerance: float, out: Path) -> dict:
    """The reference's evaluations against lingpack's (tracking.compare's validation parity) -> summary keys.

    Every reference evaluation must meet a lingpack one: one without a partner fails the comparison."""
    from lingpack.tracking.compare import compare_validation, report_validation
    theirs = [{"step": r["step"], "val_lm_loss": r["val_lm_loss"]} for r in reference if "val_lm_loss" in r]
    if "val_lm_loss" in reference_final:
        theirs.append({"step": reference[-1]["step"], "val_lm_loss": reference_final["val_lm_loss"], "final": True})
    theirs_test = [reference_final] if "test_lm_loss" in reference_final else []
    if not theirs and not theirs_test:
        return {}
    ours = {int(h["step"]): float(h["val_lm_loss"]) for h in history if "val_lm_loss" in h}
    result = compare_validation(theirs, theirs_test, ours, final_eval, tolerance)
    report_validation(result, out)
    unmatched = len(theirs) + len(theirs_test) - len(result.rows)
    if unmatched:
        print(f"VALIDATION PARITY FAILED: {unmatched} reference evaluations have no lingpack value (its eval steps "
              f"{sorted(ours)}, end-of-run {sorted(k for k in final_eval if k.endswith('_lm_loss'))})")
    summary = {"val_parity_max_rel": result.max_rel, "val_parity_passed": bool(result.passed and not unmatched),
               "val_parity_evaluations": len(result.rows)}
    summary.update({f"reference_{k}": v for k, v in reference_final.items() if k.endswith("_loss")})
    return summary


def _around_flip(reference: list[dict], flip: dict | None) -> dict | None:
    """Relative lm-loss difference up to the step before the first flip, at it, and the worst after it."""
    if flip is None:
        return None
    before = [r["rel_diff"] for r in reference if r["step"] < flip["step"]]
    at = [r["rel_diff"] for r in reference if r["step"] == flip["step"]]
    after = [r["rel_diff"] for r in reference if r["step"] > flip["step"]]
    return {"max_before": max(before, default=None), "at": at[0] if at else None,
            "max_after": max(after, default=None)}


def _reference_wandb(rc):
    if rc.logger.kind != "wandb" or rc.logger.mode == "disabled":
        return None
    from lingpack.tracking.wandb_logger import WandbLogger
    return WandbLogger(project=rc.logger.project, group=rc.logger.group or rc.name, job_type="megatron_reference",
                       name=f"{rc.name}-megatron-reference", dir=rc.run_dir, mode=rc.logger.mode,
                       step_metric="tokens")
