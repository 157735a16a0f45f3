"""Per-subtree capture: when the root cannot be captured, instrument its largest capturable parts.

A detector's root loops over a list of images and post-processes boxes whose number depends on
the data; neither FX nor ``torch.export`` can capture that ``forward``. Its backbone, neck and
heads are ordinary tensor programs. Here the root's ``forward`` stays eager and, walking down from
the root, every submodule that one of the graph frontends captures (symbolic, then export, each
checked bitwise against the module on the inputs it saw) is replaced by an ``Instrumented`` graph;
a module that cannot be captured stays eager and its children are tried instead.

The model is never touched: the eager root is a shallow copy of the model object whose child
dictionaries are fresh copies, with captured children swapped in; every parameter and buffer is
the model's own. The result reports which fraction of parameters and of executed aten ops sits
under instrumentation, and which modules stayed eager, and why.

Each captured submodule is one of ``SubtreeInstrumented.parts()``; the pass pipeline, the
report and the picture loop over the parts (``api.run_pipeline``, ``Instrumented.report``), so
nothing here repeats them.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.fx import Graph
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxdebug.graph.inputs import CallInputs, preserved_state
from fxdebug.graph.module_state import refuse_uninitialized
from fxdebug.errors import MissingInputsError, UsageError
from fxdebug.capture.faithful import sync_attributes, sync_tensors
from fxdebug.capture.live import LiveGuard
from fxdebug.instrumented.module import Instrumented
from fxdebug.graph.meta import KEY, GraphRecord, fx_meta, graph_record
from fxdebug.graph.serialize import deserialize_graph, serialize_graph
from fxdebug.capture.symbolic import TraceInfo
from fxdebug.capture.base import Frontend, TraceOptions
from fxdebug.capture.graphs import ExportFrontend, SymbolicFrontend
from fxdebug.capture.part_flow import part_flow

__all__ = ["SubtreeInstrumented", "SubtreesFrontend", "capture_subtrees"]

_GRAPH_FRONTENDS: tuple[Frontend, ...] = (SymbolicFrontend(), ExportFrontend())

_MAX_CALLS = 2  # calls recorded per module, for capture and the bitwise check


@dataclass
class _Calls:
    """What one module saw during the recording run."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = field(default_factory=list)
    rng: list[Any] = field(default_factory=list)  # torch's CPU stream as each recorded call began (dropout)
    count: int = 0
    ops: int = 0
    order: int = -1


def _clone(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, Tensor) else v, tree)


class _OpCounter(TorchDispatchMode):
    """Counts executed aten ops, crediting every module on the current call stack."""

    def __init__(self, stack: list[_Calls]) -> None:
        super().__init__()
        self.stack = stack
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.total += 1
        for rec in self.stack:
            rec.ops += 1
        return func(*args, **(kwargs or {}))


_RAISED = object()


def _record(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, _Calls], int]:
    """Run ``model`` once, eagerly, noting each submodule's calls, inputs, outputs and op count."""
    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    seen: dict[str, _Calls] = {}
    stack: list[_Calls] = []
    states: list[Any] = []
    order = [0]

    def pre(mod: nn.Module, _args: Any) -> None:
        path = paths.get(id(mod))
        if path is None:
            return
        rec = seen.setdefault(path, _Calls())
        if rec.order < 0:
            rec.order, order[0] = order[0], order[0] + 1
        stack.append(rec)
        states.append(torch.get_rng_state() if len(rec.calls) < _MAX_CALLS else None)

    def post(mod: nn.Module, a: Any, kw: Any, out: Any = _RAISED) -> None:
        path = paths.get(id(mod))
        if path is None or not stack:
            return
        rec = stack.pop()
        state = states.pop()
        if out is _RAISED:  # torch calls always_call hooks as (mod, args, None) when forward raised
            return
        rec.count += 1
        if len(rec.calls) < _MAX_CALLS:
            rec.calls.append((_clone(tuple(a)), _clone(dict(kw)), _clone(out)))
            rec.rng.append(state)

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post, with_kwargs=True, always_call=True)
    counter = _OpCounter(stack)
    try:
        with preserved_state(model), torch.no_grad(), counter:
            model(*_clone(args), **_clone(kwargs))  # the user's example inputs stay as they were
    finally:
        h1.remove()
        h2.remove()
        # torch's handle leaves the with_kwargs flag behind, and torch.compile then warns of global hooks
        nn.modules.module._global_forward_hooks_with_kwargs.pop(h2.id, None)
    return seen, counter.total


