"""Wires a resolved config into data -> model -> train -> tracking, and writes the run's summary.

`run.py` calls `run_from_hydra`; tests and scripts can call `run(plain_config_dict, run_dir)` directly.
Each job gets its own W&B run (offline by default, `finish()` per job, continued by a rerun that resumes
from a checkpoint), a `metrics.jsonl`/`metrics.csv` with one record per step of the whole run,
`summary.json`, a console summary and PNG plots in its run directory. Multiruns end with a sweep
table over all jobs (`SweepSummary`, a Hydra callback).

The console: the run directory and what runs (model, data, kernel, devices, anything the config check
found) at the start; one line per logged step; the summary grouped by topic, the run directory and where
the W&B run is at the end.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path

import jax

from lingpack import config as config_lib
from lingpack import devices, distributed, precision
from lingpack.kernels.kda import api as kda_api

log = logging.getLogger("lingpack")

SUMMARY_FORMATS = {"final_lm_loss": ".4f", "first_lm_loss": ".4f", "tokens_per_s": ".0f",
                   "segments_per_row": ".2f", "phantom_overhead": ".3f", "packing_parity_rel": ".1e",
                   "packing_parity_token_max_abs": ".1e",
                   "parity_max_rel": ".1e", "parity_mean_rel": ".1e", "val_lm_loss": ".4f",
                   "val_ppl": ".2f", "test_lm_loss": ".4f", "test_ppl": ".2f", "val_parity_max_rel": ".1e",
                   "dropped_token_fraction": ".1%"}


def _metrics_logger(rc: config_lib.RunConfig, plain: dict, group: str | None, writer: bool):
    from lingpack.tracking.metrics import MetricsLogger
    wandb = None
    if writer and rc.logger.kind == "wandb" and rc.logger.mode != "disabled":
        from lingpack.tracking.wandb_logger import WandbLogger, persistent_run_id
        wandb = WandbLogger(project=rc.logger.project, group=rc.logger.group or group or rc.name,
                            job_type=rc.logger.job_type, name=rc.name, tags=list(rc.logger.tags),
                            dir=rc.run_dir, mode=rc.logger.mode, config=plain,
                            id=persistent_run_id(rc.run_dir), resume="allow",  # a rerun continues the same run
                            quiet=rc.logger.quiet)
    return MetricsLogger(rc.run_dir, wandb=wandb, console_every=rc.logger.console_every, main_process=writer)


def uses_max_segs(rc: config_lib.RunConfig) -> bool:
    """The configured kernel packs documents into `kernel.max_segs` cu_seqlens slots (phantom segments)."""
    return kda_api.needs_max_segs(rc.kernel.name)


def overhead_key(rc: config_lib.RunConfig) -> str:
    """The phantom-overhead metric of the configured kernel design."""
    return "t_new_over_t" if uses_max_segs(rc) else "native_t_over_t"


def _announce(rc: config_lib.RunConfig, device_line: str | None = None) -> None:
    """What runs, said once at start: the run directory, the model, the data and the kernel (and a max_segs it
    ignores), the fake CPU devices asked for, and what the config check found (e.g. no test split)."""
    log.info("run directory: %s", os.path.abspath(rc.run_dir))
    kernel = f"kernel {rc.kernel.name} (chunk {rc.kernel.chunk_size}"
    kernel += f", max_segs {rc.kernel.max_segs})" if uses_max_segs(rc) else ", segment-native)"
    log.info("%s: model %d layers x %d wide, vocab %d | data %d x %d tokens per step | %s | %d steps",
             rc.name, rc.model.num_layers, rc.model.emb_dim, rc.model.vocab_size, rc.data.global_batch_size,
             rc.data.seq_length, kernel, rc.train.steps)
    if rc.kernel.max_segs is not None and not uses_max_segs(rc):
        log.warning("kernel=%s has no phantom segments: kernel.max_segs=%s is ignored (every value runs the same). "
                    "Sweep the phantom overhead with a cu_seqlens kernel: python run.py -m kernel=chunked_aligned "
                    "kernel.max_segs=8,16,32", rc.kernel.name, rc.kernel.max_segs)
    if device_line:
        (log.warning if "not applied" in device_line else log.info)(device_line)
    for note in rc.notes:
        log.warning(note)


def _quiet_libraries() -> None:
    """Orbax reports every save step on absl INFO; the loop prints one line per checkpoint instead."""
    logging.getLogger("absl").setLevel(logging.WARNING)


def _median(history: list[dict], key: str) -> float | None:
    values = [float(h[key]) for h in history if key in h]
    return statistics.median(values) if values else None  # median: compile steps (start, resume) do not skew it


def _mean(history: list[dict], key: str) -> float | None:
    values = [float(h[key]) for h in history if key in h]
    return sum(values) / len(values) if values else None


def run_summary(rc: config_lib.RunConfig, history: list[dict], preempted: bool) -> dict:
    """The run's figures from its per-step records (the whole run, every try of a resumed one)."""
    dropped = sum(int(h.get("dropped_tokens", 0)) for h in history)
    tokens = sum(int(h.get("tokens", 0)) for h in history)
    return {
        "name": rc.name, "kernel": rc.kernel.name, "max_segs": rc.kernel.max_segs if uses_max_segs(rc) else None,
        "status": "preempted" if preempted else "completed", "steps": len(history),
        "last_step": int(history[-1]["step"]) if history else 0,
        "final_lm_loss": float(history[-1]["lm_loss"]) if history else None,
        "first_lm_loss": float(history[0]["lm_loss"]) if history else None,
        "tokens_per_s": _median(history, "tokens_per_s"),
        "segments_per_row": _mean(history, "segments_per_row"),
        "phantom_overhead": _mean(history, overhead_key(rc)),
        "dropped_documents": sum(int(h.get("dropped_documents", 0)) for h in history),
        "dropped_tokens": dropped,
        "dropped_token_fraction": dropped / tokens if tokens else 0.0,  # > 0: the loss is over other tokens
        "overflow_steps": sum(1 for h in history if h.get("dropped_documents", 0)),
    }


