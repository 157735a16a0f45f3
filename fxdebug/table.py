"""Plain-text rendering of a ``Report``: an aligned table plus the findings that matter."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["format_report", "format_value"]

# Column order for the statistics probes commonly produce; others follow alphabetically.
_PREFERRED = [
    "node", "module", "op", "shape", "dtype", "calls",
    "mean", "std", "min", "max", "mean_abs", "zero_frac", "dead_frac", "norm",
    "nonfinite_calls", "nan", "inf",
    "grad_mean", "grad_std", "grad_min", "grad_max", "grad_norm", "grad_zero_frac", "grad_nonfinite_calls",
]
_HIDDEN = {"device", "count", "grad_count", "grad_calls", "channels", "grad_mean_abs", "nonfinite_first_call", "grad_nonfinite_first_call", "added_by", "changed_by", "auto_leaf"}


def format_value(v: Any) -> str:
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


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    present: set[str] = set()
    for r in rows:
        present.update(k for k, v in r.items() if v is not None and not isinstance(v, (dict, list)) or k == "shape")
    cols = [c for c in _PREFERRED if c in present]
    cols += sorted(c for c in present if c not in cols and c not in _HIDDEN)
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
    cols = _columns(rows)
    table = Table(*cols, box=None, pad_edge=False, show_edge=False)
    for r in rows[:max_rows]:
        table.add_row(*(format_value(r.get(c)) for c in cols))
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
    cols = _columns(rows)
    shown = rows[:max_rows]
    cells = [[format_value(r.get(c)) for c in cols] for r in shown]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
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
