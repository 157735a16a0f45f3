"""``InstrumentedGraphModule``: a captured graph over the user's model, the ``Instrumented`` a snapshot returns.

An ``InstrumentedGraphModule`` (a ``torch.fx.GraphModule`` and an ``Instrumented``, ``base.py``) holds
the user's model's own submodules, parameters and buffers (the same objects, not copies), so training it trains the model, ``state_dict()`` keys are the
model's, and a checkpoint loads either way. Everything fxdebug adds (observers, the clock, new
modules from transform passes) lives under one root attribute, ``fxdebug``, with no persistent
state. The model itself is never modified.

When an op fails inside the instrumented forward, the error is re-raised as a typed fxdebug
error naming the node (see ``diagnose``); on the success path nothing is added to the call.

A capture is made of *parts*: ``parts()`` maps a module path to the graph module that stands for it.
A symbolic or export capture is one part (``{"": self}``); the subtrees frontend gives several
(``capture/subtrees.py``, its module ``subtree_module.py``), and the live (Dynamo) capture, which is
not itself a graph module, one per graph Dynamo hands over (``live.py``). ``observers()``, ``reset()``
and ``report()`` loop over the parts (``base.Instrumented``), so no caller needs to know which frontend
made the module; this class adds what one graph does for itself. A snapshot's call
first goes through the one snapshot check (``snapshot_cache.check_call``: the graph for the model's
flags, attribute values and call signature). The entry points ``trace`` / ``instrument`` /
``render`` live in ``api.py``.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.fx import Graph, GraphModule
from torch.fx.graph import _PyTreeCodeGen

from fxdebug.authoring.context import NAMESPACE, PassContext
from fxdebug.graph.diagnose import locate_failure, op_failure
from fxdebug.graph.gc_pause import paused_gc
from fxdebug.graph.module_sharing import CALL_HOOKS, share_root_state
from fxdebug.errors import FxDebugError
from fxdebug.instrumented.base import Instrumented
from fxdebug.graph.meta import KEY, GraphRecord, graph_record
from fxdebug.instrumented.snapshot_cache import check_call, other_signatures, with_signatures
from fxdebug.instrumented.snapshot_recipe import follow_mode
from fxdebug.runtime.observer import Clock, Observer
from fxdebug.runtime.lower import observers_in
from fxdebug.render.draw import render as draw
from fxdebug.report.report import Report, build_report
from fxdebug.graph.serialize import deserialize_graph, encode_pytree_info, serialize_graph
from fxdebug.instrumented.to_module import to_module as plain_module
from fxdebug.capture.base import Capture
from fxdebug.capture.graphs import graph_module
from fxdebug.capture.trace_info import TraceInfo

__all__ = ["InstrumentedGraphModule"]


class InstrumentedGraphModule(GraphModule, Instrumented):
    """A traced, possibly instrumented model: a ``torch.fx.GraphModule`` with a report; a part of every capture.

    Build one with ``fxdebug.trace`` or ``fxdebug.instrument``, not directly.
    """

    part_inputs: Any = None  # ``Part.inputs``: (args, kwargs) this part was called with when its frontend recorded it

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_capture(cls, model: nn.Module, capture: Capture) -> "InstrumentedGraphModule":
        """The module for a single-graph ``Capture`` (symbolic, export): the graph over ``model``'s own objects."""
        part = capture.part
        gm = part.graph_module
        built = cls._build(model, gm.graph, capture.info, namespace=gm._modules.get(NAMESPACE))
        built.part_inputs = part.inputs
        if part.root_path:
            graph_record(built).extras["root_path"] = part.root_path  # where= names paths from the model's root
        return built

    @classmethod
    def _build(cls, model: nn.Module, graph: Graph, info: TraceInfo, namespace: nn.Module | None = None) -> "InstrumentedGraphModule":
        """``namespace``: fxdebug's own modules the graph already refers to (``fxdebug.*`` targets)."""
        root: nn.Module = model
        if namespace is not None:
            root = _Holder({**model._modules, NAMESPACE: namespace}, model._parameters, model._buffers,
                           model._non_persistent_buffers_set, model.training)
        # the called modules are not copied: the model's whole hierarchy is adopted next
        gm = graph_module(cls, root, graph, type(model).__name__, children=False)
        _adopt_hierarchy(gm, model)
        if namespace is not None:
            gm._modules[NAMESPACE] = namespace  # GraphModule copied it with persistent buffers; keep ours
        gm.meta[KEY] = GraphRecord(trace=info, model_type=type(model).__name__)
        return gm

    def recompile(self) -> Any:
        """Mark the generated code stale; it is generated at the first call (or ``.code`` read).

        Like torch's ``_LazyGraphModule``: ``instrument()`` edits the graph in several stages
        (capture, passes, lowering), and generating Python for a 10k-node graph after each one
        cost more than everything else together. ``real_recompile()`` generates it now.
        """
        self.__dict__["_fxdebug_stale_code"] = True
        cls = type(self)
        if isinstance(self._graph._codegen, _PyTreeCodeGen):  # what GraphModule.recompile sets first
            self._in_spec = self._graph._codegen.pytree_info.in_spec
            self._out_spec = self._graph._codegen.pytree_info.out_spec
        cls.forward = InstrumentedGraphModule._lazy_forward
        cls.__call__ = InstrumentedGraphModule._call_with_diagnosis  # type: ignore[method-assign]
        return None

    def real_recompile(self) -> Any:
        """Generate the module's Python code now if the graph changed since (``None`` if it had not)."""
        if not self.__dict__.get("_fxdebug_stale_code"):
            return None
        return _generate(self)

    def _lazy_forward(self, *args: Any, **kwargs: Any) -> Any:
        self.real_recompile()
        return type(self).forward(self, *args, **kwargs)

    @property
    def code(self) -> str:
        self.real_recompile()
        return str(self._code)

    def __str__(self) -> str:
        self.real_recompile()
        return super().__str__()

    def train(self, mode: bool = True) -> "InstrumentedGraphModule":
        super().train(mode)
        follow_mode(self, mode)  # a captured part's own module follows, as shared children do
        return self

    def _call_with_diagnosis(self, *args: Any, **kwargs: Any) -> Any:
        routed = check_call(self, args, kwargs)  # the one snapshot check (fxdebug.instrumented.snapshot_cache)
        if routed is not None:
            return routed(*args, **kwargs)
        try:
            return nn.Module.__call__(self, *args, **kwargs)
        except FxDebugError:
            raise
        except Exception as exc:
            raise_op_failure(self, exc)
            raise

    # -- what fxdebug knows -----------------------------------------------------------------------
    def parts(self) -> dict[str, "InstrumentedGraphModule"]:
        """``{module path: InstrumentedGraphModule}`` for every captured part, in execution order.

        One graph (symbolic or export capture) is one part, the module itself under ``""``.
        """
        return {"": self}

    def replace_part(self, path: str, new: "InstrumentedGraphModule") -> "InstrumentedGraphModule":
        """The module with part ``path`` replaced by ``new`` (what a pass pipeline returned)."""
        if path != "":
            raise KeyError(f"no captured part {path!r}; parts: {list(self.parts())}")
        return new

    def recorded_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The ``(args, kwargs)`` this part was called with when its frontend recorded the model.

        ``None`` for a part captured from the caller's example inputs (``Part.inputs``).
        """
        return self.part_inputs

    def _own_observers(self) -> dict[str, Observer]:
        return observers_in(self)  # call_module, lowered op call or batched call (runtime/lower.py)

    def _clock(self) -> Clock | None:
        space = getattr(self, NAMESPACE, None)
        if space is None:
            return None
        return next((m for m in space.children() if isinstance(m, Clock)), None)

    def _own_notes(self) -> list[str]:
        notes = list(self.trace_info.notes)
        for res in self.pass_results:
            notes.extend(f"{res.pass_name}: {n}" for n in res.notes)
        return notes

    def _part_report(self) -> Report:
        """This graph's own observations, as if it were the whole model."""
        info = self.trace_info
        clock = self._clock()
        return with_signatures(self, build_report(  # export: its captures for other keyword signatures too
            self,
            auto_leaves={k: str(v) for k, v in info.auto_leaves.items()},
            frontend=info.frontend,
            notes=self._own_notes(),
            calls=clock.calls if clock is not None else 0,
        ))

    def _reset_own(self) -> None:
        """Forget this graph's own statistics (``Instrumented.reset`` calls it for every part)."""
        for obs in self._own_observers().values():
            obs.reset()
        clock = self._clock()
        if clock is not None:
            clock.reset()
        for other in other_signatures(self):  # export: the captures for other keyword signatures
            other.reset()  # type: ignore[operator]

    def learn_shapes(self, example_inputs: Any) -> None:
        """Run ``example_inputs`` once to write every node's shape, dtype and device into its meta."""
        PassContext(example_inputs).specs(self)

    def to_module(self, shrink: bool = False) -> nn.Module:
        """A plain, shippable ``GraphModule``: observers removed, transforms kept (``fxdebug.instrumented.to_module``).

        ``shrink=True`` also removes pruned channels physically (``fxdebug.instrumented.shrink``).
        """
        return plain_module(self, shrink=shrink)

    def render(self, path: str, example_inputs: Any = None, **kwargs: Any) -> str:
        """Draw the annotated graph to ``path`` (SVG); see ``fxdebug.render``."""
        if example_inputs is not None:
            self.learn_shapes(example_inputs)
        report = kwargs.pop("report", None)
        if report is None and self.observers():
            report = self.report()
        return draw(self, path, report=report, parts=self.parts(), **kwargs)

    def retrace(self) -> "InstrumentedGraphModule":
        """A new ``InstrumentedGraphModule`` over the same model objects, with its own copy of fxdebug's modules.

        ``fxdebug.trace`` of an instrumented module returns this: the passes run so far are kept.
        """
        with warnings.catch_warnings():  # torch's own deepcopy of an export graph's pytree spec warns
            warnings.simplefilter("ignore", FutureWarning)
            graph = copy.deepcopy(self.graph)
        for node in graph.nodes:  # Graph.__deepcopy__ copies node.meta shallowly: own fxdebug's dicts
            if KEY in node.meta:
                node.meta[KEY] = copy.deepcopy(node.meta[KEY])
        record = graph_record(self)
        res = InstrumentedGraphModule(self, graph, class_name=record.model_type)
        _adopt_hierarchy(res, self)
        if NAMESPACE in self._modules:
            res._modules[NAMESPACE] = copy.deepcopy(self._modules[NAMESPACE])
            res.recompile()
        res.meta[KEY] = record.copy()
        return res

    # -- copying and saving ---------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> "InstrumentedGraphModule":
        with warnings.catch_warnings():  # copying an export graph's TreeSpecs trips torch's LeafSpec deprecation
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            res = super().__deepcopy__(memo)
        assert isinstance(res, InstrumentedGraphModule)
        _adopt_hierarchy(res, _Holder(
            OrderedDict((k, copy.deepcopy(v, memo)) for k, v in self._modules.items()),
            OrderedDict((k, copy.deepcopy(v, memo)) for k, v in self._parameters.items()),
            OrderedDict((k, copy.deepcopy(v, memo)) for k, v in self._buffers.items()),
            set(self._non_persistent_buffers_set), self.training))
        return res

    def __reduce__(self) -> Any:
        holder = (dict(self._modules), dict(self._parameters), dict(self._buffers),
                  set(self._non_persistent_buffers_set), self.training)
        extras = {k: v for k, v in self.__dict__.items()
                  if not k.startswith("_") and k not in ("training", "meta") and not callable(v)}
        return (_load_instrumented, (serialize_graph(self.graph), holder, self.meta, extras,
                                     encode_pytree_info(self.graph)))


