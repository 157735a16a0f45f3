"""Staleness of a snapshot graph: the model a symbolic, export or subtrees graph was captured from is still that model.

(Not the live Dynamo capture, ``fxdebug.instrumented.live``: this module is for the snapshot frontends.)

A symbolic, export or subtrees capture is a graph of the model *as it was*. Users keep changing
the model afterwards. Most changes the graph follows by construction (weights, buffers, a hook on a
module the graph calls as a module); some the snapshot cache follows by capturing again (training
flags, attribute values forward read, torch's grad mode, export call signatures:
``fxdebug.instrumented.snapshot_cache``); a few make the graph stale, silently, and are checked here:

* a submodule replaced (``model.fc = nn.Linear(...)``) or added: the graph runs the old one;
* a hook registered on a module the graph inlined (its forward was traced through): it never runs;
  a global module hook, likewise;
* ``model.train()`` on the model (not the instrumented module): the root's own flag
  (``if self.training:`` in the root forward) is the instrumented module's, not the model's;
* a full backward hook registered on the root after the capture: torch decides full vs. legacy
  semantics by a flag of the module object, which the instrumented module has its own copy of;
* a call with a keyword argument the symbolic graph has no input for, or with a value for an
  argument pinned to ``None`` while tracing: torch.fx raises a bare ``AssertionError`` or
  ``TypeError``.

``StalenessGuard.check`` runs before every call, inside the snapshot cache's one check
(``snapshot_cache.check_call``). Its fast path is two integer comparisons and one walk over the
model's child dictionaries (identity only); the hook check runs only when torch's hook-handle
counter moved since the last call. What follows by itself (the root flag, the backward
hook flag) is followed; what cannot be followed raises a ``TraceError`` that names the change and
says what to do (instrument again, or ``frontend="auto"``, whose Dynamo guards capture again).
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable

from torch import nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

from fxdebug.capture.faithful_reads import would_take_fast_path
from fxdebug.errors import TraceError

__all__ = ["StalenessGuard", "global_hook_count"]

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


_GLOBAL_DICTS = [getattr(_torch_module, name) for name in _GLOBAL_HOOKS if hasattr(_torch_module, name)]


def global_hook_count() -> int:
    return sum(map(len, _GLOBAL_DICTS))  # torch mutates these dicts in place: the objects stay


class StalenessGuard:
    """What a capture assumed about the model; ``check`` before each call of the instrumented module.

    Args:
        model: the module captured (the root the graph stands for).
        frontend: the frontend's name, for messages.
        inlined: modules whose forward the graph traced through (their hooks would not run).
        signature: for symbolic graphs, the forward's argument names the graph takes and those pinned
            to a value (``{"mask": None}``); ``None`` when the frontend handles signatures itself.
    """

    def __init__(self, model: nn.Module, frontend: str, inlined: Iterable[nn.Module] = (),
                 signature: tuple[frozenset[str], dict[str, Any], bool] | None = None) -> None:
        self.model: nn.Module | None = model
        self.frontend = frontend
        paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        # modules with children: a child replaced or added there makes the graph stale (a leaf module gaining
        # children is not watched: it costs a comparison per module per call for a change nobody makes)
        self._edges = [(m._modules, dict(m._modules), paths.get(id(m), "")) for m in _unique(model.modules())
                       if m._modules]
        self._inlined = [(m, paths.get(id(m), "?")) for m in _unique(inlined) if m is not model]
        self._handles = RemovableHandle.next_id
        self._globals = global_hook_count()
        self._training = model.training
        self.signature = signature
        # (path, module) whose fused fast path the trace passed over (faithful_reads.fast_path_modules)
        self.fast_paths: list[tuple[str, nn.Module]] = []
        # (module, attribute, constants module, buffer): a plain tensor attribute the graph reads (self.mask),
        # its constant pointed at the module's current tensor before each call
        self.tensor_attrs: list[tuple[nn.Module, str, nn.Module, str]] = []

    # -- copying: a copy of the instrumented module is not the model's any more --------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> "StalenessGuard":
        inert = StalenessGuard.__new__(StalenessGuard)
        inert.__dict__.update(self.__dict__, model=None)
        return inert

    def __getstate__(self) -> dict[str, Any]:
        return {"model": None, "frontend": self.frontend, "signature": None, "_edges": [], "_inlined": [],
                "_handles": 0, "_globals": 0, "_training": self._training, "fast_paths": [],
                "tensor_attrs": []}

    # -- the check --------------------------------------------------------------------------------
    def check(self, gm: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        model = self.model
        if model is None:
            return
        if self.signature is not None and (kwargs or len(args) > 1):
            self._check_signature(model, args, kwargs)
        if self.fast_paths:
            self._check_fast_paths(model)
        for owner, name, consts, key in self.tensor_attrs:
            now = owner.__dict__.get(name)
            if now is not consts._buffers.get(key) and now is not None:
                consts._buffers[key] = now
        for live, seen, path in self._edges:
            if live != seen:
                self._changed_children(model, live, seen, path)
        if RemovableHandle.next_id != self._handles:  # a hook (of any kind) was registered since
            self._check_hooks(model)
            self._handles = RemovableHandle.next_id
        if global_hook_count() > self._globals:
            raise TraceError(
                f"a global module hook (torch.nn.modules.module.register_module_forward_hook and kin) was registered "
                f"after {type(model).__name__} was captured by frontend='{self.frontend}'; the graph traced through "
                "the modules it would run on, so it would never run. Instrument again after registering it (modules "
                "with hooks are then called as modules), or use frontend='auto'.", module="", op="global hook")

    def _changed_children(self, model: nn.Module, live: dict[str, Any], seen: dict[str, Any], path: str) -> None:
        for name in sorted(set(live) | set(seen), key=lambda k: (k not in seen, k)):
            old, new = seen.get(name), live.get(name)
            if old is new:
                continue
            where = f"{path}.{name}" if path else name
            what = ("was added" if old is None else "was removed" if new is None else
                    f"was replaced ({type(old).__name__} -> {type(new).__name__}, a new object)")
            raise TraceError(
                f"submodule '{where}' of {type(model).__name__} {what} after the model was captured by "
                f"frontend='{self.frontend}'; the captured graph would still run the old module tree. "
                "Instrument the model again (fxdebug.instrument(model, passes, example_inputs)), or use "
                "frontend='auto', whose guards capture the model again when its modules change.",
                module=where, op=type(new if new is not None else old).__name__)

    def _check_hooks(self, model: nn.Module) -> None:
        for m, path in self._inlined:
            for name in _HOOK_DICTS:
                if getattr(m, name, None):
                    raise TraceError(
                        f"a hook ({name.strip('_').replace('_', ' ')}) was registered on '{path}' "
                        f"({type(m).__name__}) after {type(model).__name__} was captured by frontend='{self.frontend}'; "
                        "the graph traced through that module's forward, so the hook would never run. Instrument "
                        "again after registering it (a hooked module is then called as a module, its hooks at every "
                        "call), or use frontend='auto'.", module=path, op=type(m).__name__)

    def _check_fast_paths(self, model: nn.Module) -> None:
        for path, m in self.fast_paths:
            if would_take_fast_path(m):
                raise TraceError(
                    f"'{path or '<root>'}' ({type(m).__name__}) takes torch's fused fast path in this call (eval mode, "
                    f"no gradient wanted), but the graph frontend='{self.frontend}' captured holds its regular path, "
                    "which computes other values (padded positions of a nested-tensor batch above all). Use "
                    "frontend='auto', call it with gradients enabled, or turn the fast path off for the model too "
                    "(torch.backends.mha.set_fastpath_enabled(False)).", module=path, op=type(m).__name__)

    def _check_signature(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self.signature is not None
        names, pinned, var_keyword = self.signature
        try:
            bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        except TypeError:
            return  # the model itself rejects the call; let it say so
        for name, value in bound.items():
            if name in pinned and not _same_value(value, pinned[name]):
                raise TraceError(
                    f"{type(model).__name__} is called with {name}={_short(value)}, but the symbolic graph was traced "
                    f"with {name} pinned to {_short(pinned[name])} (the example inputs left it at its default, and forward "
                    f"branches on it). Instrument with example inputs that pass {name} "
                    f"(fxdebug.Inputs(x, {name}=...)), or use frontend='auto' or 'export', which capture each "
                    "call signature.", module="", op=f"{name}=")
            if name not in names and name not in pinned and not var_keyword:
                raise TraceError(
                    f"{type(model).__name__} is called with {name}=..., an argument the symbolic graph has no input "
                    f"for. Instrument with example inputs that pass it, or use frontend='auto' or 'export'.",
                    module="", op=f"{name}=")

    # -- following what can be followed -----------------------------------------------------------
    def follow(self, gm: nn.Module) -> None:
        """The root's flags that live on the module object: training, full-backward-hook semantics."""
        model = self.model
        if model is None or model is gm:
            return
        state = gm.__dict__.get("_fxdebug_followed_root")
        if state is None:  # the first guard seen is the user's model; captures for other modes are copies
            state = gm.__dict__["_fxdebug_followed_root"] = _Root(model, self._training)
        root = state.model
        if root is None:
            return
        if root.training != state.seen:  # model.train() / model.eval() on the model, not on the instrumented module
            state.seen = root.training
            gm.__dict__["training"] = root.training
        full = root.__dict__.get("_is_full_backward_hook")
        if gm.__dict__.get("_is_full_backward_hook") is not full:
            gm.__dict__["_is_full_backward_hook"] = full


class _Root:
    """The model whose root flags an instrumented module follows, and the flag last seen on it.
    A copy of the instrumented module holds copies of the modules: it follows nothing."""

    def __init__(self, model: nn.Module | None, seen: bool) -> None:
        self.model = model
        self.seen = seen

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Root":
        return _Root(None, self.seen)

    def __reduce__(self) -> Any:
        return (_Root, (None, self.seen))


def _unique(modules: Iterable[nn.Module]) -> list[nn.Module]:
    return list({id(m): m for m in modules}.values())


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, (bool, int, float, str)) and type(a) is type(b):
        return bool(a == b)
    return False


def _short(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__}{tuple(shape) if shape is not None else ''}"