def _same(a: Any, b: Any) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, Tensor) != isinstance(y, Tensor):
            return False
        if isinstance(x, Tensor) and not (x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)):
            return False
    return True


def _capture_one(module: nn.Module, rec: _Calls, options: TraceOptions) -> tuple[Instrumented | None, str]:
    """The module as a checked ``Instrumented``, or ``None`` and why not."""
    args, kwargs, _ = rec.calls[0]
    reasons = []
    for frontend in _GRAPH_FRONTENDS:
        if frontend.name == "export" and len({_shapes(c[:2]) for c in rec.calls}) > 1 and not options.dynamic_batch:
            reasons.append("export: called with different input shapes")
            continue
        try:
            gm = Instrumented.from_capture(module, frontend.capture(module, (args, kwargs), options))
        except Exception as exc:  # any capture failure leaves the module eager, with the reason
            reasons.append(f"{frontend.name}: {getattr(exc, 'message', str(exc)).split('. ')[0]}")
            continue
        try:
            with preserved_state(module), torch.no_grad():
                ok = all(_same(_seeded_call(gm, rec.rng[i] if i < len(rec.rng) else None, a, k), out)
                         for i, (a, k, out) in enumerate(rec.calls))
        except Exception as exc:
            ok = False
            reasons.append(f"{frontend.name}: the captured graph failed on the recorded inputs ({type(exc).__name__})")
        else:
            if not ok:
                reasons.append(f"{frontend.name}: the captured graph does not reproduce the module's outputs bitwise")
        if ok:
            gm.part_inputs = (args, kwargs)  # Part.inputs: this part's inputs for the pass pipeline
            return gm, frontend.name
    return None, "; ".join(reasons)


