"""Experiment tracking: metrics.jsonl + W&B (offline by default), Megatron baselines, parity, plots.

Light to import: W&B and matplotlib load only when `WandbLogger` or a plot function is first used.
"""

from lingpack.tracking.megatron_logs import (MegatronRun, ParseReport, load_baseline, parse_text_log,
                                             parse_wandb_export, series)
from lingpack.tracking.metrics import MetricsLogger, read_metrics, to_record, write_csv
from lingpack.tracking.parity import ParityResult, compute_parity
from lingpack.tracking.table import summary_table

_LAZY = {
    "WandbLogger": "lingpack.tracking.wandb_logger",
    "log_baseline_to_wandb": "lingpack.tracking.megatron_logs",
    "plot_loss_curves": "lingpack.tracking.plots",
    "plot_parity": "lingpack.tracking.plots",
    "plot_phantom_overhead": "lingpack.tracking.plots",
}

__all__ = ["MegatronRun", "MetricsLogger", "ParityResult", "ParseReport", "compute_parity",
           "load_baseline", "parse_text_log", "parse_wandb_export", "read_metrics", "series",
           "summary_table", "to_record", "write_csv", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lingpack.tracking' has no attribute {name!r}")
