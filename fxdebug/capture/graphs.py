"""The two frontends that capture a model as one graph: symbolic tracing and ``torch.export``.

Both return a single-part ``Capture`` over the model's own parameters and buffers; what they
capture with lives in ``symbolic.py`` and ``export.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

from torch import Tensor, nn
from torch.fx import Graph, GraphModule
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph_module import _copy_attr
from torch.nn.modules.module import _global_module_registration_hooks

from fxdebug.capture.base import CallInputs, Capture, Part, TraceOptions
from fxdebug.capture.export import capture_export
from fxdebug.capture.symbolic import capture_symbolic
from fxdebug.capture.trace_info import TraceInfo
from fxdebug.graph.edits import NAMESPACE
from fxdebug.graph.module_sharing import share_root_state

__all__ = ["ExportFrontend", "SymbolicFrontend", "graph_module", "single_part"]

GM = TypeVar("GM", bound=GraphModule)


def graph_module(cls: type[GM], root: nn.Module, graph: Graph, class_name: str, *, children: bool = True) -> GM:
    """``cls(root, graph, class_name=class_name)``, the same module, with its per-target copy made cheaper.

    ``GraphModule.__init__`` copies every ``call_module`` / ``get_attr`` target from ``root`` with
    ``_copy_attr`` (a ``getattr`` and an ``nn.Module.__setattr__``: ~5 µs a node, ~0.06 s for 10k
    layers, and ``instrument()`` builds two). Here a target naming a child of ``root`` itself (one
    atom: the layers of a long ``nn.Sequential``) is written into ``_modules`` directly, which is
    what that ``setattr`` does on a fresh module; any other target goes through ``_copy_attr`` in
    graph order, as before. ``children=False``: ``call_module`` targets are not copied at all, for a
    caller that replaces ``_modules`` with the model's own right after (``Instrumented._build``)."""
    gm = cls(root, Graph(), class_name=class_name)  # an empty graph: nothing copied yet
    direct = not _global_module_registration_hooks  # such hooks see every setattr: leave them to it
    own, modules, params, buffers, state = root._modules, gm._modules, gm._parameters, gm._buffers, gm.__dict__
    for node in graph.nodes:
        op = node.op
        if op != "call_module" and op != "get_attr":
            continue
        target = node.target
        if not isinstance(target, str):
            raise AssertionError(f"Expected node.target to be str, got {type(target)}")
        if op == "call_module":
            if not children:
                continue
            child = own.get(target) if direct else None
            if child is not None and target not in state and target not in params and target not in buffers \
                    and getattr(root, target, None) is child:
                modules[target] = child
                continue
        _copy_attr(root, gm, target)
    gm.graph = graph
    # what GraphModule.__init__ reads from the graph once it is set
    tracer_cls = graph._tracer_cls
    gm._tracer_cls = tracer_cls if tracer_cls and "<locals>" not in tracer_cls.__qualname__ else None
    gm._tracer_extras = graph._tracer_extras if graph._tracer_extras else {}
    return gm


def single_part(model: nn.Module, graph: Graph, info: TraceInfo, namespace: nn.Module | None = None) -> Capture:
    """A one-part capture: ``graph`` over ``model``'s own objects (and fxdebug's ``namespace``, if any)."""
    root = nn.Module()
    root._modules = OrderedDict(model._modules)
    if namespace is not None:
        root._modules[NAMESPACE] = namespace
    share_root_state(root, model)
    # lazy: its Python is generated only if the part itself is called (the Instrumented module built
    # from this graph generates its own); generating it here cost ~0.05 ms per node
    gm = graph_module(_LazyGraphModule, root, graph, type(model).__name__)
    if namespace is not None:
        gm._modules[NAMESPACE] = namespace  # GraphModule copied it with persistent buffers; keep ours
    return Capture([Part("", gm)], info)


def _tensor_attributes(model: nn.Module, graph: Graph) -> dict[str, tuple[nn.Module, str, Tensor]]:
    """``{constant name: (owner module, attribute, tensor)}`` for each ``get_attr`` of a tensor held as a
    plain attribute (not a buffer) of a module of ``model``; the node is pointed at that constant. The
    staleness guard (``StalenessGuard.tensor_attrs``) points the constant at the module's current tensor before each
    call, so ``self.mask = ...`` after ``instrument`` is followed; a copy or a loaded module keeps its own."""
    found: dict[str, tuple[nn.Module, str, Tensor]] = {}
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, name = str(node.target).rpartition(".")
        try:
            owner = model.get_submodule(owner_path)
        except AttributeError:
            continue
        value = owner.__dict__.get(name)
        if isinstance(value, Tensor) and name not in owner._buffers and name not in owner._parameters:
            safe = "attr_" + str(node.target).replace(".", "_")
            found[safe] = (owner, name, value)
            node.target = safe  # moved under fxdebug.constants below, with the created constants
    return found


class SymbolicFrontend:
    """``torch.fx`` symbolic tracing; untraceable submodules become leaves (``auto_leaf``)."""

    name = "symbolic"
    live = False  # a snapshot: capture() captures the model as it is now

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> Capture:
        graph, info = capture_symbolic(model, inputs, leaf_modules=options.leaf_modules, auto_leaf=options.auto_leaf)
        attrs = _tensor_attributes(model, graph)  # self.mask: a plain tensor attribute, followed per call
        info.constants.update({safe: tensor for safe, (_, _, tensor) in attrs.items()})
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
        if attrs and info.staleness is not None:
            info.staleness.tensor_attrs = [(owner, name, consts, safe) for safe, (owner, name, _) in attrs.items()]
        return single_part(model, graph, info, space)


class ExportFrontend:
    """``torch.export`` (non-strict) on the example inputs: an aten-level graph."""

    name = "export"
    live = False  # a snapshot: capture() captures the model as it is now

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> Capture:
        graph, info, space = capture_export(model, inputs, dynamic_batch=options.dynamic_batch)
        return single_part(model, graph, info, space)
