"""One picture of a live capture in several graphs (block regions, graph breaks), joined by the data between them.

A live module captured as one graph is drawn as that graph. Captured in several (each repeated block a region of
its own, or a forward Dynamo breaks), no single graph is the model: drawing the largest showed one block of a
2,500-block model. While ``instrument()`` runs the example inputs, the live module notes which node of an earlier
graph made each graph input (``LiveState.feeds``, matched by tensor identity); ``joined_view`` draws every graph's
nodes in call order and replaces each such input by the node that made it, so the picture reads as the inlined
capture's, and the folding of repeated blocks applies to it as to one graph. An input no earlier graph made (the
model's own, or a value the eager code between graphs computed) stays an input, noted as such.
"""

from __future__ import annotations

from typing import Any, Mapping

from fxdebug.render.view import GraphView, VisNode, build_view

__all__ = ["JoinedParts", "joined_view"]


class JoinedParts(dict[str, Any]):
    """``{key: part}`` in call order, with ``feeds`` (a part's input placeholder -> the earlier node it took) and the
    model's type: what ``render(..., parts=...)`` draws as one picture."""

    def __init__(self, parts: Mapping[str, Any], feeds: Mapping[str, str], model_type: str) -> None:
        super().__init__(parts)
        self.feeds = dict(feeds)
        self.model_type = model_type


def _source(name: str, feeds: Mapping[str, str], nodes: Mapping[str, VisNode]) -> str | None:
    """The drawn node ``name`` stands for: followed through inputs that are another graph's output."""
    seen = set()
    while name in feeds and name not in seen:
        seen.add(name)
        name = feeds[name]
    return name if name in nodes else None


def joined_view(parts: JoinedParts, report: Any = None, *, failed: Any = None,
                show_instrumentation: bool = False) -> GraphView:
    """One ``GraphView`` of every part, each input another part made drawn as the node that made it."""
    nodes: dict[str, VisNode] = {}
    module_types: dict[str, str] = {}
    columns = None
    last_output: VisNode | None = None
    rows = {r["node"]: r for r in (report.rows if report is not None else [])}
    for part in parts.values():
        view = build_view(part, report, failed=failed, show_instrumentation=show_instrumentation, rows=rows)
        columns = columns or view.columns
        module_types.update(view.module_types)
        for name, v in view.nodes.items():
            if v.kind == "output":
                last_output = v
            elif name not in nodes:  # a recompile of a graph names its nodes as the first capture did: drawn once
                nodes[name] = v
    feeds = parts.feeds
    for name in [n for n, v in nodes.items() if v.kind == "placeholder" and n in feeds]:
        if _source(name, feeds, nodes) is not None:
            del nodes[name]
    for v in [*nodes.values(), *([last_output] if last_output is not None else [])]:
        joined: list[str] = []
        for i in v.inputs:
            src = _source(i, feeds, nodes) if i in feeds else i
            if src is not None and src not in joined:
                joined.append(src)
        v.inputs = joined
    for v in nodes.values():
        if v.kind == "placeholder" and v.name not in feeds and v.module:
            v.notes.append(f"an input of {v.module}'s graph that no earlier graph made (the model's, or eager code's)")
    if last_output is not None:
        nodes["output"] = last_output
    first = getattr(report, "first_nonfinite", None)
    first_grad = getattr(report, "first_nonfinite_grad", None)
    first = _source(first, feeds, nodes) if first in feeds else first
    first_grad = _source(first_grad, feeds, nodes) if first_grad in feeds else first_grad
    for v in nodes.values():
        v.origin = v.name == first
        v.grad_origin = v.name == first_grad
    view = GraphView(nodes=nodes, model_type=f"{parts.model_type} (live: {len(parts)} graphs, joined)",
                     first_nonfinite=first, first_nonfinite_grad=first_grad, calls=getattr(report, "calls", 0) or 0,
                     module_types=module_types)
    if columns is not None:
        view.columns = columns
    if failed is not None and not isinstance(failed, str):
        view.failed_message = getattr(failed, "message", None) or str(failed)
    return view
