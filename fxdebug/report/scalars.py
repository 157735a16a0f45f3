"""``Report.scalars(prefix="fxdebug/", top_k=None)``: a report as one flat ``{key: float}`` dict.

Every experiment tracker takes such a dict (``accelerator.log``, ``wandb.log``, ``mlflow.log_metrics``,
``SummaryWriter.add_scalar`` in a loop, a Trainer's ``log``, Lightning's ``log_dict``). Keys are
``<prefix><module/path>/<node>/<stat>`` per node plus a few summaries ``<prefix><summary>``:

* summaries (always there): ``calls``, ``nodes`` (observed), ``nonfinite_nodes`` (how many saw
  NaN/Inf), ``ok`` (1.0 when none did), and where the report has them ``max_abs`` (largest finite
  |value| of any node) and ``grad_max_abs_min`` / ``grad_max_abs_max`` over nodes (vanishing and
  exploding gradients at a glance);
* per node (at most ``top_k`` keys in all): ``max_abs`` of the output (max(|min|, |max|)),
  ``grad_max_abs`` of its gradient (``StatCollector(grads=True)``), every column declared with the
  ``GRADIENT`` role (``ParamGrads``) or the ``COLOR`` role (where it applies: a dead fraction on
  activations, ``Profile``'s time share), and every column declared with the ``NONFINITE`` role
  whose count is non-zero (``nonfinite_calls`` with ``NaNCheck``).

Per-layer metrics flood dashboards (a tracker freezes at a few thousand charts), so ``top_k``
keeps the most informative nodes: those that saw non-finite values first (the origin first, then
in execution order), then the largest by ``max_abs`` (or gradient norm where there is no
``max_abs``). Values are finite floats only: a non-finite statistic is left out, and its node's
non-finite count says why.
"""

from __future__ import annotations

import math
from typing import Any

from fxdebug.runtime.columns import COLOR, GRADIENT, NONFINITE, Column

__all__ = ["scalars"]


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _max_abs(row: dict[str, Any], lo: str, hi: str) -> float | None:
    a, b = _finite(row.get(lo)), _finite(row.get(hi))
    return None if a is None or b is None else max(abs(a), abs(b))


def _node_values(row: dict[str, Any], nonfinite: list[Column], declared: list[Column]) -> dict[str, float]:
    out: dict[str, float] = {}
    for col in nonfinite:
        count = _finite(row.get(col.key))
        if count:
            out[col.key] = count
    for name, lo, hi in (("max_abs", "min", "max"), ("grad_max_abs", "grad_min", "grad_max")):
        v = _max_abs(row, lo, hi)
        if v is not None:
            out[name] = v
    for col in declared:
        v = _finite(row.get(col.key))
        if v is not None and col.applies(row):
            out[col.key] = v
    return out


def _tag(row: dict[str, Any]) -> str:
    module = (row.get("module") or "").replace(".", "/") or "root"
    node = str(row["node"]).replace(".", "_")
    return f"{module}/{node}"


def scalars(report: Any, prefix: str = "fxdebug/", top_k: int | None = None) -> dict[str, float]:
    """The flat dict described in the module docstring (``top_k=None``: every node)."""
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0):
        from fxdebug.errors import UsageError

        raise UsageError(f"scalars(top_k={top_k!r}): top_k is a number of per-node keys (an int >= 0) or None for all.")
    nonfinite = report.columns_with(NONFINITE)
    declared = [c for c in report.columns if {GRADIENT, COLOR} & c.roles and c not in nonfinite]
    rows = report.rows
    values = [_node_values(r, nonfinite, declared) for r in rows]
    bad = [i for i, r in enumerate(rows) if report.nonfinite_in(r)]
    origin = {report.first_nonfinite, report.first_nonfinite_grad} - {None}
    bad.sort(key=lambda i: (rows[i]["node"] not in origin, i))

    def size(i: int) -> float:
        v = values[i]
        return v.get("max_abs", v.get("grad_max_abs", next((v[c.key] for c in declared if c.key in v), 0.0)))

    bad_set = set(bad)
    rest = sorted((i for i in range(len(rows)) if i not in bad_set), key=lambda i: (-size(i), i))
    out: dict[str, float] = {
        f"{prefix}calls": float(report.calls or max((r.get("calls") or 0 for r in rows), default=0)),
        f"{prefix}nodes": float(len(rows)),
        f"{prefix}nonfinite_nodes": float(len(bad)),
        f"{prefix}ok": 1.0 if report.ok else 0.0,
    }
    magnitudes = [v["max_abs"] for v in values if "max_abs" in v]
    if magnitudes:
        out[f"{prefix}max_abs"] = max(magnitudes)
    grads = [v["grad_max_abs"] for v in values if "grad_max_abs" in v]
    if grads:
        out[f"{prefix}grad_max_abs_min"] = min(grads)
        out[f"{prefix}grad_max_abs_max"] = max(grads)
    budget = math.inf if top_k is None else top_k
    taken = 0
    for i in bad + rest:
        tag = _tag(rows[i])
        for name, v in values[i].items():
            if taken >= budget:
                return out
            out[f"{prefix}{tag}/{name}"] = v
            taken += 1
    return out
