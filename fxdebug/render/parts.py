"""Pictures of a model captured in parts (the subtrees frontend): one view with the data between parts.

When the root's ``forward`` stays eager, each captured submodule is its own graph and nothing in
the graphs says how they connect. The frontend records each part's first call (inputs and output);
``fxdebug.capture.part_flow`` matches every part's input tensors against the outputs of the parts
that ran before it (same shape, dtype and values) and keeps those matches as the edges between parts.
``parts_view`` draws every part's graph inside its module cluster, joins the matched outputs to the
inputs they became, and leaves an input no earlier part produced as an input of the part, noted
as coming from the eager ``forward``. Modules that stay eager (the root, containers) are labelled so.
"""

from __future__ import annotations

from typing import Any

from fxdebug.render.view import GraphView, VisNode, build_view

__all__ = ["EAGER", "graph_extras", "parts_view"]

EAGER = "eager"
"""The word module types carry when the module's ``forward`` ran eagerly around captured parts."""


def _prefixed(v: VisNode, path: str) -> VisNode:
    v.name = f"{path}/{v.name}"
    v.inputs = [f"{path}/{i}" for i in v.inputs]
    v.module = f"{path}.{v.module}" if v.module else path
    if v.placed is not None:
        v.placed = f"{path}.{v.placed}" if v.placed else path
    return v


def parts_view(gm: Any, report: Any = None, *, failed: Any = None, show_instrumentation: bool = False) -> GraphView:
    """One ``GraphView`` of every part of ``gm`` (an ``Instrumented`` with several parts)."""
    nodes: dict[str, VisNode] = {}
    module_types: dict[str, str] = {}
    columns = None
    outputs: dict[str, list[str]] = {}
    inputs: dict[str, list[VisNode]] = {}
    failed_name = getattr(failed, "node", failed) if failed is not None else None
    for path, part in gm.parts().items():
        part_report = part.report() if part.observers() else None
        local_failed = None
        if isinstance(failed_name, str) and failed_name.startswith(path + "/"):
            local_failed = failed_name[len(path) + 1:]
        view = build_view(part, part_report, failed=local_failed, show_instrumentation=show_instrumentation)
        columns = columns or view.columns
        for sub, typ in view.module_types.items():
            module_types[f"{path}.{sub}"] = typ
        module_types[path] = type(gm.get_submodule(path)).__name__
        for v in view.nodes.values():
            v = _prefixed(v, path)
            if v.kind == "output":
                outputs[path] = list(v.inputs)
                continue
            if v.kind == "placeholder":
                v.placed = path
                inputs.setdefault(path, []).append(v)
            nodes[v.name] = v
    flow = graph_extras(gm).get("part_flow", [])
    taken: set[str] = set()
    for src, dst, shape in flow:
        target = next((p for p in inputs.get(dst, []) if p.name not in taken and p.shape == tuple(shape)), None)
        if target is None or src not in outputs:
            continue
        taken.add(target.name)
        for user in nodes.values():
            if target.name in user.inputs:
                user.inputs = [x for i in user.inputs for x in (outputs[src] if i == target.name else [i])]
        del nodes[target.name]
    read = {i for v in nodes.values() for i in v.inputs}
    for path, placeholders in inputs.items():
        for p in placeholders:
            if p.name in nodes and p.name not in read:
                del nodes[p.name]  # an argument the part never reads (None, a flag): not part of the data flow
            elif p.name in nodes:
                p.notes.append(f"comes from the eager forward around {path}")
    for path, why in getattr(gm.trace_info, "eager_modules", {}).items():
        if path:
            module_types[path] = f"{_type_of(gm, path)} ({EAGER})"
    model_type = graph_extras(gm).get("model_type") or getattr(gm.meta.get("fxdebug"), "model_type", None)
    merged = GraphView(
        nodes=nodes, model_type=f"{model_type or type(gm).__name__} (forward runs {EAGER}ly; "
                                f"{len(gm.parts())} captured parts)",
        first_nonfinite=getattr(report, "first_nonfinite", None), first_nonfinite_grad=getattr(report, "first_nonfinite_grad", None),
        calls=getattr(report, "calls", 0) or 0, module_types=module_types,
    )
    if columns is not None:
        merged.columns = columns
    for v in nodes.values():
        v.origin = v.name == merged.first_nonfinite
        v.grad_origin = v.name == merged.first_nonfinite_grad
    if failed is not None and not isinstance(failed, str):
        merged.failed_message = getattr(failed, "message", None) or str(failed)
    return merged


def _type_of(gm: Any, path: str) -> str:
    try:
        return type(gm.get_submodule(path)).__name__
    except AttributeError:
        return "Module"


def graph_extras(gm: Any) -> dict[str, Any]:
    """What capture recorded about the whole graph beyond the standard fields (``{}`` if nothing)."""
    record = getattr(gm, "meta", {}).get("fxdebug")
    if record is None:
        return {}
    extras = getattr(record, "extras", None)
    if isinstance(extras, dict):
        return {"model_type": getattr(record, "model_type", None), **extras}
    return dict(record) if isinstance(record, dict) else {}
