"""Symbolic tracing that never gives up on the whole model because of one submodule.

``torch.fx.symbolic_trace`` fails on the entire model when any submodule has data-dependent
control flow or other untraceable Python. Here a failing trace is retried with the *innermost*
module that was executing at the moment of failure turned into a leaf (called as a black box),
until the trace succeeds or the failure sits in the root's own ``forward``. Each auto-leaf is
recorded with the tracer's message and the user's source line, so reports can say which parts of
the model fxdebug could not see into, and why.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import time
import traceback
from collections import OrderedDict
from types import FrameType
from typing import Any, Iterable

import torch
from torch import nn
from torch.fx import Graph, Tracer

from fxdebug.errors import TraceError
from fxdebug.capture.faithful import StateWrite, clean_graph_meta, has_call_hooks, patched_for_tracing
from fxdebug.capture.faithful_reads import TORCH, RandomDraw, config_guards
from fxdebug.capture.inplace_proxy import MutatingProxy
from fxdebug.capture.staleness import StalenessGuard
from fxdebug.capture.trace_info import LeafInfo, TraceInfo
from fxdebug.graph.inputs import Inputs, normalize_inputs, untouched_state
from fxdebug.graph.module_state import refuse_namespace_clash, refuse_uninitialized
from fxdebug.graph.meta import fx_meta

__all__ = ["Inputs", "capture_symbolic", "normalize_inputs"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXDEBUG_DIR = os.path.dirname(os.path.dirname(__file__))  # the package root: every folder of fxdebug
_TRACER_FILES = frozenset(os.path.join(_FXDEBUG_DIR, "capture", f) for f in ("symbolic.py", "faithful.py"))


class _FailureLocatingTracer(Tracer):
    """A tracer that remembers which module was innermost when tracing failed."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.record_stack_traces = False  # torch's recorder costs ~0.3 ms a node; ours walks frames
        self._leaves = leaves
        self.fxdebug_reads: dict[Any, Any] = {}  # plain attributes forward read (faithful.patched_for_tracing)
        self.hooked: set[str] = set()
        # buffers are graph inputs (get_attr), not constants folded at trace time: arithmetic over them
        # (FrozenBatchNorm's rsqrt of running_var) follows a later load_state_dict, and an in-place update
        # (self.step.add_(1)) runs at every call instead of once while tracing
        self.proxy_buffer_attributes = True
        self._buffer_names: dict[int, str] | None = None

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if isinstance(attr_val, torch.Tensor) and not isinstance(attr_val, nn.Parameter):
            if self._buffer_names is None:  # torch searches named_buffers() at every read: one map instead
                self._buffer_names = {}
                for path, buf in self.root.named_buffers():
                    self._buffer_names.setdefault(id(buf), path)
            found = self._buffer_names.get(id(attr_val))
            if found is None:
                return attr_val
            if found not in parameter_proxy_cache:
                parameter_proxy_cache[found] = self.create_proxy("get_attr", found, (), {})
            return parameter_proxy_cache[found]
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def trace(self, root: Any, concrete_args: Any = None) -> Graph:
        # autograd.Functions, grad-mode/autocast regions and attribute writes: see fxdebug.capture.faithful
        with patched_for_tracing(self, root):
            return super().trace(root, concrete_args)

    def proxy(self, node: Any) -> MutatingProxy:
        # ``y += 1`` must stay a write into y (fxdebug.capture.inplace_proxy), not a new tensor
        return MutatingProxy(node, self)

    def create_node(self, *args: Any, **kwargs: Any) -> Any:
        node = super().create_node(*args, **kwargs)
        if node.op not in ("placeholder", "output") and not node.stack_trace:
            source = _user_frame_text()  # under fxdebug's own key: torch's stack_trace is only read
            if source:
                fx_meta(node)["source"] = source
        return node

    def create_arg(self, a: Any) -> Any:
        # FX turns every dict into a plain dict literal; an OrderedDict the model builds (an FPN's
        # feature maps) must stay one, or code downstream that was captured with it rejects it.
        if type(a) is OrderedDict:
            return self.create_node("call_function", OrderedDict, (self.create_arg(list(a.items())),), {})
        return super().create_arg(a)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name and has_call_hooks(m):
            # tracing through a hooked module would run its hooks once, now; called as a module, they
            # run at every call, as in the model
            self.hooked.add(module_qualified_name)
            return True
        return module_qualified_name in self._leaves or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            if not hasattr(exc, "_fxdebug_module"):
                exc._fxdebug_module = self.path_of_module(m)  # type: ignore[attr-defined]
            raise


