"""Plain-text rendering of a ``Report``: an aligned table plus the findings that matter."""

from __future__ import annotations

import math
from typing import Any

from .columns import Column, resolve_columns

__all__ = ["format_report", "format_value"]



def format_value(v: Any, column: Column | None = None) -> str:
    """``v`` as the table writes it: by ``column.format`` when declared, else a compact number."""
    if column is not None:
        text = column.format_value(v)
        if text is not None:
            return text
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.2e}"
        return f"{v:.4g}"
    if isinstance(v, (tuple, list)) and all(isinstance(d, int) for d in v):
        return "(" + ", ".join(str(d) for d in v) + ")"
    return str(v)


def _columns(report: Any) -> list[Column]:
    """Declared, shown columns that some row fills (in declaration order), then undeclared keys
    alphabetically (a probe that declares nothing still gets its numbers shown)."""
    rows = report.rows
    present: set[str] = set()
    for r in rows:
        present.update(k for k, v in r.items() if v is not None and not isinstance(v, (dict, list)) or k == "shape")
    declared = list(getattr(report, "columns", None) or resolve_columns(()))
    keys = {c.key for c in declared}
    cols = [c for c in declared if c.key in present and c.shown]
    cols += [Column(k) for k in sorted(present - keys)]
    return cols


def format_report(report: Any, max_rows: int = 400, *, use_rich: bool | None = None) -> str:
    """The report as aligned text: rich's box table when rich is installed (``use_rich=None``),
    else plain columns. Either way, plain text with no colour codes, ready for logs."""
    if use_rich is not False:
        try:
            import rich  # noqa: F401
        except ImportError:
            if use_rich:
                raise ImportError("format_report(use_rich=True) needs rich: pip install 'fxdebug[report]'.") from None
        else:
            return _format_rich(report, max_rows)
    return _format_plain(report, max_rows)


def _header(report: Any) -> list[str]:
    lines = [f"fxdebug report — {len(report.rows)} observed nodes, {report.calls} call(s), frontend: {report.frontend}"]
    if report.first_nonfinite:
        lines.append(f"NaN/Inf origin (forward): {_where(report, report.first_nonfinite)}")
    if report.first_nonfinite_grad:
        via = getattr(report, "nonfinite_grad_from", None)
        lines.append(f"NaN/Inf origin (backward): gradient into {_where(report, report.first_nonfinite_grad)}"
                     + (f", from the backward of {', '.join(via)}" if via else ""))
    for path, why in report.auto_leaves.items():
        lines.append(f"auto-leaf: {why}")
    for note in report.notes:
        lines.append(f"note: {note}")
    return lines


def _format_rich(report: Any, max_rows: int) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    rows = report.rows
    lines = _header(report)
    if not rows:
        return "\n".join(lines + ["(no observed nodes)"])
    cols = _columns(report)
    table = Table(*(c.key for c in cols), box=None, pad_edge=False, show_edge=False)
    for r in rows[:max_rows]:
        table.add_row(*(format_value(r.get(c.key), c) for c in cols))
    buf = io.StringIO()
    Console(file=buf, width=max(120, 14 * len(cols)), color_system=None, force_terminal=False).print(table)
    text = "\n".join(line.rstrip() for line in buf.getvalue().splitlines())
    more = [f"... {len(rows) - max_rows} more rows (Report.rows has them all)"] if len(rows) > max_rows else []
    return "\n".join(lines + [text] + more)


def _format_plain(report: Any, max_rows: int) -> str:
    rows = report.rows
    lines = _header(report)
    if not rows:
        return "\n".join(lines + ["(no observed nodes)"])
    cols = _columns(report)
    shown = rows[:max_rows]
    cells = [[format_value(r.get(c.key), c) for c in cols] for r in shown]
    widths = [max(len(c.key), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.key.ljust(w) for c, w in zip(cols, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    if len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more rows (Report.rows has them all)")
    return "\n".join(lines)


def _where(report: Any, node: str) -> str:
    try:
        r = report.row(node)
    except KeyError:
        return f"'{node}'"
    return f"'{node}' (module {r.get('module') or '<root>'}, {r.get('op')})"