def _generate_code(gm: InstrumentedGraphModule) -> Any:
    """``GraphModule.recompile`` for a stale ``InstrumentedGraphModule`` (its own call and forward kept)."""
    gm.__dict__["_fxdebug_stale_code"] = False
    cls = type(gm)
    own = vars(cls).get("forward")
    with paused_gc():  # code generation allocates per node and frees nothing: no collector sweeps meanwhile
        code = GraphModule.recompile(gm)
    cls.__call__ = InstrumentedGraphModule._call_with_diagnosis  # type: ignore[method-assign]
    if own is not None and own is not InstrumentedGraphModule._lazy_forward:
        cls.forward = own  # a subclass's own forward (the subtrees' eager root) stays
    return code


# run eagerly, never traced: a compiled call of a module whose code is not generated yet generates it first
_disable: Any = torch.compiler.disable  # (unannotated in torch)
_generate: Callable[[InstrumentedGraphModule], Any] = _disable(_generate_code)


class _Holder(nn.Module):
    """A bare module carrying a hierarchy, used to rebuild an ``InstrumentedGraphModule``."""

    def __init__(self, modules: Any, params: Any, buffers: Any, non_persistent: set[str], training: bool) -> None:
        super().__init__()
        self._modules = OrderedDict(modules)
        self._parameters = OrderedDict(params)
        self._buffers = OrderedDict(buffers)
        self._non_persistent_buffers_set = set(non_persistent)
        self.training = training