def run(plain: dict, run_dir: str, *, group: str | None = None) -> dict:
    """Train one job from a plain config dict; returns its summary dict (also written to summary.json).

    A run stopped by a signal returns promptly after its checkpoint: no packing / loss parity checks and
    no plots (its rerun resumes, and then reports over the whole run). On multi-host runs every process
    calls this with the same config and run directory; all train and save their checkpoint shards,
    process 0 alone writes W&B, metrics, plots and the summary.
    """
    rc = config_lib.build(plain, run_dir)  # makes no JAX array
    device_line = devices.request_cpu_devices(rc.parallel.cpu_devices)  # before anything starts JAX's backends
    float64 = precision.wants_float64(rc.model.dtype, rc.model.param_dtype, rc.optim.master_dtype)
    # JAX's x64 mode decides the dtype of every array made after it is set, and float64 arrays exist only in it:
    # set from the config here, before this run makes its first array (data, model, state, the parity side),
    # and restored after, so that a multirun's next job or a caller's own arrays keep their setting.
    with precision.x64(float64):
        distributed.initialize(rc.distributed)
        device_line = devices.settled(device_line, rc.parallel.cpu_devices)
        devices.check_mesh(rc.parallel)
        if float64:  # after the backend starts (jax.distributed first): a one-line refusal where it cannot work
            precision.check_float64()
        distributed.check_same_everywhere("run directory", os.path.abspath(run_dir))
        writer = distributed.is_writer()  # the one place that decides who writes run records
        summary = _train_and_report(rc, plain, run_dir, group, writer, device_line)
        distributed.wait_for_writer()  # the others wait here while process 0 writes, not in JAX's exit barrier
    return summary


def _train_and_report(rc: config_lib.RunConfig, plain: dict, run_dir: str, group: str | None, writer: bool,
                      device_line: str | None = None) -> dict:
    """`run`'s body: train, then (process 0) the checks, records, plots and summary."""
    os.makedirs(run_dir, exist_ok=True)
    _quiet_libraries()
    if writer:
        _announce(rc, device_line)
    from lingpack.train import loop
    from lingpack.tracking.console import run_summary_text

    metrics_logger = _metrics_logger(rc, plain, group, writer)
    wandb_line = metrics_logger.wandb.describe() if metrics_logger.wandb is not None else None
    if wandb_line:
        log.info(wandb_line)
    try:
        recorder = None
        if rc.parity.enabled:  # the parity harness compares lingpack's routing with the reference's
            from lingpack.parity.harness import RoutingRecorder, has_moe
            recorder = RoutingRecorder(rc.data.seq_length) if has_moe(rc.model) else None
        args = (rc.model, rc.data, rc.loss, rc.optim, rc.parallel, rc.checkpoint, rc.train)
        kwargs = dict(metrics_callback=metrics_logger, on_start=metrics_logger.resume, routing_callback=recorder)
        if rc.schedule.enabled:  # progressive context: one loop.train per remaining stage
            from lingpack.train.schedule import train_with_schedule
            result = train_with_schedule(rc.schedule, *args, **kwargs)[-1]
        else:
            result = loop.train(*args, **kwargs)
        history = metrics_logger.records() or list(result.history)
        summary = run_summary(rc, history, result.preempted)
        # the dtypes the run actually trained in, read from its state (a float64 config without x64 would show)
        summary["master_dtypes"] = ",".join(sorted({str(x.dtype) for x in jax.tree.leaves(result.state.params)}))
        summary.update({k: v for k, v in result.final_eval.items() if not k.endswith("_tokens")})
        # the per-document check runs single-device rows of the full length (not under context parallelism)
        check_packing = not result.preempted and rc.parallel.context == 1
        model = result.final_model() if check_packing else None  # a collective on multi-host runs
        if not writer:
            return summary
        if check_packing:
            parity = _packing_parity(rc, model)
            summary["packing_parity_rel"] = parity["rel_diff"]
            summary["packing_parity_token_max_abs"] = parity["token_max_abs_diff"]  # the worst token, nats
        if not result.preempted and rc.parity.enabled:
            from lingpack.parity.harness import run_parity
            summary.update(run_parity(rc, history, metrics_logger, routing=recorder and recorder.steps,
                                      final_eval=result.final_eval))
        metrics_logger.summary({k: v for k, v in summary.items() if v is not None})
        metrics_logger.export_csv()
        if not result.preempted:
            _plots(rc, history)
        print(run_summary_text(summary, title=f"lingpack run summary: {rc.name}", formats=SUMMARY_FORMATS,
                               notes=_summary_notes(summary)), flush=True)
        log.info("run directory: %s", os.path.abspath(rc.run_dir))
        if wandb_line:
            log.info(wandb_line)
        return summary
    finally:
        metrics_logger.finish()


