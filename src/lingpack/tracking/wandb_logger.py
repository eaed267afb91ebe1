"""Weights & Biases logger: offline by default, process 0 only, loss curves against `tokens`.

Named `wandb_logger.py` (not `wandb.py`) so that `from lingpack.tracking import wandb` can never be
mistaken for the real package. Modes: "offline" (default; writes `<dir>/wandb/offline-run-*`, upload
later with `wandb sync <dir>/wandb/offline-run-*`), "online", "disabled" (does nothing, never imports
wandb). Multirun-safe: every logger owns its run (`reinit="create_new"`) and `finish()` closes it.
A resumed job continues its W&B run: `persistent_run_id(run_dir)` keeps the id in the run directory and
`WandbLogger(id=..., resume="allow")` reopens it (offline, each try writes an `offline-run-*` folder with
that id; `wandb sync` joins them into one run). `quiet=True` (the default) silences W&B's own console
banner, history and summary (its `silent` setting; its warnings then go to its debug log); `describe()`
is the one line to print instead: where the run is and how to upload it.

    logger = WandbLogger(project="lingpack", group="ling3_tiny-parity", job_type="train",
                         config=OmegaConf.to_container(cfg, resolve=True), dir=run_dir)
    logger.log(step, {"lm_loss": 2.3, "tokens": 8192})
    logger.summary({"final_lm_loss": 2.3}); logger.finish()
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Iterable, Mapping

MODES = ("offline", "online", "disabled")
RUN_ID_FILE = "wandb_run_id"


def persistent_run_id(run_dir: str | Path) -> str:
    """The W&B run id of `run_dir`: read from `run_dir/wandb_run_id`, or made and stored there on first use."""
    path = Path(run_dir) / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(4)  # 8 lowercase hex characters, like wandb's own ids
    path.write_text(run_id + "\n")
    return run_id


def _plain_config(config: Any) -> dict:
    """A resolved Hydra/OmegaConf config or any mapping -> a plain dict for `wandb.init(config=...)`."""
    if config is None:
        return {}
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(config, resolve=True)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (e.g. OmegaConf.to_container(cfg, resolve=True)), "
                        f"got {type(config).__name__}.")
    return dict(config)


class WandbLogger:
    """One W&B run. Inactive (all methods no-ops) when mode="disabled" or on processes other than 0."""

    def __init__(self, *, project: str = "lingpack", group: str | None = None, job_type: str = "train",
                 name: str | None = None, tags: Iterable[str] = (), dir: str | Path | None = None,
                 mode: str = "offline", config: Any = None, step_metric: str | None = "tokens",
                 entity: str | None = None, notes: str | None = None, capture_console: bool = False,
                 main_process: bool | None = None, id: str | None = None, resume: str | None = None,
                 quiet: bool = True):
        if mode not in MODES:
            raise ValueError(f"wandb mode {mode!r}: expected one of {MODES} (offline writes locally, "
                             f"sync later with `wandb sync`).")
        if main_process is None:
            from lingpack.tracking.metrics import is_main_process

            main_process = is_main_process()
        self.mode = mode
        self.step_metric = step_metric
        self.run = None
        self.local_dir: Path | None = None  # `.../wandb/offline-run-<time>-<id>`, kept after finish()
        self._defined: set = set()
        if mode == "disabled" or not main_process:
            return
        import wandb

        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project, entity=entity, group=group, job_type=job_type, name=name,
            tags=list(tags) or None, notes=notes, dir=str(dir) if dir is not None else None,
            mode=mode, config=_plain_config(config), id=id, resume=resume,
            reinit="create_new",  # one run per multirun job, never the previous job's run
            settings=wandb.Settings(console="auto" if capture_console else "off", silent=quiet),
        )
        self.local_dir = Path(self.run.dir).parent
        if step_metric:
            self.run.define_metric(step_metric)

    @property
    def active(self) -> bool:
        return self.run is not None

    def describe(self) -> str | None:
        """One console line: the offline run's folder and its upload command, or the online run's URL."""
        if self.run is None:
            return None
        if self.mode == "offline":
            return f"W&B offline run: {self.local_dir} (upload: wandb sync {self.local_dir})"
        return f"W&B run: {self.run.url}"

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log metrics at `step` (W&B's `_step`); each metric is plotted against `tokens` when logged."""
        if self.run is None:
            return
        data = {k: v for k, v in metrics.items()}
        data["step"] = step
        if self.step_metric and self.step_metric in data:
            for key in data:
                if key not in self._defined and key not in (self.step_metric, "step"):
                    self.run.define_metric(key, step_metric=self.step_metric)
                    self._defined.add(key)
        self.run.log(data, step=int(step))

    def summary(self, values: Mapping[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(dict(values))

    def finish(self, exit_code: int | None = None) -> None:
        """Close the run (call once per multirun job); safe to call twice."""
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None

    def __enter__(self) -> "WandbLogger":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.finish(exit_code=1 if exc_type is not None else None)
