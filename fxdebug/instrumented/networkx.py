"""``fxdebug.to_networkx``: the graph as a ``networkx.DiGraph``, for analysis by users and passes.

It is built from the same view the picture uses (``render_view``): instrumentation is folded
into the node it observes unless asked for, and every node carries what fxdebug knows about it.
"""

from __future__ import annotations

from typing import Any

from torch.fx import GraphModule

from fxdebug.errors import ArgumentTypeError, UsageError
from fxdebug.instrumented.live import LiveInstrumented
from fxdebug.instrumented.base import Instrumented
from fxdebug.render.view import build_view

__all__ = ["to_networkx"]


def to_networkx(gm: GraphModule, report: Any = None, *, instrumentation: bool = False) -> Any:
    """A ``networkx.DiGraph`` with one node per graph node and an edge per data dependency.

    Node attributes: ``op`` (the FX op kind: ``call_module``, ``call_function``, ...), ``target``
    (as a string), ``label`` (``Conv2d``, ``torch.log``), ``module`` and ``module_type``,
    ``shape`` / ``dtype`` / ``device`` (when known), ``stats`` (the report row's numbers:
    whatever the probes declared: ``mean``, ``grad_*``...), ``probes``, ``added_by``,
    ``changed_by``, ``auto_leaf``, ``failed``, ``role``, ``origin`` (the NaN/Inf origin).
    Edge attribute: ``shape`` of the value flowing along it. Graph attributes:
    ``model_type``, ``first_nonfinite``, ``first_nonfinite_grad``.

    ``report`` defaults to ``gm.report()`` for an instrumented module with observers;
    ``instrumentation=True`` keeps fxdebug's observer nodes as nodes of their own. A live (Dynamo)
    module gives every graph it captured (one per frame, graph break and block region, in call order; a
    recompile's nodes are the first capture's, by name), with the report over every capture: each graph's inputs
    are nodes of their own (``placeholder``), not linked to the graph that made them.
    """
    try:
        import networkx as nx
    except ImportError:  # pragma: no cover - networkx is a declared dependency
        raise ImportError("fxdebug.to_networkx() needs networkx: pip install networkx.") from None
    if not isinstance(gm, (GraphModule, LiveInstrumented)):
        raise ArgumentTypeError(f"to_networkx() needs a torch.fx.GraphModule (e.g. from fxdebug.trace); got {type(gm).__name__}.")
    if report is None and isinstance(gm, Instrumented) and gm.observers():
        report = gm.report()
    if isinstance(gm, LiveInstrumented):  # not a graph itself: the graphs are its captures
        parts = list(gm.parts().values())
        if not parts:
            raise UsageError("to_networkx(): nothing captured yet: call the module once (or instrument it with "
                             "example_inputs) first.")
    else:
        parts = [gm]
    views = [build_view(part, report, show_instrumentation=instrumentation) for part in parts]
    first = views[0]
    graph = nx.DiGraph(model_type=first.model_type, first_nonfinite=first.first_nonfinite,
                       first_nonfinite_grad=first.first_nonfinite_grad)
    for view in views:
        for v in view.nodes.values():
            if v.name in graph:
                continue  # a recompile of a frame: the same node as the first capture's
            graph.add_node(
                v.name, op=v.kind, target=v.target, label=v.label, module=v.module, module_type=v.module_type,
                shape=v.shape, dtype=v.dtype, device=v.device, stats=dict(v.stats), probes=list(v.probes),
                added_by=v.added_by, changed_by=list(v.changed_by), auto_leaf=v.auto_leaf, failed=v.failed,
                role=v.role, origin=v.origin or v.grad_origin,
            )
        for v in view.nodes.values():
            for src in v.inputs:
                graph.add_edge(src, v.name, shape=view.nodes[src].shape)
    return graph
