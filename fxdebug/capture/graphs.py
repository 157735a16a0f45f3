"""The two frontends that capture a model as one graph: symbolic tracing and ``torch.export``.

Both return a single-part ``Instrumented`` over the model's own parameters and buffers; what
they capture with lives in ``tracing.py`` (symbolic) and ``frontends/export.py``.
"""

from __future__ import annotations

from torch import nn

from fxdebug.authoring.context import NAMESPACE
from fxdebug.instrumented.module import Instrumented
from fxdebug.capture.symbolic import capture_symbolic
from fxdebug.capture.base import CallInputs, TraceOptions
from fxdebug.capture.export import capture_export

__all__ = ["ExportFrontend", "SymbolicFrontend"]


class SymbolicFrontend:
    """``torch.fx`` symbolic tracing; untraceable submodules become leaves (``auto_leaf``)."""

    name = "symbolic"

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> Instrumented:
        graph, info = capture_symbolic(model, inputs, leaf_modules=options.leaf_modules, auto_leaf=options.auto_leaf)
        if not info.constants:
            return Instrumented._build(model, graph, info)
        # Tensors created in forward live under fxdebug.constants (non-persistent), not on the model.
        space, consts = nn.Module(), nn.Module()
        for name, value in info.constants.items():
            consts.register_buffer(name, value, persistent=False)
        space.add_module("constants", consts)
        for node in graph.nodes:
            if node.op == "get_attr" and str(node.target) in info.constants:
                node.target = f"{NAMESPACE}.constants.{node.target}"
        info.constants = {}
        return Instrumented._build(model, graph, info, namespace=space)


class ExportFrontend:
    """``torch.export`` (non-strict) on the example inputs: an aten-level graph."""

    name = "export"

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> Instrumented:
        graph, info, space = capture_export(model, inputs, dynamic_batch=options.dynamic_batch)
        return Instrumented._build(model, graph, info, namespace=space)
