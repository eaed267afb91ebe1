"""The run summary as a terminal shows it: one labelled row per group of figures, wrapped to the width.

    lingpack run summary: ling3_tiny_packed
      run         completed | steps 60 | kernel chunked | max_segs -
      lm loss     first 5.9585 | final 2.8594
      ...

Every key of the summary appears once: the groups below take theirs, the rest go to `other`.
"""

from __future__ import annotations

import shutil
import textwrap
from typing import Any, Mapping

from lingpack.tracking.metrics import format_value

# (row label, [(summary key, label in the row)]), in print order.
GROUPS = (
    ("run", [("status", ""), ("steps", "steps"), ("last_step", "last step"), ("kernel", "kernel"),
             ("max_segs", "max_segs")]),
    ("lm loss", [("first_lm_loss", "first"), ("final_lm_loss", "final")]),
    ("speed", [("tokens_per_s", "tokens/s (median step)")]),
    ("packing", [("segments_per_row", "documents/row"), ("phantom_overhead", "phantom overhead"),
                 ("packing_parity_rel", "packed vs per-document (rel)"),
                 ("packing_parity_token_max_abs", "worst token (nats)")]),
    ("overflow", [("dropped_documents", "dropped documents"), ("dropped_tokens", "dropped tokens"),
                  ("dropped_token_fraction", "of all tokens"), ("overflow_steps", "steps")]),
    ("validation", [("val_lm_loss", "lm loss"), ("val_ppl", "ppl"), ("val_mtp_loss", "mtp loss"),
                    ("val_moe_z_loss", "moe z-loss"), ("val_dropped_documents", "dropped documents"),
                    ("val_dropped_tokens", "dropped tokens")]),
    ("test", [("test_lm_loss", "lm loss"), ("test_ppl", "ppl"), ("test_mtp_loss", "mtp loss"),
              ("test_moe_z_loss", "moe z-loss"), ("test_dropped_documents", "dropped documents"),
              ("test_dropped_tokens", "dropped tokens")]),
)
PREFIX_GROUPS = (("parity", ("parity_", "val_parity_", "test_parity_", "reference_", "routing_")),)
HIDDEN = {"name"}  # in the title


def _cell(key: str, label: str, value: Any, formats: Mapping[str, str]) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        text = str(value)
    elif key in formats:
        text = format(value, formats[key])
    else:
        text = format_value(value)
    return f"{label} {text}" if label else text


def _wrap(label: str, cells: list[str], width: int, indent: int) -> list[str]:
    room = max(20, width - indent)
    pieces = [piece for cell in cells for piece in (textwrap.wrap(cell, room) if len(cell) > room else [cell])]
    lines, current = [], ""
    for cell in pieces:
        joined = f"{current} | {cell}" if current else cell
        if current and indent + len(joined) > width:
            lines.append(current)
            current = cell
        else:
            current = joined
    lines.append(current)
    pad = " " * indent
    return [f"  {label:<{indent - 2}}{lines[0]}", *(pad + line for line in lines[1:])]


def run_summary_text(summary: Mapping[str, Any], *, title: str, formats: Mapping[str, str] | None = None,
                     notes: Mapping[str, str] | None = None, width: int | None = None) -> str:
    """`summary` grouped into labelled rows under `title`; `notes[group]` is appended to that group's row."""
    formats, notes = dict(formats or {}), dict(notes or {})
    width = width or min(shutil.get_terminal_size((100, 24)).columns, 120)
    indent = 2 + max(len(label) for label, _ in GROUPS) + 2
    used, rows = set(HIDDEN), []
    for label, keys in GROUPS:
        present = [(k, name) for k, name in keys if k in summary]
        used |= {k for k, _ in present}
        cells = [_cell(k, name, summary[k], formats) for k, name in present]
        if label == "run" and summary.get("max_segs") is None and "max_segs" in summary:
            cells = [c for c in cells if not c.startswith("max_segs")]  # a kernel without cu_seqlens slots
        if label == "overflow" and present and not any(summary[k] for k, _ in present):
            cells = ["none: every document fit"]
        if cells or label in notes:
            rows.append((label, ([notes[label]] if label in notes else []) + cells))
    for label, prefixes in PREFIX_GROUPS:
        keys = [k for k in summary if k.startswith(prefixes) and k not in used]
        used |= set(keys)
        if keys:
            rows.append((label, [_cell(k, k, summary[k], formats) for k in keys]))
    rest = [k for k in summary if k not in used]
    if rest:
        rows.append(("other", [_cell(k, k, summary[k], formats) for k in rest]))
    lines = [title]
    for label, cells in rows:
        lines += _wrap(label, cells, width, indent)
    return "\n".join(lines)