def _seeded_call(gm: nn.Module, state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``gm`` on a recorded call, from the random state that call began in (dropout draws the same mask)."""
    if state is not None:
        torch.set_rng_state(state)
    return gm(*args, **kwargs)


def _shapes(call: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__ for v in pytree.tree_leaves(call))


def _relative_leaves(leaf_modules: Sequence[Any], path: str) -> list[Any]:
    """The user's ``leaf_modules`` (root-relative paths, or types) as seen from ``path``."""
    prefix = f"{path}."
    return [x if isinstance(x, type) else x[len(prefix):] for x in leaf_modules
            if isinstance(x, type) or str(x).startswith(prefix)]


def _select(model: nn.Module, seen: dict[str, _Calls],
            options: TraceOptions) -> tuple[dict[str, tuple[Instrumented, str]], dict[str, str]]:
    """Walk down from the root's children: capture what can be captured, descend where not."""
    captured: dict[str, tuple[Instrumented, str]] = {}
    eager: dict[str, str] = {}

    def visit(path: str, module: nn.Module) -> None:
        rec = seen.get(path)
        children = list(module.named_children())
        if rec is None or not rec.calls:
            if not children and any(True for _ in module.parameters(recurse=False)):
                eager[path] = "not called with the example inputs"
            for name, child in children:
                visit(f"{path}.{name}", child)
            return
        relative = TraceOptions(tuple(_relative_leaves(options.leaf_modules, path)), options.auto_leaf,
                                options.dynamic_batch)
        gm, how = _capture_one(module, rec, relative)
        if gm is not None:
            captured[path] = (gm, how)
            graph_record(gm).extras["root_path"] = path  # Part.root_path: where= names root paths (select.matches)
            return
        eager[path] = how
        for name, child in children:
            visit(f"{path}.{name}", child)

    for name, child in model.named_children():
        visit(name, child)
    return captured, eager


def _shell(module: nn.Module) -> nn.Module:
    """A shallow copy of the root with fresh child/parameter/buffer dicts (the same children).

    Made without ``copy.copy``: a parametrized module refuses ``__getstate__`` (and would recurse).
    """
    shell = object.__new__(type(module))
    shell.__dict__.update(module.__dict__)
    shell.__dict__["_fxdebug_original"] = module  # its Python attributes are synced with it at every call
    shell._modules = OrderedDict(module._modules)
    shell._parameters = OrderedDict(module._parameters)
    shell._buffers = OrderedDict(module._buffers)
    return shell


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


def _unhooked(part: Instrumented) -> Instrumented:
    """The part runs inside its module's own call, which runs the module's hooks: the part runs none."""
    for name in _HOOK_DICTS:
        if name in part.__dict__:
            object.__setattr__(part, name, OrderedDict())
    return part


class _Routed:
    """While the instrumented module runs, a captured module's ``forward`` is its part's graph.

    The model's own module object stays in the tree (``isinstance`` loops, ``model.train()``, its
    hooks, which its own call runs), and only its ``forward`` is routed, for the duration of the
    call, to the part. During the part's call the module is itself again, so capturing it again
    (other modes) sees the user's forward.
    """

    def __init__(self, module: nn.Module, part: Instrumented) -> None:
        self.module = module
        self.part = part

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        d = self.module.__dict__
        mine = d.pop("forward", None)
        try:
            return self.part(*args, **kwargs)
        finally:
            if mine is not None:
                d["forward"] = mine


def _adopt_attributes(gm: Instrumented, module: nn.Module) -> None:
    """Plain attributes the parent's code may read (``config``, ``layer_idx``) carried onto ``gm``."""
    for key, value in vars(module).items():
        if key.startswith("_") or key in gm.__dict__ or hasattr(type(gm), key) or key == "training":
            continue
        if isinstance(value, (Tensor, nn.Module)) or callable(value):
            continue
        gm.__dict__[key] = value


def _params_under(model: nn.Module, paths: Sequence[str]) -> int:
    ids: dict[int, int] = {}
    for path in paths:
        for p in model.get_submodule(path).parameters():
            ids[id(p)] = p.numel()
    return sum(ids.values())


class SubtreeInstrumented(Instrumented):
    """The root's ``forward`` runs eagerly; its captured submodules are ``Instrumented`` graphs.

    Its own graph only lists the captured parts, for reports and pictures; calling it calls the
    eager root (a shallow copy of the model sharing every parameter, buffer and child).
    """

    _shell: nn.Module

    @classmethod
    def _assemble(cls, shell: nn.Module, parts: dict[str, Instrumented], meta: dict[str, Any],
                  graph: Graph | None = None) -> "SubtreeInstrumented":
        if graph is None:
            graph = Graph()
            for path in parts:
                node = graph.create_node("call_module", path, (), {}, name=path.replace(".", "_"))
                fx_meta(node).update(module=path, module_type=meta["fxdebug"]["model_type"] if not path else
                                     type(shell.get_submodule(path)).__name__, keep_unused=True)
            graph.output(None)
        gm = cls(shell, graph, class_name=meta["fxdebug"]["model_type"])
        object.__setattr__(gm, "_shell", shell)
        gm.__dict__["_fxdebug_parts"] = dict(parts)
        gm._modules, gm._parameters, gm._buffers = shell._modules, shell._parameters, shell._buffers
        gm._non_persistent_buffers_set = shell._non_persistent_buffers_set
        gm.training = shell.training
        gm.meta = meta
        return gm

    def recompile(self) -> Any:
        code = super().recompile()
        type(self).forward = SubtreeInstrumented._eager_forward
        return code

    def _eager_forward(self, *args: Any, **kwargs: Any) -> Any:
        # the eager root is a copy of the model's root: it must see dbg.train()/eval() (`if self.training:`)
        shell = self._shell
        shell.__dict__["training"] = self.training
        original = shell.__dict__.get("_fxdebug_original")
        if original is not None:  # Python state (self.calls += 1) and rebound buffers live on the model
            sync_attributes(original, shell)
            sync_tensors(original, shell)
            # torch keys full vs. legacy backward-hook semantics on a flag of the module object
            shell.__dict__["_is_full_backward_hook"] = original.__dict__.get("_is_full_backward_hook")
        depth = self.__dict__.get("_fxdebug_depth", 0)
        routed: list[tuple[nn.Module, Any]] = []
        if depth == 0:  # a nested call (generate calling self) finds the routes in place
            for path, part in self.parts().items():
                module = shell.get_submodule(path)
                routed.append((module, module.__dict__.get("forward")))
                module.__dict__["forward"] = _Routed(module, part)
        self.__dict__["_fxdebug_depth"] = depth + 1
        try:
            return shell(*args, **kwargs)
        finally:
            self.__dict__["_fxdebug_depth"] = depth
            for module, before in reversed(routed):
                if before is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.__dict__["forward"] = before
            if original is not None:
                sync_attributes(shell, original)
                sync_tensors(shell, original, parameters=False)

    def parts(self) -> dict[str, Instrumented]:
        """``{module path: Instrumented}`` for every captured submodule, in execution order."""
        return dict(self.__dict__["_fxdebug_parts"])

    def replace_part(self, path: str, new: Instrumented) -> "SubtreeInstrumented":
        parts = self.__dict__["_fxdebug_parts"]
        if path not in parts:
            raise KeyError(f"no captured part {path!r}; parts: {list(parts)}")
        parts[path] = _unhooked(new)
        return self

    def _summary_notes(self) -> list[str]:
        return list(self.trace_info.notes)

    def learn_shapes(self, example_inputs: Any) -> None:
        """The parts learnt their shapes on the inputs they saw while the model was recorded."""

    def retrace(self) -> Instrumented:
        raise UsageError("a model captured per subtree cannot be traced again; call fxdebug.instrument on the "
                         "original model with all the passes you want.")

    def __deepcopy__(self, memo: dict[int, Any]) -> "SubtreeInstrumented":
        shell = copy.deepcopy(self._shell, memo)
        parts = {p: copy.deepcopy(part, memo) for p, part in self.parts().items()}
        return SubtreeInstrumented._assemble(shell, parts, copy.deepcopy(self.meta, memo),
                                             copy.deepcopy(self.graph, memo))

    def __reduce__(self) -> Any:
        return (_load_subtrees, (self._shell, self.parts(), self.meta, serialize_graph(self.graph)))


def _load_subtrees(shell: nn.Module, parts: dict[str, Instrumented], meta: dict[str, Any],
                   rows: Any) -> SubtreeInstrumented:
    return SubtreeInstrumented._assemble(shell, parts, meta, deserialize_graph(rows))


class SubtreesFrontend:
    """The root's forward stays eager; its largest capturable submodules become the parts."""

    name = "subtrees"

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> SubtreeInstrumented:
        return capture_subtrees(model, inputs, options)


def capture_subtrees(model: nn.Module, inputs: CallInputs | None, options: TraceOptions = TraceOptions()) -> SubtreeInstrumented:
    """Keep ``model``'s forward eager and capture its largest capturable submodules."""
    if inputs is None:
        raise MissingInputsError(
            f"the subtrees frontend runs {type(model).__name__} once on example inputs to see which submodules "
            "run and on what, and none were given: pass example_inputs=(x,) (or a dict of keyword inputs).",
            op=type(model).__name__,
        )
    refuse_uninitialized(model, "subtrees")
    start = time.perf_counter()
    seen, total_ops = _record(model, *inputs)
    captured, eager = _select(model, seen, options)
    order = sorted(captured, key=lambda p: seen[p].order)
    for path in order:
        _adopt_attributes(captured[path][0], model.get_submodule(path))
    shell = _shell(model)  # the captured modules stay in the tree; their forward is routed to the part per call
    total_params = sum(p.numel() for p in model.parameters())
    covered_params = _params_under(model, order)
    covered_ops = sum(seen[p].ops for p in order)
    info = TraceInfo(frontend="subtrees")
    info.live = LiveGuard(model, "subtrees")  # the root runs eagerly: its hooks run; each part guards its own
    info.coverage = {
        "parameters": covered_params / total_params if total_params else 1.0,
        "ops": covered_ops / total_ops if total_ops else 1.0,
    }
    info.eager_modules = {"": f"{type(model).__name__}: the root forward stays eager", **eager}
    info.captured = {p: captured[p][1] for p in order}
    info.notes.append(
        f"subtrees: {len(order)} submodules instrumented; {info.coverage['parameters']:.0%} of parameters and "
        f"{info.coverage['ops']:.0%} of executed ops are under instrumentation")
    info.notes.extend(f"subtrees: {p} captured by {how}" for p, how in info.captured.items())
    info.notes.extend(f"subtrees: {p or '<root>'} stays eager: {why}" for p, why in info.eager_modules.items())
    info.seconds = time.perf_counter() - start
    meta = {KEY: GraphRecord(trace=info, model_type=type(model).__name__)}
    meta[KEY].extras["part_flow"] = part_flow({p: seen[p].calls[0] for p in order if seen[p].calls})  # the picture's edges
    return SubtreeInstrumented._assemble(shell, {p: _unhooked(captured[p][0]) for p in order}, meta)
