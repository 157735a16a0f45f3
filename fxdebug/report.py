"""``Report``: what the instrumentation saw, one row per observed node, in graph order.

Building a report is the one place fxdebug reads device values back to the host. Rows are plain
dicts (``node``, ``module``, ``op``, ``shape``, ``dtype``, ``device``, then whatever the probes
summarised). The NaN/Inf origin is derived here from the probes' ``nonfinite_first_call`` keys:

* forward: the first node, in execution order, among those that saw non-finite values in the
  earliest call that saw any — its inputs were finite, so it is where the values went bad;
* backward: gradients flow in reverse, so among the nodes whose output gradient went non-finite
  in the earliest such call, the *last* in graph order is where the bad gradient entered:
  ``first_nonfinite_grad`` names it. The op whose backward computed that gradient is one of its
  users (``nonfinite_grad_from`` lists them): e.g. ``sqrt`` at 0 has a finite output gradient
  but sends Inf into its input, so the input's producer is reported and ``sqrt`` is among
  ``nonfinite_grad_from``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from torch.fx import GraphModule, Node

from .meta import is_instrumentation, module_path, op_label
from .observe import Observer

__all__ = ["Report", "build_report"]

_FIRST = "nonfinite_first_call"
_GRAD_FIRST = "grad_nonfinite_first_call"


@dataclass
class Report:
    rows: list[dict[str, Any]]
    first_nonfinite: str | None = None
    first_nonfinite_grad: str | None = None
    nonfinite_grad_from: list[str] = field(default_factory=list)
    auto_leaves: dict[str, str] = field(default_factory=dict)
    frontend: str = "symbolic"
    notes: list[str] = field(default_factory=list)
    calls: int = 0

    # -- lookup ---------------------------------------------------------------------------------
    def row(self, node: str) -> dict[str, Any]:
        """The row of node ``node`` (KeyError naming the known nodes otherwise)."""
        for r in self.rows:
            if r["node"] == node:
                return r
        raise KeyError(f"no row for node {node!r}; observed nodes: {[r['node'] for r in self.rows][:20]}")

    def __getitem__(self, node: str) -> dict[str, Any]:
        return self.row(node)

    @property
    def nonfinite_nodes(self) -> list[str]:
        return [r["node"] for r in self.rows if r.get("nonfinite_calls")]

    @property
    def ok(self) -> bool:
        """No non-finite value seen, forward or backward."""
        return self.first_nonfinite is None and self.first_nonfinite_grad is None and not any(
            r.get("nonfinite_calls") or r.get("grad_nonfinite_calls") for r in self.rows)

    # -- export ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "frontend": self.frontend,
            "calls": self.calls,
            "first_nonfinite": self.first_nonfinite,
            "first_nonfinite_grad": self.first_nonfinite_grad,
            "nonfinite_grad_from": self.nonfinite_grad_from,
            "auto_leaves": self.auto_leaves,
            "notes": self.notes,
            "rows": self.rows,
        }

    def to_json(self, path: str | None = None, **kwargs: Any) -> str:
        text = json.dumps(_jsonable(self.to_dict()), indent=kwargs.pop("indent", 2), **kwargs)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def to_dataframe(self) -> Any:
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Report.to_dataframe() needs pandas: pip install 'fxdebug[report]' (or pip install pandas).") from None
        return pd.DataFrame(self.rows)

    def __str__(self) -> str:
        from .table import format_report

        return format_report(self)

    def __repr__(self) -> str:
        return (f"Report({len(self.rows)} rows, calls={self.calls}, first_nonfinite={self.first_nonfinite!r}, "
                f"first_nonfinite_grad={self.first_nonfinite_grad!r})")


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _base_row(node: Node) -> dict[str, Any]:
    meta = node.meta.get("fxdebug", {})
    row = {
        "node": node.name,
        "module": module_path(node),
        "op": op_label(node),
        "shape": tuple(meta["shape"]) if "shape" in meta else None,
        "dtype": meta.get("dtype"),
        "device": meta.get("device"),
    }
    for key in ("added_by", "changed_by", "auto_leaf"):
        if key in meta:
            row[key] = meta[key]
    return row


def build_report(gm: GraphModule, *, auto_leaves: dict[str, str] | None = None, frontend: str = "symbolic",
                 notes: Sequence[str] = (), calls: int = 0) -> Report:
    """Collect every observer's summary on ``gm`` into a ``Report`` (this syncs with the device)."""
    nodes = list(gm.graph.nodes)
    order = {n.name: i for i, n in enumerate(nodes)}
    observers: dict[str, Any] = {}
    for n in nodes:
        meta = n.meta.get("fxdebug", {})
        if n.op == "call_module" and meta.get("role") == "instrumentation" and "observes" in meta:
            mod = gm.get_submodule(str(n.target))
            if isinstance(mod, Observer):
                observers[meta["observes"]] = mod
    rows = []
    by_name = {n.name: n for n in nodes}
    if observers:
        for name in sorted(observers, key=lambda k: order.get(k, 0)):
            node = by_name.get(name)
            if node is None:
                continue
            row = _base_row(node)
            obs = observers[name]
            row["calls"] = obs.calls or calls  # under torch.compile only the device clock counts
            row.update(obs.summary())
            rows.append(row)
    else:
        rows = [_base_row(n) for n in nodes if n.op in ("call_module", "call_function", "call_method") and not is_instrumentation(n)]
    entered = _backward_origin(rows)
    return Report(
        rows=rows,
        first_nonfinite=_forward_origin(rows),
        first_nonfinite_grad=entered,
        nonfinite_grad_from=_grad_producers(entered, by_name),
        auto_leaves=dict(auto_leaves or {}),
        frontend=frontend,
        notes=list(notes),
        calls=calls,
    )


def _forward_origin(rows: list[dict[str, Any]]) -> str | None:
    seen = [(r[_FIRST], i) for i, r in enumerate(rows) if r.get(_FIRST) is not None]
    if not seen:
        return None
    return rows[min(seen)[1]]["node"]


def _backward_origin(rows: list[dict[str, Any]]) -> str | None:
    seen = [(r[_GRAD_FIRST], i) for i, r in enumerate(rows) if r.get(_GRAD_FIRST) is not None]
    if not seen:
        return None
    earliest = min(c for c, _ in seen)
    return rows[max(i for c, i in seen if c == earliest)]["node"]


def _grad_producers(entered: str | None, by_name: dict[str, Node]) -> list[str]:
    """The users of ``entered``: one of their backward computations produced the bad gradient."""
    node = by_name.get(entered) if entered is not None else None
    if node is None:
        return []
    return [u.name for u in node.users if not is_instrumentation(u) and u.op != "output"]
