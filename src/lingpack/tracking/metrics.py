"""Plain metrics files beside every run, and the fan-out logger the training loop calls.

`metrics.jsonl` in the run directory holds one JSON object per `log` call: `{"step": 10, "lm_loss": ..}`.
Values are converted from numpy / JAX scalars to Python int / float; NaN and inf are written as the
JSON extensions `NaN` / `Infinity` (Python's json reads them back), because a NaN loss is information.
The file is appended to and flushed per line, so a crashed run keeps everything it logged; a resumed run
first drops the records past its restored step (`resume`), so the file holds one record per step of
the whole run however often it was interrupted.

    logger = MetricsLogger(run_dir, wandb=WandbLogger(...), console_every=10)
    train(..., metrics_callback=logger, on_start=logger.resume)   # logger(step, metrics)
    history = logger.records()                   # the whole run, across resumes
    logger.finish()
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any, Mapping

METRICS_FILE = "metrics.jsonl"


def is_main_process() -> bool:
    """True on JAX process 0 (and when JAX is not initialised for multi-host)."""
    import jax

    return jax.process_index() == 0


def to_scalar(key: str, value: Any) -> int | float:
    """numpy / JAX scalar or 0-d / size-1 array -> Python int or float; anything else is an error."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)  # also turns np.float64 (a float subclass) into a plain float
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        import numpy as np

        array = np.asarray(value)  # pulls a JAX array to host
        if array.size != 1:
            raise TypeError(f"metric {key!r} has shape {array.shape}; log scalars (reduce it first, "
                            f"e.g. float(x.mean())).")
        item = array.reshape(()).item()
        return int(item) if isinstance(item, (bool, int)) else float(item)
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric {key!r} = {value!r} ({type(value).__name__}) is not a number.") from err


def to_record(step: int, metrics: Mapping[str, Any]) -> dict:
    """`{"step": step, **metrics}` with plain Python numbers."""
    record = {"step": int(to_scalar("step", step))}
    for key, value in metrics.items():
        if key == "step":
            continue
        record[str(key)] = to_scalar(key, value)
    return record


class JsonlWriter:
    """Appends one JSON object per line to `path` and flushes each line."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        self._handle.write(json.dumps(record, allow_nan=True) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.close()


def metrics_path(run_dir: str | Path) -> Path:
    """`run_dir/metrics.jsonl`, or `run_dir` itself when it is a file."""
    run_dir = Path(run_dir)
    return run_dir if run_dir.is_file() else run_dir / METRICS_FILE


def read_metrics(run_dir: str | Path) -> list:
    """Records of `run_dir/metrics.jsonl` (or of a .jsonl file) in file order.

    A truncated last line (a run killed mid-write) is skipped with a warning on stderr; any other
    unreadable line is an error naming the file and line.
    """
    path = metrics_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file. Pass the run directory that holds "
                                f"{METRICS_FILE} (written by MetricsLogger), or the file itself.")
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if line_no == len(lines):
                print(f"warning: {path}:{line_no}: skipped a truncated last line ({err})", file=sys.stderr)
                continue
            raise ValueError(f"{path}:{line_no}: not a JSON object ({err}); fix or delete that line.") from err
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{line_no}: expected an object with a 'step' key, got {line[:80]!r}.")
        records.append(record)
    return records


def write_csv(records: list, path: str | Path, columns: list | None = None) -> str:
    """Write records as CSV: `step` first, then the union of keys in first-seen order."""
    if columns is None:
        columns = list(dict.fromkeys(["step"] + [k for r in records for k in r]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="raise")
        writer.writeheader()
        for record in records:
            writer.writerow({k: record.get(k, "") for k in columns})
    return str(path)


def format_value(value: Any) -> str:
    """Compact console form: ints as is, floats with 4 significant decimals or scientific."""
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def truncate_metrics(run_dir: str | Path, step: int) -> int:
    """Keep only the records with `step <= step` in run_dir/metrics.jsonl (atomically); returns how many went."""
    path = metrics_path(run_dir)
    if not path.is_file():
        return 0
    records = read_metrics(path)
    kept = [r for r in records if r["step"] <= step]
    if len(kept) != len(records) or path.read_text(encoding="utf-8").count("\n") != len(records):
        temporary = path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in kept), encoding="utf-8")
        temporary.replace(path)
    return len(records) - len(kept)


class MetricsLogger:
    """Fan-out of one `(step, metrics)` call to metrics.jsonl, W&B and the console (process 0 only).

    `wandb` is a `WandbLogger` (or anything with log/summary/finish) or None. `console_every=0`
    silences the console. Bind it as the training loop's `metrics_callback`, and `resume` as its `on_start`.
    """

    def __init__(self, run_dir: str | Path, *, wandb: Any = None, console_every: int = 1,
                 stream: Any = None, main_process: bool | None = None):
        self.run_dir = Path(run_dir)
        self.active = is_main_process() if main_process is None else main_process
        self.wandb = wandb
        self.console_every = console_every
        self.stream = stream
        self.jsonl = JsonlWriter(self.run_dir / METRICS_FILE) if self.active else None
        self.last: dict = {}

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.log(step, metrics)

    def resume(self, step: int) -> None:
        """Training continues after `step` (0: from scratch): drop the records logged past it by an earlier try."""
        if not self.active:
            return
        self.jsonl.close()
        dropped = truncate_metrics(self.run_dir, step)
        if dropped:
            print(f"metrics: dropped {dropped} records past step {step} (logged before the restart)",
                  file=self.stream or sys.stdout, flush=True)
        self.jsonl = JsonlWriter(self.run_dir / METRICS_FILE)

    def records(self) -> list:
        """Every record of this run directory's metrics.jsonl (all tries of a resumed run); [] off process 0."""
        if not self.active or not metrics_path(self.run_dir).is_file():
            return []
        return read_metrics(self.run_dir)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict:
        record = to_record(step, metrics)
        if not self.active:
            return record
        self.jsonl.write(record)
        if self.wandb is not None:
            self.wandb.log(record["step"], {k: v for k, v in record.items() if k != "step"})
        if self.console_every and record["step"] % self.console_every == 0:
            text = " | ".join(f"{k} {format_value(v)}" for k, v in record.items())
            print(text, file=self.stream or sys.stdout, flush=True)
        self.last = record
        return record

    def summary(self, values: Mapping[str, Any]) -> None:
        """Final numbers (written to run_dir/summary.json and the W&B run summary)."""
        if not self.active:
            return
        values = {k: to_scalar(k, v) if not isinstance(v, str) else v for k, v in values.items()}
        path = self.run_dir / "summary.json"
        existing = json.loads(path.read_text()) if path.is_file() else {}
        existing.update(values)
        path.write_text(json.dumps(existing, indent=2, allow_nan=True) + "\n")
        if self.wandb is not None:
            self.wandb.summary(values)

    def export_csv(self, path: str | Path | None = None) -> str:
        """metrics.jsonl -> metrics.csv (or `path`)."""
        return write_csv(read_metrics(self.run_dir), path or self.run_dir / "metrics.csv")

    def finish(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None and self.active:
            self.wandb.finish()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()
