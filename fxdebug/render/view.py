"""What the picture shows, independent of how it is drawn: the ``GraphView``.

The view is built from two sources only — ``node.meta["fxdebug"]`` (shapes, provenance,
auto-leaves, roles) and a ``Report`` (statistics, the NaN/Inf origin) — so whatever pass wrote
them, built-in or a user's, shows up. Instrumentation nodes (role ``"instrumentation"`` or
``"clock"``) are folded into the node they observe: the graph a user sees is the model's own, and
the probes watching a node are listed on it. ``to_networkx`` and the SVG renderer share this view.

Failed checks are marked from three places: the ``failed=`` argument of ``render`` (an exception
carrying ``.node``, or a node name), ``node.meta["fxdebug"]["failed"]`` (a message a pass may set),
and a report row key ``"failed"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch.fx import GraphModule, Node

from fxdebug.runtime.columns import BASE_COLUMNS, COLOR, NONFINITE, Column, resolve_columns
from fxdebug.graph.meta import fx_meta, is_instrumentation, module_path, module_type, op_label, source_line

__all__ = ["GraphView", "VisNode", "build_view"]

BASE_KEYS = tuple(c.key for c in BASE_COLUMNS if c.key != "calls")
"""Row keys that describe the node rather than measure it (the report's base columns; ``calls`` is
a measurement and stays with the statistics)."""


@dataclass
class VisNode:
    """One node as the picture and ``to_networkx`` see it."""

    name: str
    kind: str  # the FX op: placeholder, call_module, call_function, call_method, get_attr, output
    label: str  # op_label: Conv2d, torch.log, .view
    target: str
    module: str
    module_type: str | None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    device: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)
    added_by: str | None = None
    changed_by: list[str] = field(default_factory=list)
    auto_leaf: str | None = None
    failed: str | None = None
    role: str | None = None
    source: str | None = None
    notes: list[str] = field(default_factory=list)
    origin: bool = False
    grad_origin: bool = False
    colors: list[tuple[str, str, float]] = field(default_factory=list)  # (key, label, value) of COLOR columns
    params: list[tuple[str, Any, Any]] = field(default_factory=list)  # parameters/buffers read: (target, shape, dtype)
    placed: str | None = None  # plumbing moved into the module cluster that consumes it
    folded: list["VisNode"] = field(default_factory=list)  # the same op in repeated blocks folded onto this one
    plumbing: bool = False  # mask building / shape arithmetic rather than data flow
    bad: bool = False  # a NONFINITE or ORIGIN column of its row says it saw NaN/Inf
    hot: list[str] = field(default_factory=list)  # COLOR columns at or above their threshold

    @property
    def nonfinite(self) -> bool:
        """True if the node's output (or its gradient) held NaN/Inf in some call (or a block folded onto it did)."""
        return bool(self.bad or self.origin or self.grad_origin or any(f.nonfinite for f in self.folded))

    @property
    def where(self) -> str:
        """The module path the node is drawn under (its own, or the consuming cluster for plumbing)."""
        return self.placed if self.placed is not None else self.module

    @property
    def worst_color(self) -> tuple[str, str, float] | None:
        """The largest ``COLOR`` value of the node, as ``(key, label, value)``."""
        return max(self.colors, key=lambda c: c[2]) if self.colors else None

    @property
    def hot_spot(self) -> bool:
        """Some ``COLOR`` column at or above its threshold, on a row it applies to (``Column.only``)."""
        return bool(self.hot)

    @property
    def cluster(self) -> str:
        """The module cluster the node is drawn in: a leaf module's call sits in its parent."""
        if self.kind == "call_module" and self.placed is None:
            return self.module.rpartition(".")[0]
        return self.where if self.kind not in ("placeholder", "output") else (self.placed or "")


