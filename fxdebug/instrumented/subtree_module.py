"""The module for a per-subtree ``Capture``: the root's ``forward`` eager, its captured parts as graphs.

``fxdebug.capture.subtrees`` records the model once and returns a ``Capture`` whose ``Part``s are
the largest submodules it could capture (each checked bitwise on the inputs it saw). Here the
module is built from that data: every part becomes an ``InstrumentedGraphModule`` graph over its submodule's
own objects, and the eager root is a shallow copy of the model object whose child dictionaries are
fresh copies; every parameter and buffer is the model's own, so the model is never touched.

Each captured submodule is one of ``SubtreeInstrumented.parts()``; the pass pipeline, the
report and the picture loop over the parts (``instrumented.pipeline.run_pipeline``, ``Instrumented.report``), so
nothing here repeats them.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from torch import Tensor, nn
from torch.fx import Graph
from torch.utils import _pytree as pytree

from fxdebug.graph.module_sharing import CALL_HOOKS
from fxdebug.capture.base import Capture
from fxdebug.capture.faithful import sync_attributes, sync_tensors
from fxdebug.capture.faithful_reads import would_take_fast_path
from fxdebug.errors import UsageError
from fxdebug.graph.meta import KEY, GraphRecord, fx_meta
from fxdebug.graph.serialize import deserialize_graph, serialize_graph
from fxdebug.instrumented.module import InstrumentedGraphModule

__all__ = ["SubtreeInstrumented", "subtrees_module"]


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




def _unhooked(part: InstrumentedGraphModule) -> InstrumentedGraphModule:
    """The part runs inside its module's own call, which runs the module's hooks: the part runs none."""
    for name in CALL_HOOKS:
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

    def __init__(self, module: nn.Module, part: InstrumentedGraphModule, path: str = "", notes: list[str] | None = None) -> None:
        self.module = module
        self.part = part
        self.path = path
        self.notes = notes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        d = self.module.__dict__
        mine = d.pop("forward", None)
        try:
            if _fast_path_now(self.module, self.part, (args, kwargs)):
                self._note()
                return self.module.forward(*args, **kwargs)  # the module's own forward: its fused fast path
            return self.part(*args, **kwargs)
        finally:
            if mine is not None:
                d["forward"] = mine

    def _note(self) -> None:
        note = (f"subtrees: part '{self.path}' ({type(self.module).__name__}) ran eagerly, unobserved, in calls where "
                "torch's fused fast path applies (eval mode, no gradient wanted, or a nested-tensor input): its graph "
                "holds the regular path, which computes other values")
        if self.notes is not None and note not in self.notes:
            self.notes.append(note)


_FAST_TYPES = (nn.TransformerEncoderLayer, nn.TransformerEncoder, nn.MultiheadAttention)


def _fast_path_now(module: nn.Module, part: InstrumentedGraphModule, inputs: Any) -> bool:
    """True if ``module`` would take torch's fused fast path in this call (its part's graph cannot):
    a nested-tensor input, or a fast-path module traced through in a call where that path applies."""
    if any(isinstance(v, Tensor) and v.is_nested for v in pytree.tree_leaves(inputs)):
        return True
    guard = getattr(part.trace_info, "staleness", None)
    checked = [m for _, m in getattr(guard, "fast_paths", ())]
    if isinstance(module, _FAST_TYPES):
        checked.append(module)
    return any(would_take_fast_path(m) for m in checked)


def _same_class(module: nn.Module, part: InstrumentedGraphModule, path: str, notes: list[str]) -> bool:
    """False (and noted once) when ``module``'s class changed since its part was captured.

    ``register_parametrization`` after ``instrument`` swaps the module's class for one whose ``weight``
    is a property over ``parametrizations``: the part's graph, captured over the plain ``weight``, would
    read a parameter that is gone. That module then runs its own forward, eagerly and unobserved.
    """
    captured = part.__dict__.get("_fxdebug_module_class")
    if captured is None or type(module) is captured:
        return True
    note = (f"subtrees: part '{path}' ({captured.__name__}) changed class after instrument (a parametrization "
            f"registered on it: now {type(module).__name__}); it runs eagerly, unobserved. Instrument again to observe it.")
    if note not in notes:
        notes.append(note)
    return False


def _adopt_attributes(gm: InstrumentedGraphModule, module: nn.Module) -> None:
    """Plain attributes the parent's code may read (``config``, ``layer_idx``) carried onto ``gm``."""
    for key, value in vars(module).items():
        if key.startswith("_") or key in gm.__dict__ or hasattr(type(gm), key) or key == "training":
            continue
        if isinstance(value, (Tensor, nn.Module)) or callable(value):
            continue
        gm.__dict__[key] = value


