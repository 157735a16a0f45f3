"""The two frontends that capture a model as one graph: symbolic tracing and ``torch.export``.

Both return a single-part ``Capture`` over the model's own parameters and buffers; what they
capture with lives in ``symbolic.py`` and ``export.py``.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn
from torch.fx import Graph
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxdebug.capture.base import CallInputs, Capture, Part, TraceOptions
from fxdebug.capture.export import capture_export
from fxdebug.capture.symbolic import TraceInfo, capture_symbolic
from fxdebug.graph.edits import NAMESPACE

__all__ = ["ExportFrontend", "SymbolicFrontend", "single_part"]


def single_part(model: nn.Module, graph: Graph, info: TraceInfo, namespace: nn.Module | None = None) -> Capture:
    """A one-part capture: ``graph`` over ``model``'s own objects (and fxdebug's ``namespace``, if any)."""
    root = nn.Module()
    root._modules = OrderedDict(model._modules)
    if namespace is not None:
        root._modules[NAMESPACE] = namespace
    root._parameters = model._parameters
    root._buffers = model._buffers
    root._non_persistent_buffers_set = model._non_persistent_buffers_set
    root.training = model.training
    # lazy: its Python is generated only if the part itself is called (the Instrumented module built
    # from this graph generates its own); generating it here cost ~0.05 ms per node
    gm = _LazyGraphModule(root, graph, class_name=type(model).__name__)
    if namespace is not None:
        gm._modules[NAMESPACE] = namespace  # GraphModule copied it with persistent buffers; keep ours
    return Capture([Part("", gm)], info)


class SymbolicFrontend:
    """``torch.fx`` symbolic tracing; untraceable submodules become leaves (``auto_leaf``)."""

    name = "symbolic"

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> Capture:
        graph, info = capture_symbolic(model, inputs, leaf_modules=options.leaf_modules, auto_leaf=options.auto_leaf)
        if not info.constants:
            return single_part(model, graph, info)
        # Tensors created in forward live under fxdebug.constants (non-persistent), not on the model.
        space, consts = nn.Module(), nn.Module()
        for name, value in info.constants.items():
            consts.register_buffer(name, value, persistent=False)
        space.add_module("constants", consts)
        for node in graph.nodes:
            if node.op == "get_attr" and str(node.target) in info.constants:
                node.target = f"{NAMESPACE}.constants.{node.target}"
        info.constants = {}
        return single_part(model, graph, info, space)


class ExportFrontend:
    """``torch.export`` (non-strict) on the example inputs: an aten-level graph."""

    name = "export"

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> Capture:
        graph, info, space = capture_export(model, inputs, dynamic_batch=options.dynamic_batch)
        return single_part(model, graph, info, space)