def _user_frame_text() -> str | None:
    """The innermost caller frame outside torch and fxdebug, formatted like a traceback entry.

    Walking ``sys._getframe`` is an order of magnitude cheaper than extracting a full traceback
    per node, which matters on graphs of thousands of nodes.
    """
    frame: FrameType | None = sys._getframe(2)
    kinds = _FILE_KINDS
    while frame is not None:
        filename = frame.f_code.co_filename
        kind = kinds.get(filename)
        if kind is None:
            kind = kinds[filename] = _file_kind(filename)
        if kind == _USER:
            code = linecache.getline(filename, frame.f_lineno).strip()
            return f'File "{filename}", line {frame.f_lineno}, in {frame.f_code.co_name}\n    {code}'
        if kind == _FXDEBUG:
            # reached fxdebug's own call into the tracer: no user code defines this op (a layer of a
            # root nn.Sequential); the line calling instrument() would be a wrong answer
            return None
        frame = frame.f_back  # torch, or the tracer's own hooks (call_module, patched calls) that sit
    return None               # between an op and the user's forward: look past them


_USER, _FXDEBUG, _PAST = 0, 1, 2
_FILE_KINDS: dict[str, int] = {}  # co_filename -> kind (a few dozen files; one lookup per frame)


def _file_kind(filename: str) -> int:
    if filename in _TRACER_FILES:
        return _PAST
    if filename.startswith(_FXDEBUG_DIR):
        return _FXDEBUG
    if filename.startswith(_TORCH_DIR) or filename.startswith("<"):
        return _PAST
    return _USER


def _user_location(exc: BaseException) -> str | None:
    """The innermost frame of the user's own code in ``exc``'s traceback."""
    best = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith((_TORCH_DIR, _FXDEBUG_DIR)) or "<" in frame.filename:
            continue
        best = frame
    if best is None:
        return None
    code = (best.line or "").strip()
    name = os.path.basename(best.filename)
    return f"{name}:{best.lineno} `{code}`" if code else f"{name}:{best.lineno}"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def _optional_none_args(model: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]] | None) -> dict[str, Any]:
    """Forward parameters defaulting to ``None`` that the example inputs do not supply.

    A symbolic proxy for ``mask=None`` is never ``None``, so ``if mask is not None:`` would bake
    the masked branch into the graph and break calls without a mask. Pinning such arguments to
    ``None`` keeps the graph exact; FX then asserts at call time that they stay ``None``.
    """
    fixed = _defaults_not_given(model, inputs or ((), {}))
    return {k: v for k, v in fixed.items() if v is None}


def _defaults_not_given(model: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]] | None) -> dict[str, Any]:
    """Forward parameters that the example inputs leave at their defaults (``mask=None``)."""
    if inputs is None:
        return {}
    args, kwargs = inputs
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    fixed = {}
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if i >= len(args) and p.name not in kwargs and p.default is not p.empty:
            fixed[p.name] = p.default
    return fixed


def capture_symbolic(
    model: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    *,
    leaf_modules: Iterable[str | type[nn.Module]] = (),
    auto_leaf: bool = True,
) -> tuple[Graph, TraceInfo]:
    """Trace ``model`` into a graph, turning untraceable submodules into leaves if allowed."""
    start = time.perf_counter()
    by_type = tuple(x for x in leaf_modules if isinstance(x, type))
    leaves = {x for x in leaf_modules if isinstance(x, str)}
    named = list(model.named_modules())  # one walk before the trace (leaves by type, attempts, lazy modules)
    if by_type:
        leaves |= {name for name, m in named if isinstance(m, by_type) and name}
    info = TraceInfo(user_leaves=tuple(sorted(leaves)))
    concrete: dict[str, Any] = _optional_none_args(model, inputs)
    if concrete:
        info.notes.append(f"arguments left at None are pinned to None in the graph: {sorted(concrete)}")
    max_attempts = len(named) + 2
    own_attributes = set(model.__dict__)
    refuse_namespace_clash(model, "symbolic")
    if inputs is not None:  # the pipeline runs them on the graph: a lazy module would materialize
        refuse_uninitialized(model, "symbolic", named)
    try:
        with untouched_state(model):  # forward's Python runs once: random draws, list appends leave no trace
            graph, named = _trace_with_leaves(model, inputs, leaves, concrete, info, auto_leaf, max_attempts)
    finally:
        # FX stores tensors created in forward (torch.ones(4)) on the root as _tensor_constant*;
        # take them back off the user's model, which fxdebug never mutates.
        for name in [k for k in model.__dict__ if k not in own_attributes]:
            info.constants[name] = model.__dict__.pop(name)
    info.concrete_args = concrete
    _fresh_list_arguments(graph)
    _annotate(graph, model, info, named)
    info.staleness = _staleness_guard(model, graph, concrete, named)
    info.seconds = time.perf_counter() - start
    return graph, info


