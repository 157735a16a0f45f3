"""Drawing an ``Alignment``: each side's recording as a graph, and what colours it.

``trace_graph`` turns a recording (``align_record.Trace``) into an aten-level ``GraphModule`` for
drawing only — one node per recorded op, named as in ``Alignment.rows``, wired by which op produced
which input, with the module path in ``nn_module_stack`` so the picture groups ops by module.
``SideDiff`` is what ``render(..., diff=)`` reads (the shape of a ``fxdebug.diff`` result): per
node its error over its noise floor (``rtol`` is 1: above 1 is beyond the floor), the ops on the
divergent path as infinitely divergent, and the first divergence on that side. ``render(gm,
diff=alignment)`` asks ``Alignment.for_graph(gm)`` for it: for a recorded graph, that side's
scores; for another graph of one of the two models (``fxdebug.trace``'s), scores by module.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from fxdebug.graph.meta import fx_meta, module_path
from fxdebug.numerics.align_record import Trace

__all__ = ["SideDiff", "trace_graph"]


def trace_graph(trace: Trace) -> GraphModule:
    """The recorded ops of one run as a drawable (not runnable) ``GraphModule``."""
    graph = Graph()
    nodes: dict[int, Node] = {}
    for op in trace.ops:
        target = op.target if callable(op.target) else torch.ops.aten.alias.default
        node = graph.create_node("call_function", target, tuple(nodes[i] for i in op.inputs if i in nodes), {},
                                 name=op.name)
        if op.module:
            node.meta["nn_module_stack"] = {op.module: (op.module, op.module_type)}
        meta = fx_meta(node)
        meta["module"], meta["module_type"] = op.module, op.module_type or None
        meta["shape"], meta["dtype"] = tuple(op.value.shape), str(op.value.dtype).replace("torch.", "")
        nodes[op.index] = node
    outs = tuple(nodes[i] for i in trace.outputs)
    graph.output(outs[0] if len(outs) == 1 else outs)
    return GraphModule(nn.Module(), graph)


class SideDiff:
    """One side of an ``Alignment`` in the form ``render(diff=)`` reads."""

    rtol = 1.0

    def __init__(self, divergence: dict[str, float], rows: dict[str, dict[str, Any]], first: str | None) -> None:
        self._div = divergence
        self._rows = rows
        self.first_divergent = first

    def node_divergence(self, side: str = "a") -> dict[str, float]:
        return dict(self._div)

    def row(self, node: str) -> dict[str, Any]:
        return self._rows.get(node, {})

    @classmethod
    def for_fx(cls, al: Any, gm: GraphModule) -> "SideDiff":
        """Colours for another graph of one of the two models (``fxdebug.trace``'s, say): each node
        takes the worst score of the recorded ops of its module (a ``call_module`` node: of its
        module and everything inside), and the first node of the divergent op's module (or its
        nearest enclosing module in the graph) is the first divergence. The side is the one whose
        module paths the graph shares most."""
        paths = {module_path(n) for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")}
        overlap = {side: len(paths & {op.module for op in al._side(side).ops}) for side in ("reference", "candidate")}
        side = max(overlap, key=lambda k: (overlap[k], k == "candidate"))
        recorded = cls.of(al, side)
        ops = al._side(side).ops
        by_module: dict[str, float] = {}
        for op in ops:
            if op.name in recorded._div:
                by_module[op.module] = max(by_module.get(op.module, 0.0), recorded._div[op.name])
        div: dict[str, float] = {}
        rows: dict[str, dict[str, Any]] = {}
        for n in gm.graph.nodes:
            if n.op not in ("call_module", "call_function", "call_method"):
                continue
            path = module_path(n)
            inside = [v for m, v in by_module.items()
                      if m == path or (n.op == "call_module" and m.startswith(path + "."))]
            if inside:
                div[n.name] = max(inside)
                rows[n.name] = {"column": "worst error / floor in module", "a": _g(div[n.name]), "b": path or "(top)"}
        first = None
        d = al.first_divergent
        if d is not None:
            target: str | None = d.reference[1] if side == "reference" else d.candidate[1]
            while target is not None and first is None:
                first = next((n.name for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")
                              and module_path(n) == target), None)
                target = None if not target else (target.rsplit(".", 1)[0] if "." in target else "")
            if first is not None:
                div[first] = math.inf
        return cls(div, rows, first)

    @classmethod
    def of(cls, al: Any, side: str) -> "SideDiff":
        m = al._m
        reference = al._side(side) is al._ref
        div: dict[str, float] = {}
        rows: dict[str, dict[str, Any]] = {}
        if reference:
            ops = al._ref.ops
            for ci, match in m.matches.items():
                for j in match.refs:
                    score = match.error / match.tol if match.tol > 0 else (0.0 if match.error == 0 else math.inf)
                    if ops[j].name not in div or score < div[ops[j].name]:
                        div[ops[j].name] = score
                        rows[ops[j].name] = {"column": "error", "a": _g(match.error), "b": f"floor {_g(match.tol)}",
                                             "match": f"{match.kind} of candidate {al._cand.ops[ci].name}"}
            for j in m.reference_entries():
                div.setdefault(ops[j].name, math.inf)
            first = al.first_divergent.reference[0] if al.first_divergent is not None else None
        else:
            ops = al._cand.ops
            for ci, match in m.matches.items():
                score = match.error / match.tol if match.tol > 0 else (0.0 if match.error == 0 else math.inf)
                div[ops[ci].name] = score
                rows[ops[ci].name] = {"column": "error", "a": _g(match.error), "b": f"floor {_g(match.tol)}"}
            first_i = m.first_divergent()
            if first_i is not None:
                div[ops[first_i].name] = math.inf
            first = al.first_divergent.candidate[0] if al.first_divergent is not None else None
        return cls(div, rows, first)


def _g(x: float) -> str:
    return f"{x:.3g}"
