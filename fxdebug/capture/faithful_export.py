"""What ``torch.export`` would capture differently from the model, found before it is trusted.

Non-strict ``torch.export`` runs the real Python on fake tensors, so grad-mode regions and buffer
updates come out right. Four things do not, in torch 2.13, and each would give a graph that runs
differently from the model with no error:

* a custom ``torch.autograd.Function`` is inlined: its ``forward``'s aten ops are recorded and
  its own ``backward`` is dropped;
* assignments to plain Python attributes (``self.calls += 1``) happen while exporting and are
  undone afterwards; the graph never performs them;
* a submodule's ``self.avg = ...`` (buffer reassignment) is lost: only the root's own buffers
  are written back by the exported graph;
* hooks on submodules are traced through once: their tensor ops are kept, their Python side
  effects (appending to a list, counting) are not.

The root's own hooks are not a problem: fxdebug runs them at every call of the instrumented
module, so the root is exported without them (a shell whose hook dictionaries are empty) and
``check`` refuses the other four with a ``TraceError`` naming the module and the line, so that
``frontend="auto"`` moves on to the subtrees frontend, which keeps such modules eager.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from typing import Any, Iterator

import torch
from torch import nn
from torch.fx import Graph

from fxdebug.errors import TraceError
from fxdebug.graph.module_sharing import CALL_HOOKS
from fxdebug.capture.faithful import (
    attribute_reads,
    caller_location,
    has_call_hooks,
    patched_for_tracing,
    writes_and_functions,
)
from fxdebug.capture.faithful_reads import TORCH, draws, fast_path_modules, seeds, torch_reads

__all__ = ["ExportWatch", "export_shell", "watched_export"]


def export_shell(model: nn.Module) -> nn.Module:
    """``model`` without its own call hooks (same children, parameters and buffers), for exporting."""
    if not has_call_hooks(model):
        return model
    shell = copy.copy(model)
    for name in CALL_HOOKS:
        if name in model.__dict__:
            object.__setattr__(shell, name, OrderedDict())
    return shell


def _check_hooks(model: nn.Module) -> None:
    for path, module in model.named_modules():
        if path and has_call_hooks(module):
            raise TraceError(
                f"module '{path}' ({type(module).__name__}) has forward/backward hooks; torch.export would run "
                "them once while capturing and keep only their tensor ops, not their Python effects. Use "
                "frontend='symbolic' or 'subtrees' (hooked modules are called as modules there), or remove the hooks.",
                module=path, op=type(module).__name__)


class ExportWatch(list[TraceError]):
    """What ``watched_export`` saw: the refusals (the list itself, first one first) and ``guards``,
    the plain attributes forward read as ``(module path, name, value)``."""

    def __init__(self) -> None:
        super().__init__()
        self.guards: list[tuple[str, str, Any]] = []
        self.buffer_writes: list[tuple[str, str | None]] = []  # ("ema.avg", line) reassigned by forward
        self.fast_paths: list[nn.Module] = []  # modules whose fused fast path the trace passed over (faithful_reads)

    def check_buffer_updates(self, graph: Graph) -> None:
        """Refuse a graph that lost a buffer update the forward made (``self.avg = ...`` in a submodule:
        torch 2.13's non-strict export records it only for the root's own buffers)."""
        updated = {str(n.args[0].target) for n in graph.nodes
                   if n.op == "call_function" and "copy_" in str(n.target) and n.args
                   and getattr(n.args[0], "op", None) == "get_attr"}
        for name, where in self.buffer_writes:
            if name not in updated:
                owner = name.rpartition(".")[0]
                at = f" at {where}" if where else ""
                raise TraceError(
                    f"the forward of '{owner or '<root>'}'{at} reassigns the buffer {name}, and torch.export's graph "
                    "does not perform that update. Use frontend='symbolic' (that module stays eager) or 'subtrees', "
                    "or update the buffer in place (self.avg.mul_(0.9).add_(...)).",
                    module=owner, op="buffer update")

    @property
    def problems(self) -> list[TraceError]:
        return self


@contextlib.contextmanager
def _tensor_hooks_seen() -> Iterator[list[tuple[str, str | None]]]:
    """Record ``Tensor.register_hook`` / ``register_post_accumulate_grad_hook`` calls made while exporting."""
    seen: list[tuple[str, str | None]] = []
    originals = {name: torch.Tensor.__dict__[name] for name in _TENSOR_HOOKS if name in torch.Tensor.__dict__}

    def recorder(name: str, original: Any) -> Any:
        def register(self: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append((name, caller_location()))
            return original(self, *args, **kwargs)
        return register

    for name, original in originals.items():
        setattr(torch.Tensor, name, recorder(name, original))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


_TENSOR_HOOKS = ("register_hook", "register_post_accumulate_grad_hook")


@contextlib.contextmanager
def watched_export(model: nn.Module) -> Iterator[ExportWatch]:
    """Around ``torch.export``: collects what the export got wrong (see above) and what it read."""
    _check_hooks(model)
    watch = ExportWatch()
    problems = watch.problems
    paths = {id(m): p for p, m in model.named_modules()}
    with patched_for_tracing(None, model, on_write="record"), _tensor_hooks_seen() as hooks:
        try:
            yield watch
        finally:
            writes, functions = writes_and_functions()
            watch.guards = [(paths[k[0]], k[1], v) for k, (_, v) in attribute_reads().items() if k[0] in paths]
            watch.guards += [(TORCH, k, v) for k, v in torch_reads().items()]  # torch's modes forward read
            reseeds = seeds()
            drawn = draws()
            watch.fast_paths = fast_path_modules()
    for name, where in drawn[:1]:
        at = f" at {where}" if where else ""
        problems.append(TraceError(
            f"the forward of {type(model).__name__}{at} draws {name}(); torch.export keeps the value drawn while "
            "capturing as a constant, so every call would reuse it. Use frontend='auto' (drawn at every call), "
            "'symbolic' or 'subtrees' (the drawing module stays eager), or draw with torch (torch.rand).",
            module="", op=name))
    for where in reseeds[:1]:
        at = f" at {where}" if where else ""
        problems.append(TraceError(
            f"the forward of {type(model).__name__}{at} calls torch.manual_seed; torch.export runs it once while "
            "capturing and the graph would never reseed, so its random draws would differ from the model's. Use "
            "frontend='symbolic' (it reseeds at every call) or frontend='auto'.", module="", op="torch.manual_seed"))
    for method, where in hooks[:1]:
        at = f" at {where}" if where else ""
        problems.append(TraceError(
            f"the forward of {type(model).__name__}{at} registers a tensor hook (Tensor.{method}); torch.export "
            "drops it from the graph, so gradients would differ from the model's. Use frontend='symbolic' or "
            "'subtrees' (the hook is registered at every call), or frontend='auto'.", module="", op=f"Tensor.{method}"))
    for cls, where in functions:
        at = f" at {where}" if where else ""
        problems.append(TraceError(
            f"{type(model).__name__} calls the autograd.Function {cls.__qualname__}{at}; torch.export inlines its "
            "forward and drops its backward, so gradients would differ. Use frontend='symbolic' or 'subtrees', "
            "which keep the Function as one node that calls it.", module="", op=cls.__qualname__))
        break
    for module, name, where in writes:
        if name in module._buffers:  # torch.export performs it when it records it: checked on the graph
            path = paths.get(id(module), "")
            watch.buffer_writes.append((f"{path}.{name}" if path else name, where))
            continue
        if name in module._parameters or name.startswith("_fxdebug"):
            continue
        path = paths.get(id(module), "")
        at = f" at {where}" if where else ""
        problems.append(TraceError(
            f"the forward of {path or type(model).__name__} ({type(module).__name__}){at} assigns self.{name}, "
            "a Python attribute; torch.export undoes that after capturing and the graph would never perform it. "
            "Use frontend='subtrees' (keeps that module eager) or make it a buffer.",
            module=path, op=type(module).__name__))
        break
