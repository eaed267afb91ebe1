"""Per-step loss parity between a Megatron-LM baseline and a lingpack run.

Steps are aligned by number (`lingpack step + step_offset == Megatron iteration`). Megatron's printed
loss is the mean over its log interval (the iterations in `(s - interval, s]`), so when lingpack has
every step of that window the lingpack side is averaged the same way ("interval" rows); otherwise the
lingpack value at step s is used as is ("point" rows). `interval` is the most common gap between
consecutive Megatron steps.

    abs_diff = |lingpack - megatron|,   rel_diff = abs_diff / |megatron|

A step fails when rel_diff > tolerance, or when either side is non-finite (a NaN loss is never parity).
Steps present on only one side are counted, never compared.
"""

from __future__ import annotations

import collections
import dataclasses
import math


@dataclasses.dataclass
class ParityRow:
    step: int
    megatron: float
    lingpack: float
    abs_diff: float
    rel_diff: float
    lingpack_n: int  # lingpack steps averaged (1 = pointwise)
    exceeds: bool


@dataclasses.dataclass
class ParityResult:
    metric: str
    tolerance: float
    interval: int
    rows: list
    only_megatron: list  # steps with a Megatron value and no lingpack value
    only_lingpack: list
    windows: list  # dicts: start, end, n, max_abs, mean_abs, max_rel, mean_rel

    @property
    def failures(self) -> list:
        return [r for r in self.rows if r.exceeds]

    @property
    def first_failure(self) -> ParityRow | None:
        return self.failures[0] if self.failures else None

    @property
    def passed(self) -> bool:
        return bool(self.rows) and not self.failures

    @property
    def max_rel(self) -> float:
        return max((r.rel_diff for r in self.rows), default=math.nan)

    @property
    def mean_rel(self) -> float:
        return sum(r.rel_diff for r in self.rows) / len(self.rows) if self.rows else math.nan

    @property
    def max_abs(self) -> float:
        return max((r.abs_diff for r in self.rows), default=math.nan)

    def summary(self) -> dict:
        first = self.first_failure
        return {
            "metric": self.metric, "tolerance": self.tolerance, "aligned_steps": len(self.rows),
            "failed_steps": len(self.failures), "first_failed_step": first.step if first else None,
            "max_abs_diff": self.max_abs, "max_rel_diff": self.max_rel, "mean_rel_diff": self.mean_rel,
            "megatron_log_interval": self.interval, "only_megatron_steps": len(self.only_megatron),
            "only_lingpack_steps": len(self.only_lingpack), "passed": self.passed,
        }


def log_interval(steps) -> int:
    """Most common positive gap between consecutive steps (Megatron's --log-interval); 1 if unknown."""
    steps = sorted(steps)
    gaps = collections.Counter(b - a for a, b in zip(steps, steps[1:]) if b > a)
    if not gaps:
        return 1
    # ties -> the smaller gap, so a short run never averages more than it should
    return min(gaps, key=lambda g: (-gaps[g], g))


def compute_parity(megatron: dict, lingpack: dict, *, tolerance: float = 1e-4, metric: str = "lm_loss",
                   step_offset: int = 0, window: int = 100, mode: str = "auto",
                   interval: int | None = None) -> ParityResult:
    """Compare `{step: value}` series. `mode`: "auto" (interval-average when possible) or "pointwise"."""
    if mode not in ("auto", "pointwise"):
        raise ValueError(f"mode {mode!r}: expected 'auto' or 'pointwise'.")
    if tolerance < 0 or not math.isfinite(tolerance):
        raise ValueError(f"tolerance {tolerance!r}: expected a finite value >= 0, e.g. 1e-4.")
    shifted = {int(s) + step_offset: float(v) for s, v in lingpack.items()}
    interval = interval or log_interval(megatron)
    first_lingpack = min(shifted, default=0)
    rows, only_megatron = [], []
    for step in sorted(megatron):
        if step not in shifted:
            only_megatron.append(step)
            continue
        value, n = shifted[step], 1
        if mode == "auto" and interval > 1:
            lo = max(step - interval + 1, first_lingpack)
            window_steps = range(lo, step + 1)
            if len(window_steps) > 1 and all(s in shifted for s in window_steps):
                value = sum(shifted[s] for s in window_steps) / len(window_steps)
                n = len(window_steps)
        reference = float(megatron[step])
        abs_diff = abs(value - reference)
        rel_diff = abs_diff / abs(reference) if reference != 0 else (0.0 if abs_diff == 0 else math.inf)
        finite = math.isfinite(value) and math.isfinite(reference)
        if not finite:
            abs_diff = rel_diff = math.inf
        rows.append(ParityRow(step, reference, value, abs_diff, rel_diff, n,
                              exceeds=(not finite) or rel_diff > tolerance))
    only_lingpack = sorted(s for s in shifted if s not in megatron)
    return ParityResult(metric, tolerance, interval, rows, only_megatron, only_lingpack,
                        _windows(rows, window))


def _windows(rows: list, window: int) -> list:
    """max/mean abs and rel diff over consecutive step windows [k*window + 1, (k+1)*window]."""
    if window <= 0:
        raise ValueError(f"window {window}: expected a positive number of steps.")
    groups: dict = {}
    for row in rows:
        groups.setdefault((row.step - 1) // window, []).append(row)
    out = []
    for key in sorted(groups):
        group = groups[key]
        out.append({
            "start": key * window + 1, "end": (key + 1) * window, "n": len(group),
            "max_abs": max(r.abs_diff for r in group),
            "mean_abs": sum(r.abs_diff for r in group) / len(group),
            "max_rel": max(r.rel_diff for r in group),
            "mean_rel": sum(r.rel_diff for r in group) / len(group),
        })
    return out


def write_parity_csv(result: ParityResult, path) -> str:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "megatron", "lingpack", "abs_diff", "rel_diff", "lingpack_n", "exceeds"])
        for r in result.rows:
            writer.writerow([r.step, repr(r.megatron), repr(r.lingpack), repr(r.abs_diff),
                             repr(r.rel_diff), r.lingpack_n, int(r.exceeds)])
    return str(path)