class SubtreeInstrumented(InstrumentedGraphModule):
    """The root's ``forward`` runs eagerly; its captured submodules are ``InstrumentedGraphModule`` graphs.

    Its own graph only lists the captured parts, for reports and pictures; calling it calls the
    eager root (a shallow copy of the model sharing every parameter, buffer and child).
    """

    _shell: nn.Module

    @classmethod
    def _assemble(cls, shell: nn.Module, parts: dict[str, InstrumentedGraphModule], meta: dict[str, Any],
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
                if not _same_class(module, part, path, self.trace_info.notes):
                    continue
                routed.append((module, module.__dict__.get("forward")))
                module.__dict__["forward"] = _Routed(module, part, path, self.trace_info.notes)
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

    def parts(self) -> dict[str, InstrumentedGraphModule]:
        """``{module path: InstrumentedGraphModule}`` for every captured submodule, in execution order."""
        return dict(self.__dict__["_fxdebug_parts"])

    def replace_part(self, path: str, new: InstrumentedGraphModule) -> "SubtreeInstrumented":
        parts = self.__dict__["_fxdebug_parts"]
        if path not in parts:
            raise KeyError(f"no captured part {path!r}; parts: {list(parts)}")
        parts[path] = _unhooked(new)
        return self

    def _summary_notes(self) -> list[str]:
        return list(self.trace_info.notes)

    def learn_shapes(self, example_inputs: Any) -> None:
        """The parts learnt their shapes on the inputs they saw while the model was recorded."""

    def retrace(self) -> InstrumentedGraphModule:
        raise UsageError("a model captured per subtree cannot be traced again; call fxdebug.instrument on the "
                         "original model with all the passes you want.")

    def __deepcopy__(self, memo: dict[int, Any]) -> "SubtreeInstrumented":
        shell = copy.deepcopy(self._shell, memo)
        parts = {p: copy.deepcopy(part, memo) for p, part in self.parts().items()}
        return SubtreeInstrumented._assemble(shell, parts, copy.deepcopy(self.meta, memo),
                                             copy.deepcopy(self.graph, memo))

    def __reduce__(self) -> Any:
        return (_load_subtrees, (self._shell, self.parts(), self.meta, serialize_graph(self.graph)))


def _load_subtrees(shell: nn.Module, parts: dict[str, InstrumentedGraphModule], meta: dict[str, Any],
                   rows: Any) -> SubtreeInstrumented:
    return SubtreeInstrumented._assemble(shell, parts, meta, deserialize_graph(rows))


def subtrees_module(model: nn.Module, capture: Capture) -> SubtreeInstrumented:
    """The module for a per-subtree ``capture`` of ``model``: an eager root routing to its parts' graphs."""
    parts: dict[str, InstrumentedGraphModule] = {}
    for part in capture.parts:
        module = model.get_submodule(part.path)
        gm = InstrumentedGraphModule.from_capture(module, Capture([part], part.info))
        _adopt_attributes(gm, module)
        gm.__dict__["_fxdebug_module_class"] = type(module)  # a class swapped later (parametrization): see _same_class
        parts[part.path] = _unhooked(gm)
    shell = _shell(model)  # the captured modules stay in the tree; their forward is routed to the part per call
    meta = {KEY: GraphRecord(trace=capture.info, model_type=type(model).__name__)}
    meta[KEY].extras.update(capture.extras)  # part_flow: the picture's edges between parts
    return SubtreeInstrumented._assemble(shell, parts, meta)
