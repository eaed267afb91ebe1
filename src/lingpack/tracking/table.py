"""`summary_table(rows, columns)`: a neat fixed-width console table (run and sweep summaries)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from lingpack.tracking.metrics import format_value


def summary_table(rows: Sequence[Mapping[str, Any] | Sequence[Any]], columns: Sequence[str] | None = None,
                  *, title: str | None = None, formats: Mapping[str, str] | None = None) -> str:
    """Render rows (dicts, or sequences in `columns` order) as an aligned text table.

    Numbers are right-aligned and formatted with `formats[column]` (a format spec such as ".6f")
    or `format_value`; missing cells print as `-`.
    `columns=None` takes the union of dict keys in first-seen order.
    """
    rows = list(rows)
    if columns is None:
        if rows and not all(isinstance(r, Mapping) for r in rows):
            raise ValueError("summary_table: pass `columns` when rows are sequences, not dicts.")
        columns = list(dict.fromkeys(k for r in rows for k in r))
    columns = list(columns)
    formats = dict(formats or {})
    cells, numeric = [], [True] * len(columns)
    for row in rows:
        if isinstance(row, Mapping):
            values = [row.get(c) for c in columns]
        else:
            values = list(row)
            if len(values) != len(columns):
                raise ValueError(f"summary_table: row {values!r} has {len(values)} cells for "
                                 f"{len(columns)} columns {columns}.")
        line = []
        for i, value in enumerate(values):
            if value is None:
                line.append("-")
                continue
            if not isinstance(value, (int, float)):
                numeric[i] = False
                line.append(str(value))
            elif columns[i] in formats:
                line.append(format(value, formats[columns[i]]))
            else:
                line.append(format_value(value))
        cells.append(line)
    widths = [max([len(str(c))] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def render(line: list, header: bool = False) -> str:
        parts = []
        for i, text in enumerate(line):
            right = numeric[i] and not header
            parts.append(text.rjust(widths[i]) if right else text.ljust(widths[i]))
        return "  ".join(parts).rstrip()

    out = []
    if title:
        out.append(title)
    out.append(render([str(c) for c in columns], header=True))
    out.append("  ".join("-" * w for w in widths))
    out.extend(render(line) for line in cells)
    if not rows:
        out.append("(no rows)")
    return "\n".join(out)