def _summary_notes(summary: dict) -> dict[str, str]:
    """What a reader of the summary must know next to the figures."""
    notes = {}
    if summary.get("dropped_tokens"):
        notes["overflow"] = ("loss over fewer tokens than the data holds: not comparable with a run that dropped "
                             "none (raise kernel.max_segs)")
    if "val_lm_loss" in summary:
        notes["validation"] = "end of training"
    if "test_lm_loss" in summary:
        notes["test"] = "end of training"
    return notes


def _packing_parity(rc: config_lib.RunConfig, model) -> dict:
    """Loss of the first real (global) batch packed vs every document alone, with the trained model
    (overflow dropped)."""
    from lingpack.data.pipeline import make_iterator
    from lingpack.parity.packing import packing_parity
    batch = next(make_iterator(rc.data, split="train", process_index=0, process_count=1))
    return packing_parity(model, batch, micro_batches=rc.train.micro_batches)


def _plots(rc: config_lib.RunConfig, history: list[dict]) -> None:
    from lingpack.tracking.plots import plot_loss_curves
    if history:  # validation points carry their loss as lm_loss so both curves share the axis
        valid = [{"step": h["step"], "lm_loss": h["val_lm_loss"]} for h in history if "val_lm_loss" in h]
        curves = {f"{rc.name} train": history, **({f"{rc.name} validation": valid} if valid else {})}
        plot_loss_curves(curves, Path(rc.run_dir) / "loss.png", metric="lm_loss",
                         title=f"{rc.name}: lm loss ({rc.kernel.name})")


def run_from_hydra(cfg) -> float:
    """The body of run.py's @hydra.main: resolve, run, return the final lm loss (for sweepers)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf
    hydra_cfg = HydraConfig.get()
    plain = OmegaConf.to_container(cfg, resolve=True)
    group = None
    if hydra_cfg.mode == RunMode.MULTIRUN:  # jobs of one sweep share a W&B group
        group = f"{plain.get('name', 'sweep')}-{Path(hydra_cfg.sweep.dir).name}"
        plain["name"] = f"{plain.get('name', 'run')}-{hydra_cfg.job.num}"
    summary = run(plain, hydra_cfg.runtime.output_dir, group=group)
    return summary["final_lm_loss"]


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # hydra is a dependency; this only keeps `import lingpack.experiment` light in odd setups
    _HydraCallback = object


def sweep_note(row: dict, rows: list[dict]) -> str:
    """The sweep table's note on one job: a loss over fewer tokens, or the segment-native baseline."""
    if row.get("dropped_tokens"):
        fraction = row.get("dropped_token_fraction")
        share = f"{fraction:.0%} of tokens" if fraction is not None else f"{row['dropped_tokens']} tokens"
        return f"loss not comparable ({share} dropped)"
    if row.get("max_segs") is None and any(r.get("max_segs") is not None for r in rows):
        return "baseline: segment-native, no phantom segments"
    return ""


class SweepSummary(_HydraCallback):
    """Hydra callback: after a multirun, one table over every job's summary.json (and a CSV beside it)."""

    def on_multirun_end(self, config, **kwargs) -> None:
        from lingpack.tracking.table import summary_table
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = []
        for path in sorted(sweep_dir.glob("*/summary.json")):
            row = json.loads(path.read_text())
            row["job"] = path.parent.name
            rows.append(row)
        if not rows:
            print(f"sweep summary: no job summaries under {sweep_dir}")
            return
        for row in rows:
            row["note"] = sweep_note(row, rows)
        columns = ["job", "kernel", "max_segs", "phantom_overhead", "dropped_documents", "dropped_tokens",
                   "tokens_per_s", "final_lm_loss", "val_lm_loss", "packing_parity_rel", "status", "note"]
        table = summary_table(rows, columns, title=f"sweep summary ({len(rows)} jobs): {sweep_dir}",
                              formats=SUMMARY_FORMATS)
        if any(row.get("dropped_tokens") for row in rows):
            table += ("\nnot comparable: those jobs left documents beyond kernel.max_segs out of their steps, so "
                      "their losses are over other (fewer) tokens than the rest")
        print(table)
        (sweep_dir / "sweep_summary.txt").write_text(table + "\n")
        from lingpack.tracking.metrics import write_csv
        write_csv(rows, sweep_dir / "sweep_summary.csv", columns=columns)
