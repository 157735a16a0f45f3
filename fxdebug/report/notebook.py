"""Notebook display of a ``Report``: ``Report._repr_mimebundle_`` returns plain text and an HTML table.

Jupyter (and VS Code, Colab) call ``_repr_mimebundle_`` on the last value of a cell. The HTML is a
self-contained ``<table>`` with inline styles and no script, so it shows the same in a trusted
and in an untrusted notebook: the header lines (origin of NaN/Inf, notes), then one row per
observed node with the table's columns; nodes that saw non-finite values are tinted red, the
forward/backward origin in bold.
"""

from __future__ import annotations

import html
from typing import Any

from fxdebug.report.table import _cell, _columns, _header, format_report, format_value

__all__ = ["report_html", "report_mimebundle"]

MAX_HTML_ROWS = 200


def report_html(report: Any, max_rows: int = MAX_HTML_ROWS) -> str:
    """The report as one HTML fragment (header lines and a table), without scripts."""
    rows = report.rows
    head = "".join(f"<div>{html.escape(line)}</div>" for line in _header(report))
    if not rows:
        return f'<div class="fxdebug-report">{head}<div>(no observed nodes)</div></div>'
    cols = [c for c in _columns(report) if any(_cell(r, c) is not None for r in rows) or c.key == "shape"]
    th = "".join(f'<th style="text-align:left;padding:1px 6px" title="{html.escape(c.doc)}">{html.escape(c.key)}</th>'
                 for c in cols)
    origin = {report.first_nonfinite, report.first_nonfinite_grad} - {None}
    body = []
    for r in rows[:max_rows]:
        style = "background:#fde2e1" if report.nonfinite_in(r) else ""
        if r["node"] in origin:
            style += ";font-weight:bold"
        tds = "".join(f'<td style="padding:1px 6px;font-family:monospace">{html.escape(format_value(_cell(r, c), c))}</td>'
                      for c in cols)
        body.append(f'<tr style="{style}">{tds}</tr>')
    more = (f"<div>... {len(rows) - max_rows} more rows (Report.rows has them all)</div>"
            if len(rows) > max_rows else "")
    return (f'<div class="fxdebug-report">{head}<table style="border-collapse:collapse;font-size:12px">'
            f"<thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>{more}</div>")


def report_mimebundle(report: Any, include: Any = None, exclude: Any = None) -> dict[str, str]:
    """``{"text/plain": table, "text/html": report_html(report)}``, filtered by ``include``/``exclude``."""
    bundle = {"text/plain": format_report(report, use_rich=False), "text/html": report_html(report)}
    if include:
        bundle = {k: v for k, v in bundle.items() if k in include}
    if exclude:
        bundle = {k: v for k, v in bundle.items() if k not in exclude}
    return bundle
