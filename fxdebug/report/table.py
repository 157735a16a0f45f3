"""Plain-text rendering of a ``Report``: an aligned table plus the findings that matter."""

from __future__ import annotations

import math
import shutil
import sys
from typing import Any, Sequence

from fxdebug.runtime.columns import Column, resolve_columns

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


def _chosen(report: Any, cols: Sequence[str] | None) -> list[Column]:
    """``cols`` as declarations, in the order given (a typed error names the keys that exist)."""
    if cols is None:
        return _columns(report)
    known = {c.key: c for c in (getattr(report, "columns", None) or resolve_columns(()))}
    present = {k for r in report.rows for k in r} | set(known)
    unknown = [k for k in cols if k not in present]
    if unknown:
        from fxdebug.errors import UsageError

        raise UsageError(f"report.table(cols=...): no column {', '.join(map(repr, unknown))}; the rows have "
                         f"{', '.join(sorted(k for k in present if k in {x for r in report.rows for x in r}))}.")
    return [known.get(k) or Column(k) for k in cols]


_KEEP = 3  # node, module, op: never dropped to fit the width


def _fit(report: Any, cols: list[Column], width: int | None, explicit: bool) -> tuple[list[Column], list[str]]:
    """Drop trailing columns until the plain table fits ``width`` (the terminal when printing to one)."""
    if width is None:
        width = shutil.get_terminal_size(fallback=(0, 0)).columns if sys.stdout.isatty() else 0
    if explicit or width <= 0:
        return cols, []
    shown = report.rows[:400]
    sizes = [max([len(c.key)] + [len(format_value(_cell(r, c), c)) for r in shown]) for c in cols]
    kept = list(range(len(cols)))
    while len(kept) > _KEEP and sum(sizes[i] for i in kept) + 2 * (len(kept) - 1) > width:
        kept.pop()
    dropped = [c.key for i, c in enumerate(cols) if i not in kept]
    return [cols[i] for i in kept], dropped


def _cell(row: dict[str, Any], col: Column) -> Any:
    """The value a table cell shows: only on rows the column applies to (``Column.only``: a dead
    fraction only where it means dead units)."""
    return row.get(col.key) if col.applies(row) else None


def format_report(report: Any, max_rows: int = 400, *, use_rich: bool | None = None,
                  cols: Sequence[str] | None = None, width: int | None = None) -> str:
    """The report as aligned text: rich's box table when rich is installed (``use_rich=None``),
    else plain columns. Either way, plain text with no colour codes, ready for logs.

    ``cols`` picks the columns (row keys, in order); otherwise every shown column, trimmed from the
    right to ``width`` characters (default: the terminal's width when stdout is a terminal, no
    limit otherwise), with a line naming the columns left out."""
    chosen, dropped = _fit(report, _chosen(report, cols), width, cols is not None)
    if use_rich is not False:
        try:
            import rich  # noqa: F401
        except ImportError:
            if use_rich:
                raise ImportError("format_report(use_rich=True) needs rich: pip install 'fxdebug[report]'.") from None
        else:
            return _more(_format_rich(report, max_rows, chosen), dropped)
    return _more(_format_plain(report, max_rows, chosen), dropped)


def _more(text: str, dropped: list[str]) -> str:
    if not dropped:
        return text
    return text + f"\n({len(dropped)} more column(s) to fit the terminal: {', '.join(dropped)}; " \
                  "report.table(cols=[...]) picks columns)"


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


def _format_rich(report: Any, max_rows: int, cols: list[Column] | None = None) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    rows = report.rows
    lines = _header(report)
    if not rows:
        return "\n".join(lines + ["(no observed nodes)"])
    cols = _columns(report) if cols is None else cols
    cols = [c for c in cols if any(_cell(r, c) is not None for r in rows) or c.key == "shape"]
    table = Table(*(c.key for c in cols), box=None, pad_edge=False, show_edge=False)
    for r in rows[:max_rows]:
        table.add_row(*(format_value(_cell(r, c), c) for c in cols))
    buf = io.StringIO()
    Console(file=buf, width=max(120, 14 * len(cols)), color_system=None, force_terminal=False).print(table)
    text = "\n".join(line.rstrip() for line in buf.getvalue().splitlines())
    more = [f"... {len(rows) - max_rows} more rows (Report.rows has them all)"] if len(rows) > max_rows else []
    return "\n".join(lines + [text] + more)


def _format_plain(report: Any, max_rows: int, cols: list[Column] | None = None) -> str:
    rows = report.rows
    lines = _header(report)
    if not rows:
        return "\n".join(lines + ["(no observed nodes)"])
    cols = _columns(report) if cols is None else cols
    cols = [c for c in cols if any(_cell(r, c) is not None for r in rows) or c.key == "shape"]
    shown = rows[:max_rows]
    cells = [[format_value(_cell(r, c), c) for c in cols] for r in shown]
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