def _adopt_hierarchy(gm: GraphModule, model: nn.Module) -> None:
    """Make ``gm``'s children, parameters and buffers exactly ``model``'s (same objects).

    ``GraphModule`` keeps only what the graph references, under fresh containers; adopting the
    whole hierarchy keeps ``state_dict()`` keys identical to the model's (unused layers included)
    and keeps fxdebug's own modules under the ``fxdebug`` attribute.
    """
    ours = gm._modules.get(NAMESPACE)
    gm._modules = OrderedDict(model._modules)
    if ours is not None and NAMESPACE not in gm._modules:
        gm._modules[NAMESPACE] = ours
    share_root_state(gm, model)
    # The root's own hooks are the model's (same dicts): a graph holds the forward only, and the
    # model's forward/backward hooks and pre-hooks run around it at every call, as around the model.
    for name in CALL_HOOKS:
        if name in model.__dict__:
            object.__setattr__(gm, name, model.__dict__[name])


def _load_instrumented(rows: Any, holder: Any, meta: dict[str, Any], extras: dict[str, Any],
                       pytree_info: Any = None) -> InstrumentedGraphModule:
    root = _Holder(*holder)
    for k, v in extras.items():
        setattr(root, k, v)
    graph = deserialize_graph(rows, pytree_info)
    gm = InstrumentedGraphModule(root, graph, class_name=meta.get(KEY, {}).get("model_type", "GraphModule"))
    _adopt_hierarchy(gm, root)
    gm.meta = meta
    return gm


def raise_op_failure(gm: GraphModule, exc: Exception) -> None:
    """An op of ``gm``'s graph raised ``exc``: raise the typed error naming its node (a shape or device
    problem), or, for any other failure, note the node on ``exc`` and return (the caller re-raises it,
    keeping the user's exception type)."""
    located = locate_failure(gm, exc)
    if located is None:
        return
    node, inputs = located
    err = op_failure(node, exc, inputs)
    if type(err) is FxDebugError:
        exc.add_note(f"fxdebug: {err.message}")
        return
    raise err from exc
