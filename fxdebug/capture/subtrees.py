"""Per-subtree capture: when the root cannot be captured, instrument its largest capturable parts.

A detector's root loops over a list of images and post-processes boxes whose number depends on
the data; neither FX nor ``torch.export`` can capture that ``forward``. Its backbone, neck and
heads are ordinary tensor programs. Here the root's ``forward`` stays eager and, walking down from
the root, every submodule that one of the graph frontends captures (symbolic, then export, each
checked bitwise against the module on the inputs it saw) becomes one ``Part`` of the ``Capture``;
a module that cannot be captured stays eager and its children are tried instead.

The result is data: ``Capture(parts=[Part(path, graph_module, inputs, root_path, info)], info)``,
with ``info`` saying which fraction of parameters and of executed aten ops sits under
instrumentation, which modules stayed eager and why, and ``extras["part_flow"]`` how the parts'
tensors flow into each other. The module (an eager root routing to its parts) is built one floor
up, in ``fxdebug.instrumented.subtree_module``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxdebug.graph.inputs import CallInputs, preserved_state
from fxdebug.graph.module_state import refuse_uninitialized
from fxdebug.errors import MissingInputsError
from fxdebug.capture.staleness import StalenessGuard
from fxdebug.capture.trace_info import TraceInfo
from fxdebug.capture.base import Capture, Frontend, Part, TraceOptions
from fxdebug.capture.graphs import ExportFrontend, SymbolicFrontend
from fxdebug.capture.part_flow import part_flow

__all__ = ["SubtreesFrontend", "capture_subtrees"]

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


def _record(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            grad: bool = False) -> tuple[dict[str, _Calls], int]:
    """Run ``model`` once, eagerly, noting each submodule's calls, inputs, outputs and op count.

    Without autograd unless ``grad`` (a forward that registers a tensor hook needs it)."""
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
        with preserved_state(model), torch.set_grad_enabled(grad), counter:
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


def _capture_one(module: nn.Module, rec: _Calls, options: TraceOptions) -> tuple[Part | None, str]:
    """The module as a checked ``Part`` (its graph reproduces every recorded call), or ``None`` and why not."""
    args, kwargs, _ = rec.calls[0]
    if any(isinstance(v, Tensor) and v.is_nested for c in rec.calls for v in pytree.tree_leaves(c)):
        return None, "called on nested tensors (torch's fused fast path): a graph cannot take them"
    reasons = []
    for frontend in _GRAPH_FRONTENDS:
        if frontend.name == "export" and len({_shapes(c[:2]) for c in rec.calls}) > 1 and not options.dynamic_batch:
            reasons.append("export: called with different input shapes")
            continue
        try:
            capture = frontend.capture(module, (args, kwargs), options)
            part = capture.part
            gm = part.graph_module
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
        if ok:  # inputs: this part's inputs for the pass pipeline; info: how this part was captured
            return Part(part.path, gm, inputs=(args, kwargs), info=capture.info), frontend.name
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
            options: TraceOptions) -> tuple[dict[str, tuple[Part, str]], dict[str, str]]:
    """Walk down from the root's children: capture what can be captured, descend where not."""
    captured: dict[str, tuple[Part, str]] = {}
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
        part, how = _capture_one(module, rec, relative)
        if part is not None:  # path: the module the part stands for; root_path: what where= names (select.matches)
            captured[path] = (Part(path, part.graph_module, part.inputs, root_path=path, info=part.info), how)
            return
        eager[path] = how
        for name, child in children:
            visit(f"{path}.{name}", child)

    for name, child in model.named_children():
        visit(name, child)
    return captured, eager


def _params_under(model: nn.Module, paths: Sequence[str]) -> int:
    ids: dict[int, int] = {}
    for path in paths:
        for p in model.get_submodule(path).parameters():
            ids[id(p)] = p.numel()
    return sum(ids.values())


class SubtreesFrontend:
    """The root's forward stays eager; its largest capturable submodules become the parts."""

    name = "subtrees"
    live = False  # a snapshot: capture() captures the model as it is now

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> Capture:
        return capture_subtrees(model, inputs, options)


def capture_subtrees(model: nn.Module, inputs: CallInputs | None, options: TraceOptions = TraceOptions()) -> Capture:
    """Keep ``model``'s forward eager and capture its largest capturable submodules, as the ``Capture``'s parts."""
    if inputs is None:
        raise MissingInputsError(
            f"the subtrees frontend runs {type(model).__name__} once on example inputs to see which submodules "
            "run and on what, and none were given: pass example_inputs=(x,) (or a dict of keyword inputs).",
            op=type(model).__name__,
        )
    refuse_uninitialized(model, "subtrees")
    start = time.perf_counter()
    notes = []
    try:
        seen, total_ops = _record(model, *inputs)
    except RuntimeError as exc:  # the forward needs autograd (a tensor hook registered on its activations)
        seen, total_ops = _record(model, *inputs, grad=True)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        notes.append(f"subtrees: the model was recorded with autograd on: without it, its forward raised ({first})")
    captured, eager = _select(model, seen, options)
    order = sorted(captured, key=lambda p: seen[p].order)
    total_params = sum(p.numel() for p in model.parameters())
    covered_params = _params_under(model, order)
    covered_ops = sum(seen[p].ops for p in order)
    info = TraceInfo(frontend="subtrees", notes=notes)
    info.staleness = StalenessGuard(model, "subtrees")  # the root runs eagerly: its hooks run; each part guards its own
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
    flow = part_flow({p: seen[p].calls[0] for p in order if seen[p].calls})  # the picture's edges between parts
    return Capture([captured[p][0] for p in order], info, extras={"part_flow": flow})
