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

__all__ = ["EAGER", "graph_extras", "part_chain", "parts_view"]

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


def part_chain(view: GraphView, item_of: dict[str, str]) -> list[tuple[str, str]]:
    """Invisible edges that stack a parts view's parts top to bottom in execution order.

    Parts with no data edge between them (the eager ``forward`` between them did a residual add, a
    cache update) would otherwise stand side by side, in whatever order ``dot`` picks. For each two
    consecutive parts, the item drawing the earlier part's last node points at the first item of the
    later part that reads nothing from its own part (its inputs, constants), that one at the next,
    and so on, so each part starts below the one before and its inputs stand one under the other. Parts are the ``<part path>/`` prefixes of node names, in graph order (the
    order ``parts_view`` adds them: the order the parts first ran). ``[]`` for a single graph.
    """
    parts: dict[str, list[VisNode]] = {}
    for v in view.nodes.values():
        path, sep, _ = v.name.partition("/")
        if sep:
            parts.setdefault(path, []).append(v)
    if len(parts) < 2:
        return []
    succ: dict[str, set[str]] = {}
    for v in view.nodes.values():
        for i in v.inputs:
            a, b = item_of.get(i), item_of.get(v.name)
            if a is not None and b is not None and a != b:
                succ.setdefault(a, set()).add(b)

    def reaches(a: str, b: str) -> bool:
        seen, todo = {a}, [a]
        while todo:
            for n in succ.get(todo.pop(), ()):
                if n == b:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    chain: list[tuple[str, str]] = []
    order = list(parts.values())
    last: str | None = None  # the chain's newest item: where a part goes when its tail would make a cycle
    for before, after in zip(order, order[1:]):
        tail = item_of.get(before[-1].name)
        own = {v.name for v in after}
        for v in after:
            head = item_of.get(v.name)
            if head is None or any(i in own for i in v.inputs):
                continue
            for src in (tail, last):
                if src is None or src == head:
                    continue
                if (src, head) in chain or head in succ.get(src, ()):
                    break
                if not reaches(head, src):  # an edge drawn against the data would turn the picture over
                    chain.append((src, head))
                    succ.setdefault(src, set()).add(head)
                    break
            tail = last = head  # the part's inputs one under the other, not a row as wide as all of them
    return chain


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
