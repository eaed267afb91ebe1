"""PNG plots with matplotlib's Agg backend (no display needed). Every function returns the written path."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # headless: CI, TPU VMs, SLURM nodes
import matplotlib.pyplot as plt  # noqa: E402

# Relative differences of exactly 0 cannot sit on a log axis; they are drawn at this floor.
REL_DIFF_FLOOR = 1e-12


def _save(fig, path: str | Path) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
    return str(path)


def _xy(records: Sequence[Mapping[str, Any]], x: str, y: str) -> tuple:
    points = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in points], [float(p[1]) for p in points]


def plot_loss_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, *,
                     x: str = "step", metric: str = "lm_loss", title: str | None = None,
                     logy: bool = False) -> str:
    """One line per run (`{label: records}`), `metric` against `x` ("step" or "tokens")."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = 0
    for label, records in runs.items():
        xs, ys = _xy(records, x, metric)
        if xs:
            ax.plot(xs, ys, label=f"{label} ({len(xs)} pts)", linewidth=1.2)
            drawn += 1
    if not drawn:
        plt.close(fig)
        raise ValueError(f"plot_loss_curves: no run has both {x!r} and {metric!r}; runs: {list(runs)}.")
    ax.set_xlabel(x)
    ax.set_ylabel(metric)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title or f"{metric} vs {x}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_parity(result: Any, path: str | Path, *, title: str | None = None,
                marks: Mapping[int, str] | None = None) -> str:
    """Two panels: both loss curves, and rel diff per step (log scale) with the tolerance line.

    `marks`: {step: label} drawn as vertical lines on both panels (e.g. the first routing flip)."""
    rows = result.rows
    if not rows:
        raise ValueError("plot_parity: no aligned steps to draw.")
    steps = [r.step for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    top.plot(steps, [r.megatron for r in rows], label="Megatron-LM", linewidth=1.5)
    top.plot(steps, [r.lingpack for r in rows], label="lingpack", linewidth=1.0, linestyle="--")
    top.set_ylabel(result.metric)
    top.grid(True, alpha=0.3)
    top.legend()
    rel = [r.rel_diff if math.isfinite(r.rel_diff) else math.nan for r in rows]
    shown = [max(v, REL_DIFF_FLOOR) if not math.isnan(v) else math.nan for v in rel]
    bottom.semilogy(steps, shown, marker=".", linewidth=0.8, label="|lingpack - megatron| / |megatron|")
    bottom.axhline(result.tolerance, color="red", linestyle=":", label=f"tolerance {result.tolerance:g}")
    failures = [r for r in rows if r.exceeds]
    if failures:
        bottom.semilogy([r.step for r in failures],
                        [r.rel_diff if math.isfinite(r.rel_diff) else result.tolerance * 10
                         for r in failures], "rx", label=f"{len(failures)} steps over tolerance")
    for step, label in (marks or {}).items():
        for axis in (top, bottom):
            axis.axvline(step, color="tab:purple", linestyle="--", linewidth=1.0, label=label if axis is bottom else None)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"relative difference\n(exact 0 drawn at {REL_DIFF_FLOOR:g})")
    bottom.grid(True, which="both", alpha=0.3)
    bottom.legend(fontsize=8)
    status = "PASS" if result.passed else "FAIL"
    top.set_title(title or f"{result.metric} parity: {status}, max rel {result.max_rel:.3g} "
                           f"over {len(rows)} steps")
    return _save(fig, path)


def plot_phantom_overhead(rows: Sequence[Mapping[str, Any]], path: str | Path, *, x: str = "max_segs",
                          y: str = "ratio", group: str | None = "design", kind: str = "line",
                          title: str | None = None) -> str:
    """Sweep table -> `y` (e.g. time ratio vs the unpacked peer) against `x`, one series per `group`.

    kind="line" draws lines with markers on a log2 x axis; kind="bar" draws grouped bars.
    A dashed line at 1.0 marks "no overhead".
    """
    if kind not in ("line", "bar"):
        raise ValueError(f"kind {kind!r}: expected 'line' or 'bar'.")
    missing = [k for k in (x, y) if not any(k in r for r in rows)]
    if missing or not rows:
        raise ValueError(f"plot_phantom_overhead: rows lack columns {missing or [x, y]}; "
                         f"columns seen: {sorted({k for r in rows for k in r})}.")
    series: dict = {}
    for row in rows:
        if row.get(x) is None or row.get(y) is None:
            continue
        label = str(row.get(group, "all")) if group else "all"
        series.setdefault(label, []).append((row[x], float(row[y])))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if kind == "line":
        for label, points in series.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        if all(isinstance(p[0], (int, float)) and p[0] > 0 for pts in series.values() for p in pts):
            ax.set_xscale("log", base=2)
    else:
        values = {p[0] for pts in series.values() for p in pts}
        numeric = all(isinstance(v, (int, float)) for v in values)
        xs = sorted(values) if numeric else sorted(values, key=str)
        width = 0.8 / max(len(series), 1)
        for i, (label, points) in enumerate(series.items()):
            lookup = dict(points)
            ax.bar([j + i * width for j in range(len(xs))], [lookup.get(v, math.nan) for v in xs],
                   width=width, label=label)
        ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(xs))])
        ax.set_xticklabels([str(v) for v in xs])
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title or f"phantom overhead: {y} vs {x}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)
