"""Import a Megatron-LM run as the parity baseline: text logs and W&B history exports.

Megatron-LM's `training_log` (megatron/training.py, later megatron/training/training.py) prints one
line per log interval on the last rank, `' key: value |'` fields after `iteration N/ M |`:

    2019-2020   iteration 10/ 1000 | elapsed time per iteration (ms): .. | learning rate: 3.000E-04 |
                lm loss: 1.023400E+01 | loss scale: 1.0 | number of skipped iterations: 0 | nan ..
    2020-2023   + consumed samples, global batch size, grad norm, num zeros, params norm
    2024        + throughput per GPU (TFLOP/s/GPU); a ` [YYYY-MM-DD HH:MM:SS]` prefix
    2025-       learning rate with 6 digits, skipped samples, energy/power, `mtp_1 loss`,
                MoE `load_balancing_loss` (`.6E`, later `.2f`), timestamps with microseconds

Launchers add their own prefixes (`[default0]:` from torchrun --tee, `0: ` from srun -l,
`[1,0]<stdout>:` from mpirun), so the parser searches for the iteration field anywhere in a line.
Every field is read generically; known keys map onto lingpack's metric names (`KEY_MAP`), others are
snake_cased. Loss values are averages over the log interval's advanced (not skipped) iterations.

Megatron only prints a loss whose interval average is >= 0 (a NaN average is never printed) and, on an
interval whose iterations were all skipped, prints `lm loss: 0.000000E+00` (the reset accumulator) or
nothing. Both cases become "no loss at this step" and are counted in `ParseReport.skipped_loss_steps`.

W&B exports (Megatron's wandb_writer logs `lm loss`, `learning-rate`, `grad-norm`, ... at step =
iteration) are read from CSV or JSON (records, JSON lines, pandas `split`/`columns` orientations).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

# Megatron text-log field names and W&B keys -> lingpack metric names.
KEY_MAP = {
    "consumed samples": "consumed_samples",
    "consumed tokens": "tokens",  # Megatron-DeepSpeed prints this one
    "skipped samples": "skipped_samples",
    "elapsed time per iteration (ms)": "iter_time_ms",
    "throughput per gpu (tflop/s/gpu)": "tflops_per_gpu",
    "energy per gpu (j/iter/gpu)": "energy_per_gpu_j",
    "power per gpu (w/gpu)": "power_per_gpu_w",
    "learning rate": "lr",
    "decoupled learning rate": "decoupled_lr",
    "global batch size": "global_batch_size",
    "lm loss": "lm_loss",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "num zeros": "num_zeros",
    "params norm": "params_norm",
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
    # W&B / TensorBoard names used by Megatron's writers
    "learning-rate": "lr",
    "grad-norm": "grad_norm",
    "loss-scale": "loss_scale",
    "batch-size": "global_batch_size",
    "samples vs steps": "consumed_samples",
    "num-zeros": "num_zeros",
    "params-norm": "params_norm",
    "iteration-time": "iter_time_s",  # seconds in W&B, milliseconds in the text log
    "throughput": "tflops_per_gpu",
    "lm loss validation": "val_lm_loss",
}
STEP_KEYS = ("iteration", "step", "_step", "Step", "trainer/global_step")
MTP_KEY = re.compile(r"^mtp_(\d+)[ _]loss$")

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_VALIDATION = re.compile(r"\bvalidation(?:-\S+)? loss at iteration\s+(\d+)\b[^|]*\|")
_FIELD = re.compile(r"^\s*([^:|]+?)\s*:\s*(\S+)\s*$")


@dataclasses.dataclass
class ParseReport:
    """What the parser saw, so nothing is dropped silently. Line numbers are 1-based."""

    source: str
    lines: int = 0
    iteration_lines: int = 0
    validation_lines: int = 0
    other_validation_lines: list = dataclasses.field(default_factory=list)  # e.g. end-of-training eval
    malformed: list = dataclasses.field(default_factory=list)  # (line_no, reason)
    duplicate_steps: list = dataclasses.field(default_factory=list)  # steps seen twice; last kept
    skipped_loss_steps: list = dataclasses.field(default_factory=list)  # steps with no usable loss
    ignored_columns: list = dataclasses.field(default_factory=list)  # W&B export columns not used

    def describe(self) -> str:
        parts = [f"{self.source}: {self.iteration_lines} iteration records from {self.lines} lines"]
        if self.validation_lines:
            parts.append(f"{self.validation_lines} validation lines")
        if self.other_validation_lines:
            parts.append(f"{len(self.other_validation_lines)} validation lines without an iteration "
                         f"(not imported): lines {self.other_validation_lines[:5]}")
        if self.malformed:
            first = ", ".join(f"line {n} ({why})" for n, why in self.malformed[:3])
            parts.append(f"{len(self.malformed)} malformed iteration lines skipped: {first}")
        if self.duplicate_steps:
            parts.append(f"{len(self.duplicate_steps)} repeated steps (restart?) kept the last: "
                         f"{self.duplicate_steps[:5]}")
        if self.skipped_loss_steps:
            parts.append(f"{len(self.skipped_loss_steps)} steps without a usable lm loss "
                         f"(skipped/NaN intervals): {self.skipped_loss_steps[:5]}")
        if self.ignored_columns:
            parts.append(f"ignored columns: {self.ignored_columns}")
        return "; ".join(parts)


@dataclasses.dataclass
class MegatronRun:
    """Per-step records (dicts with `step` plus lingpack metric names), sorted by step."""

    records: list
    validation: list          # {"step", "val_lm_loss", ...}; the end-of-run evaluation has "final": True
    report: ParseReport
    train_iters: int | None = None
    test: list = dataclasses.field(default_factory=list)  # end-of-run test evaluation {"step", "test_lm_loss"}


def normalize_key(key: str) -> str:
    """Megatron / W&B metric name -> lingpack name (`lm loss` -> `lm_loss`, `mtp_1 loss` -> `mtp_1_loss`)."""
    key = key.strip()
    lowered = key.lower()
    if lowered in KEY_MAP:
        return KEY_MAP[lowered]
    match = MTP_KEY.match(lowered)
    if match:
        return f"mtp_{match.group(1)}_loss"
    return re.sub(r"[^0-9a-z]+", "_", lowered).strip("_")


def parse_number(text: str) -> float | int:
    """`1.023400E+01` -> float, `640` -> int, `nan`/`inf` -> float. Raises ValueError otherwise."""
    text = text.strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    return float(text)  # accepts nan, inf, -inf, 1.0E-04


def _finish_record(record: dict, seq_length: int | None, report: ParseReport) -> dict:
    """Add derived metrics: `tokens`, `mtp_loss`; drop the artefact loss of all-skipped intervals."""
    if "tokens" not in record and seq_length and "consumed_samples" in record:
        record["tokens"] = int(record["consumed_samples"]) * int(seq_length)
    depths = sorted(k for k in record if re.fullmatch(r"mtp_\d+_loss", k))
    if depths and "mtp_loss" not in record:
        # Unscaled mean over depths (Megatron prints each depth's raw token-mean cross entropy).
        record["mtp_loss"] = sum(float(record[k]) for k in depths) / len(depths)
    loss = record.get("lm_loss")
    skipped = record.get("skipped_iterations", 0) or 0
    if loss is not None and skipped > 0 and loss == 0.0:
        # Megatron prints the reset accumulator (0.0) when every iteration in the interval was skipped.
        del record["lm_loss"]
    if record.get("lm_loss") is None:
        report.skipped_loss_steps.append(record["step"])
    return record


def _dedupe(records: list, report: ParseReport) -> list:
    """Keep the last record per step (a restarted run re-logs steps); record the repeats."""
    by_step: dict = {}
    for record in records:
        if record["step"] in by_step:
            report.duplicate_steps.append(record["step"])
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def parse_text_log(path: str | Path, seq_length: int | None = None) -> MegatronRun:
    """Parse a Megatron-LM stdout log. `seq_length` turns consumed samples into `tokens`."""
    path = Path(path)
    report = ParseReport(source=str(path))
    records, validation, test, train_iters = [], [], [], None
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line_no, line in enumerate(handle, start=1):
            report.lines += 1
            match = _ITERATION.search(line)
            if match is None:
                val = _VALIDATION.search(line)
                if val is not None:
                    report.validation_lines += 1
                    # "... at iteration N on test set |" is the end-of-run test evaluation, "on validation
                    # set" the end-of-run validation; a bare "at iteration N |" is the periodic one.
                    where = val.group(0)
                    prefix = "test_" if " on test set" in where else "val_"
                    record = {"step": int(val.group(1))}
                    if " on validation set" in where:
                        record["final"] = True
                    for key, value in _fields(line[val.end():], line_no, report):
                        record[prefix + normalize_key(key.replace(" value", ""))] = value
                    (test if prefix == "test_" else validation).append(record)
                elif re.search(r"\bvalidation\S* loss at\b", line):
                    report.other_validation_lines.append(line_no)
                continue
            record = {"step": int(match.group(1))}
            train_iters = int(match.group(2))
            fields = list(_fields(line[match.end():], line_no, report))  # bad fields are reported
            if not fields:
                report.malformed.append((line_no, "no `key: value |` fields after the iteration"))
                continue
            for key, value in fields:
                record[normalize_key(key)] = value
            report.iteration_lines += 1
            records.append(_finish_record(record, seq_length, report))
    if not records:
        raise ValueError(
            f"{path}: no Megatron iteration lines found in {report.lines} lines. Expected lines like "
            f"'iteration       10/    1000 | ... | lm loss: 1.023400E+01 |' (Megatron-LM stdout with "
            f"--log-interval). Pass the training stdout log, or a W&B history export (.csv/.json).")
    return MegatronRun(_dedupe(records, report), validation, report, train_iters, test)


def _fields(text: str, line_no: int, report: ParseReport):
    """Yield (key, number) for each `key: value |` field; unparseable fields are reported, not fatal."""
    for chunk in text.split("|"):
        if not chunk.strip():
            continue
        match = _FIELD.match(chunk)
        if match is None:
            report.malformed.append((line_no, f"unreadable field {chunk.strip()[:40]!r}"))
            continue
        try:
            value = parse_number(match.group(2))
        except ValueError:
            report.malformed.append((line_no, f"non-numeric {match.group(1)!r}={match.group(2)!r}"))
            continue
        yield match.group(1), value


# ----------------------------------------------------------------------------- W&B history exports


def _column_name(column: str) -> str | None:
    """Strip W&B UI export decorations: `run-name - lm loss` -> `lm loss`; `__MIN`/`__MAX` -> None."""
    if column.endswith("__MIN") or column.endswith("__MAX"):
        return None
    if " - " in column:
        column = column.rsplit(" - ", 1)[1]
    if "/" in column and column not in STEP_KEYS:
        column = column.rsplit("/", 1)[1]  # `lm-loss-training/lm loss` (TensorBoard sections)
    return column


def _rows_from_json(text: str, path: Path) -> list:
    stripped = text.lstrip()
    if not stripped:
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # JSON lines (one history row per line, e.g. a scan_history dump)
        rows = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_no}: not JSON nor JSON lines ({err}). Export the W&B "
                                     f"history as CSV, a JSON list of rows, or JSON lines.") from err
        return rows
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        if "columns" in data and "data" in data:  # pandas orient="split"
            return [dict(zip(data["columns"], row)) for row in data["data"]]
        for key in ("history", "rows", "data"):
            if isinstance(data.get(key), list):
                return data[key]
        columns = {k: v for k, v in data.items() if isinstance(v, (list, dict))}
        if columns:  # column-oriented: {col: [v...]} or pandas orient="columns" {col: {idx: v}}
            as_lists = {k: (list(v.values()) if isinstance(v, dict) else v) for k, v in columns.items()}
            n = max(len(v) for v in as_lists.values())
            return [{k: (v[i] if i < len(v) else None) for k, v in as_lists.items()} for i in range(n)]
    raise ValueError(f"{path}: unrecognised JSON layout (top-level {type(data).__name__}). Expected a list "
                     f"of history rows, JSON lines, or a column dict.")


def parse_wandb_export(path: str | Path, seq_length: int | None = None) -> MegatronRun:
    """Parse a W&B history export (CSV or JSON) of a Megatron-LM (or lingpack) run."""
    path = Path(path)
    report = ParseReport(source=str(path))
    text = path.read_text(encoding="utf-8", errors="replace")
    if _sniff(path, text) == "csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        rows = _rows_from_json(text, path)
    report.lines = len(rows)
    if not rows:
        raise ValueError(f"{path}: the W&B export has no rows. Export the run's history (all steps).")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    step_key = next((k for k in STEP_KEYS if k in columns), None)
    if step_key is None:
        raise ValueError(f"{path}: no step column; expected one of {STEP_KEYS}, got {columns[:12]}. "
                         f"Export the history with its `_step` column.")
    mapping, ignored = {}, []
    for column in columns:
        name = _column_name(column)
        if (column in STEP_KEYS or not name or name.startswith("_")
                or (" vs " in name and name.lower() not in KEY_MAP)):  # `lm loss vs samples`: other x axis
            ignored.append(column)
        else:
            mapping[column] = normalize_key(name)
    ignored = [c for c in ignored if c != step_key]
    report.ignored_columns = ignored
    records = []
    for row_no, row in enumerate(rows, start=2 if path.suffix.lower() == ".csv" else 1):
        raw_step = row.get(step_key)
        try:
            step = int(float(raw_step))
        except (TypeError, ValueError):
            report.malformed.append((row_no, f"step {step_key}={raw_step!r}"))
            continue
        record = {"step": step}
        for column, name in mapping.items():
            value = row.get(column)
            if value is None or (isinstance(value, str) and value.strip() in ("", "null", "None")):
                continue
            try:
                record[name] = value if isinstance(value, (int, float)) else parse_number(str(value))
            except ValueError:
                report.malformed.append((row_no, f"non-numeric {column!r}={value!r}"))
        records.append(record)
    records = _merge_rows(records)
    report.iteration_lines = len(records)
    if not records:
        raise ValueError(f"{path}: no usable rows ({len(report.malformed)} malformed).")
    records = [_finish_record(r, seq_length, report) for r in records]
    return MegatronRun(records, [], report)


def _merge_rows(records: list) -> list:
    """W&B may split one step over several rows (one per `log` call): merge them, later values win."""
    merged: dict = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(record)
    return [merged[s] for s in sorted(merged)]


def _sniff(path: Path, text: str) -> str:
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        return "json"
    if suffix == ".csv":
        return "csv"
    if _ITERATION.search(text[:200_000]):
        return "text"
    head = text.lstrip()[:1]
    if head in ("{", "["):
        return "json"
    first = text.splitlines()[0] if text else ""
    if "," in first and any(k in first for k in STEP_KEYS):
        return "csv"
    return "text"


def load_baseline(path: str | Path, seq_length: int | None = None, fmt: str = "auto") -> MegatronRun:
    """Load a Megatron run from a text log or a W&B export; `fmt` in auto|text|csv|json."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such Megatron log or W&B export.")
    if fmt == "auto":
        with open(path, encoding="utf-8", errors="replace") as handle:
            fmt = _sniff(path, handle.read(200_000))
    if fmt == "text":
        return parse_text_log(path, seq_length)
    if fmt in ("csv", "json"):
        return parse_wandb_export(path, seq_length)
    raise ValueError(f"format {fmt!r}: expected one of auto, text, csv, json.")


def series(records: list, metric: str = "lm_loss") -> dict:
    """{step: float} for records that have `metric` (NaN kept as NaN)."""
    out = {}
    for record in records:
        value = record.get(metric)
        if value is not None:
            out[int(record["step"])] = float(value)
    return out


def log_baseline_to_wandb(run: MegatronRun, *, group: str | None, project: str = "lingpack",
                          name: str | None = None, mode: str = "offline", dir: str | None = None,
                          config: dict | None = None) -> Any:
    """Log the Megatron records as a `job_type="baseline"` W&B run with lingpack's metric names."""
    from lingpack.tracking.wandb_logger import WandbLogger  # lazy: wandb import is slow

    logger = WandbLogger(project=project, group=group, job_type="baseline", name=name or "megatron",
                         mode=mode, dir=dir, tags=["megatron", "baseline"],
                         config={"source": run.report.source, **(config or {})})
    for record in run.records:
        logger.log(record["step"], {k: v for k, v in record.items() if k != "step"})
    final = [r["lm_loss"] for r in run.records if r.get("lm_loss") is not None]
    if final and math.isfinite(final[-1]):
        logger.summary({"final_lm_loss": final[-1]})
    logger.finish()
    return logger