@dataclass
class GraphView:
    """The nodes to draw, in graph order, plus what the report says about the whole graph."""

    nodes: dict[str, VisNode]
    model_type: str
    first_nonfinite: str | None = None
    first_nonfinite_grad: str | None = None
    failed_message: str | None = None
    calls: int = 0
    module_types: dict[str, str] = field(default_factory=dict)
    columns: list[Column] = field(default_factory=lambda: resolve_columns(()))  # the report's declarations
    folds: dict[str, str] = field(default_factory=dict)  # representative block path → "layer.0–11 ×12"
    focus: set[str] = field(default_factory=set)  # module paths drawn expanded: they hold a finding

    def max_module_depth(self) -> int:
        return max((len(n.where.split(".")) for n in self.nodes.values() if n.where), default=0)

    def display(self, path: str) -> str:
        """How a module path is labelled: a folded run of repeated blocks reads ``layer.0–11 ×12``."""
        return self.folds.get(path, path)


def _failed_target(failed: Any) -> tuple[str | None, str | None]:
    """``(node name, message)`` from ``failed=``: an exception with ``.node``, or a node name."""
    if failed is None:
        return None, None
    if isinstance(failed, str):
        return failed, None
    node = getattr(failed, "node", None)
    message = getattr(failed, "message", None) or str(failed)
    return (str(node) if node is not None else None), message


def _aliases(nodes: list[Node]) -> dict[str, str]:
    """Instrumentation node name → the model node it stands for (what it observes)."""
    alias: dict[str, str] = {}
    for n in nodes:
        if not is_instrumentation(n):
            continue
        observed = fx_meta(n).get("observes")
        if observed is None:
            firsts = [a for a in n.all_input_nodes]
            observed = firsts[0].name if firsts else None
        if observed is not None:
            alias[n.name] = observed
    # Resolve chains (a check inserted after an observer that was itself rewired).
    for k in list(alias):
        seen = {k}
        while alias[k] in alias and alias[k] not in seen:
            seen.add(alias[k])
            alias[k] = alias[alias[k]]
    return alias


def _add_probes(v: VisNode, probes: Any) -> None:
    v.probes.extend(p for p in probes if p not in v.probes)


def _observer_probes(gm: GraphModule, path: str) -> list[str]:
    """The probe keys of the observer module at ``path`` (for batched observations)."""
    try:
        observer = gm.get_submodule(path)
    except AttributeError:
        return []
    probes = getattr(observer, "probes", {})
    return [str(k) for k in probes] if isinstance(probes, dict) else []


def _container_types(gm: GraphModule, paths: set[str]) -> dict[str, str]:
    out = {}
    for p in sorted(paths):
        try:
            out[p] = type(gm.get_submodule(p)).__name__
        except AttributeError:
            continue
    return out