def _staleness_guard(model: nn.Module, graph: Graph, concrete: dict[str, Any],
                     named: list[tuple[str, nn.Module]]) -> StalenessGuard:
    """The modules the graph traced through (not called as modules) and the arguments it takes.
    ``named``: ``model.named_modules()``, walked once after the trace."""
    leaves = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    inlined = [m for p, m in named if p and p not in leaves and not _under_a_leaf(p, leaves)]  # a leaf itself: no split
    targets = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    names = frozenset(t.lstrip("*") for t in targets)
    return StalenessGuard(model, "symbolic", inlined, (names, dict(concrete), any(t.startswith("**") for t in targets)))


def _under_a_leaf(path: str, leaves: set[str]) -> bool:
    """Whether ``path`` is a leaf or inside one: a set lookup per dotted prefix, not a scan of the leaves."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in leaves for i in range(1, len(parts) + 1))


def _fresh_list_arguments(graph: Graph) -> None:
    """Give each call of a ``torch.fx.wrap``-ped function fresh lists/dicts, as plain FX code does.

    A list literal in a node's arguments is stored as FX's ``immutable_list``. The generated
    ``forward`` writes it out as a new list every call, but an ``Interpreter`` (the example run,
    checks) passes the stored object itself, so a wrapped helper that mutates its list argument
    (torchvision's Swin3D ``_get_window_and_shift_size``) fails there. A ``list(...)`` node before
    such calls makes every way of running the graph hand over a fresh, mutable copy.
    """
    for node in list(graph.nodes):
        if node.op != "call_function" or _is_library_function(node.target):
            continue
        def thaw(value: Any) -> Any:
            if not isinstance(value, (list, dict)):
                return value
            with graph.inserting_before(node):
                return graph.call_function(list if isinstance(value, list) else dict, (value,))
        node.args = tuple(thaw(a) for a in node.args)
        node.kwargs = {k: thaw(v) for k, v in node.kwargs.items()}


def _is_library_function(target: Any) -> bool:
    """Torch ops, operators and builtins never mutate their list arguments; user helpers may."""
    module = getattr(target, "__module__", None) or ""
    return (not callable(target) or module.split(".")[0] in ("torch", "_operator", "operator", "builtins", "math")
            or target is OrderedDict or target in (list, dict, tuple))


def _trace_with_leaves(
    model: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | None,
    leaves: set[str],
    concrete: dict[str, Any],
    info: TraceInfo,
    auto_leaf: bool,
    max_attempts: int,
) -> tuple[Graph, list[tuple[str, nn.Module]]]:
    """Trace, turning the innermost failing module into a leaf after each failure; the graph and
    ``model.named_modules()`` after the trace (one walk, shared by what follows it)."""
    for _ in range(max_attempts):
        tracer = _FailureLocatingTracer(leaves)
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
            clean_graph_meta(graph)  # module stacks name the user's classes (see faithful._watched_class)
        except Exception as exc:
            failed = getattr(exc, "_fxdebug_module", "")
            if failed and auto_leaf and failed not in leaves:
                leaves.add(failed)
                info.auto_leaves[failed] = LeafInfo(
                    failed, type(model.get_submodule(failed)).__name__, _reason(exc), _user_location(exc)
                )
                continue
            fixed = _defaults_not_given(model, inputs)
            if not failed and fixed and any(k not in concrete for k in fixed):
                concrete.update(fixed)  # the root branches on an optional argument: pin it to its default
                info.notes.append(f"pinned forward arguments to their defaults: {sorted(fixed)}")
                continue
            raise _trace_error(model, failed, exc, auto_leaf) from exc
        named = list(model.named_modules())
        paths = {id(m): p for p, m in named}
        info.guards = [(paths[key[0]], key[1], value) for key, (_, value) in tracer.fxdebug_reads.items()
                       if key[0] in paths]
        # config objects' values and torch's modes the trace read (faithful_reads): a change captures again
        info.guards += config_guards(named) + [(TORCH, k, v) for k, v in getattr(tracer, "fxdebug_modes", {}).items()]
        for path in sorted(tracer.hooked - set(info.auto_leaves)):
            info.auto_leaves[path] = LeafInfo(
                path, type(model.get_submodule(path)).__name__,
                "has forward/backward hooks: called as a module so that they run at every call", None)
        if has_call_hooks(model):
            info.notes.append("the model's own forward/backward hooks run at every call of the instrumented module")
        # torch's tracer ends in a reference cycle (a closure of its trace()), so only the cyclic
        # collector frees it: its per-node tables (scope per node name, calls per module) go now
        tracer.node_name_to_scope.clear()
        tracer.num_calls.clear()
        return graph, named
    raise TraceError(f"tracing {type(model).__name__} did not converge after {max_attempts} attempts.")


def _trace_error(model: nn.Module, failed: str, exc: Exception, auto_leaf: bool) -> TraceError:
    where = _user_location(exc)
    at = f" at {where}" if where else ""
    if isinstance(exc, RandomDraw) and not failed:
        return TraceError(
            f"the root forward of {type(model).__name__}{f' at {exc.where}' if exc.where else ''} draws {exc.name}(), "
            "a random number the graph would freeze at its trace-time value, and the root cannot stay eager. "
            "Use frontend='auto' (the draw runs at every call) or 'subtrees' (the root stays eager), or draw "
            "with torch (torch.rand, a graph op).", module="", op=exc.name)
    if isinstance(exc, StateWrite) and not failed:
        return TraceError(
            f"the root forward of {type(model).__name__}{at} assigns self.{exc.name} (it updates {exc.described} of the model). "
            "A symbolic graph cannot perform it and the root cannot stay eager; nothing was written to the model. "
            "Use frontend='export' (it performs buffer updates) or frontend='subtrees' (keeps the root eager), "
            "or move the update into a submodule.",
            module="", op=type(model).__name__,
        )
    if failed:
        typ = type(model.get_submodule(failed)).__name__
        return TraceError(
            f"cannot trace module '{failed}' ({typ}){at}: {_reason(exc)}. "
            f"{'Auto-leafing is off; ' if not auto_leaf else ''}pass leaf_modules=['{failed}'] to call it "
            "as a black box, or frontend='export' to capture it at the aten level.",
            module=failed,
            op=typ,
        )
    return TraceError(
        f"cannot trace the root forward of {type(model).__name__}{at}: {_reason(exc)}. "
        "The root cannot become a leaf; fix the Python in forward (avoid branching on tensor values), "
        "pin arguments with concrete_args / example_inputs, list offending submodules in leaf_modules=, "
        "or use frontend='export'.",
        module="",
        op=type(model).__name__,
    )


def _restore_argument_names(graph: Graph, model: nn.Module) -> None:
    """FX renames a pinned argument's placeholder (``mask`` → ``mask_1``); callers use ``mask=``."""
    try:
        names = [p.name for p in inspect.signature(model.forward).parameters.values()]
    except (TypeError, ValueError):
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph, name in zip(placeholders, names):
        if ph.target != name and re.fullmatch(rf"{re.escape(name)}_\d+", str(ph.target)):
            ph.target = name


def _annotate(graph: Graph, model: nn.Module, info: TraceInfo, named: list[tuple[str, nn.Module]]) -> None:
    """Record on every node the module that owns it (functional calls and methods included)."""
    _restore_argument_names(graph, model)
    modules = dict(named)
    for node in graph.nodes:
        meta = fx_meta(node)
        if node.op == "call_module":
            path = str(node.target)
        else:
            stack = node.meta.get("nn_module_stack") or {}
            path = list(stack.values())[-1][0] if stack else ""
        meta["module"] = path
        mod = modules.get(path)
        if mod is not None:
            meta["module_type"] = type(mod).__name__
        if node.op == "call_module" and path in info.auto_leaves:
            meta["auto_leaf"] = str(info.auto_leaves[path])
