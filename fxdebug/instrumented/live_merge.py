"""One report over every capture of a live module: rows with the same node identity merged like ranks.

A recompile of the same code (``labels=``, another shape, ``model.train()``, another backend) runs nodes
with the same names (``capture.dynamo_names``); their rows become one row whose ``calls`` add up, each
column merged by its own rule (``report.distributed._merge_rows``), per-channel maxima read only from a
capture that shares a node.
"""

from __future__ import annotations

from typing import Any

from fxdebug.report.distributed import _merge_rows, channel_maxima
from fxdebug.report.report import Report
from fxdebug.runtime.columns import resolve_columns

__all__ = ["merge_captures"]


def merge_captures(reports: list[tuple[Report, Any]], calls: int) -> Report:
    """``reports``: each capture's own report with its part (or, for a capture saved before a save/load, its
    per-channel maxima); ``calls``: the live module's call count."""
    seen: dict[str, int] = {}
    for rep, _ in reports:
        for row in rep.rows:
            seen[row["node"]] = seen.get(row["node"], 0) + 1
    by_name: dict[str, list[tuple[dict[str, Any], list[float] | None]]] = {}
    for rep, part in reports:
        # per-channel maxima (what a channel column's merge rule reads), only from a capture sharing a node
        if isinstance(part, dict):  # a saved capture: its maxima were read when it was saved
            maxima = part
        else:
            maxima = channel_maxima(part) if any(seen[r["node"]] > 1 for r in rep.rows) else {}
        for row in rep.rows:
            by_name.setdefault(row["node"], []).append((row, maxima.get(row["node"])))
    columns = resolve_columns(c for rep, _ in reports for c in rep.columns)
    rows = []
    merge_notes: list[str] = []
    for name, found in by_name.items():  # one row per node identity: its captures merged like ranks
        # a capture that never ran this node since the last reset (the quiet capture call's graph, a no_grad
        # recompile that took over) adds nothing: its zeros and unknowns would only blur the merge
        found = [f for f in found if f[0].get("calls")] or found[:1]
        if len(found) == 1:
            rows.append(found[0][0])
            continue
        per_capture = [{name: m} if m is not None else {} for _, m in found]
        merged_rows, why = _merge_rows([[r] for r, _ in found], per_capture, columns=columns)
        rows.append(merged_rows[0])
        merge_notes.extend(n.replace("distributed: ", "dynamo: ").replace("ranks", "captures") for n in why)
    notes = [n for rep, _ in reports for n in rep.notes] + merge_notes
    one = Report(rows=rows, columns=columns, notes=list(dict.fromkeys(notes)), calls=calls,
                 frontend="dynamo")
    return one