def build_view(gm: GraphModule, report: Any = None, *, show_instrumentation: bool = False,
               failed: Any = None, rows: dict[str, Any] | None = None) -> GraphView:
    """The ``GraphView`` of ``gm`` annotated with ``report`` (a ``Report`` or ``None``); ``rows``: its rows by node
    when the caller has them (one view per graph of a capture in thousands: built once, not per graph)."""
    nodes = list(gm.graph.nodes)
    if rows is None:
        rows = {r["node"]: r for r in (report.rows if report is not None else [])}
    columns = list(getattr(report, "columns", None) or resolve_columns(()))
    colored = [c for c in columns if c.has(COLOR)]
    bad_keys = [c.key for c in columns if c.has(NONFINITE)]
    alias = {} if show_instrumentation else _aliases(nodes)
    failed_node, failed_message = _failed_target(failed)
    view_nodes: dict[str, VisNode] = {}
    for n in nodes:
        meta = n.meta.get("fxdebug", {})
        if not show_instrumentation and is_instrumentation(n):
            batch = meta.get("batch")
            if batch:  # one call observing several nodes: each watched node gets its observer's probes
                for watched, observer in batch:
                    if watched in view_nodes:
                        _add_probes(view_nodes[watched], _observer_probes(gm, observer))
                continue
            owner = view_nodes.get(alias.get(n.name, ""))
            if owner is not None:
                _add_probes(owner, meta.get("probes", ()))
                if meta.get("role") == "instrumentation" and not meta.get("probes"):
                    owner.probes.append(op_label(n))
            continue
        row = rows.get(n.name, {})
        shape = meta.get("shape", row.get("shape"))
        vis = VisNode(
            name=n.name, kind=n.op, label=op_label(n), target=str(n.target), module=_module_of(n)[0],
            module_type=_module_of(n)[1], shape=tuple(shape) if shape is not None else None,
            dtype=meta.get("dtype", row.get("dtype")), device=meta.get("device", row.get("device")),
            stats={k: v for k, v in row.items() if k not in BASE_KEYS},
            added_by=meta.get("added_by"), changed_by=list(meta.get("changed_by", [])),
            auto_leaf=meta.get("auto_leaf"), role=meta.get("role"), source=source_line(n),
            notes=[str(x) for x in meta.get("notes", [])],
        )
        if report is not None and hasattr(report, "nonfinite_in"):
            vis.bad = bool(row) and report.nonfinite_in(row)
        else:
            vis.bad = any(row.get(k) for k in bad_keys)
        vis.colors, vis.hot = _colors(row, colored)
        if isinstance(meta.get("replaced"), str):
            vis.notes.append(f"replaces {meta['replaced']}")
        vis.failed = meta.get("failed") or row.get("failed")
        if failed_node == n.name:
            vis.failed = failed_message or vis.failed or "failed a check"
        inputs: list[str] = []
        for a in n.all_input_nodes:
            src = alias.get(a.name, a.name)
            if src != n.name and src in view_nodes and src not in inputs:
                inputs.append(src)
        vis.inputs = inputs
        view_nodes[n.name] = vis
    first = getattr(report, "first_nonfinite", None)
    first_grad = getattr(report, "first_nonfinite_grad", None)
    if first in view_nodes:
        view_nodes[first].origin = True
    if first_grad in view_nodes:
        view_nodes[first_grad].grad_origin = True
    paths = {p for m in {v.module for v in view_nodes.values()} for p in _prefixes(m)}  # each module once
    model_type = gm.meta.get("fxdebug", {}).get("model_type") if hasattr(gm, "meta") else None
    return GraphView(
        nodes=view_nodes,
        model_type=model_type or type(gm).__name__,
        first_nonfinite=first,
        first_nonfinite_grad=first_grad,
        failed_message=failed_message,
        calls=getattr(report, "calls", 0) or 0,
        module_types=_container_types(gm, paths),
        columns=columns,
    )


def _colors(row: dict[str, Any], columns: list[Column]) -> tuple[list[tuple[str, str, float]], list[str]]:
    """The ``COLOR`` values of ``row`` on rows their column applies to, and the keys at or above
    their threshold (a dead fraction only after an activation: the unit to fix, not its copies)."""
    colors: list[tuple[str, str, float]] = []
    hot: list[str] = []
    for col in columns:
        value = row.get(col.key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or not col.applies(row):
            continue
        colors.append((col.key, col.label or col.key, float(value)))
        if col.threshold is not None and value >= col.threshold:
            hot.append(col.key)
    return colors, hot


TORCH_EMPTY_STACK = "_empty_nn_module_stack_from_metadata_hook"
"""What torch's export metadata hook writes as the module of a node it creates whose input has no
module stack: not a module of the model, so the view drops it (the node sits at the root)."""


def _module_of(n: Node) -> tuple[str, str | None]:
    """``(module path, module type)`` of ``n``, without torch's internal empty-stack marker."""
    path = module_path(n)
    if TORCH_EMPTY_STACK not in path:
        return path, module_type(n)
    return ".".join(p for p in path.split(".") if p != TORCH_EMPTY_STACK), None


def _prefixes(path: str) -> list[str]:
    """``"a.b.c"`` → ``["a", "a.b", "a.b.c"]``."""
    if not path:
        return []
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]
