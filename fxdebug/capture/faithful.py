"""Constructs a graph must keep so that it computes what the model computes.

Symbolic tracing runs ``forward`` once with proxies and keeps only the tensor operations it saw.
Four things a forward does are lost that way, each giving a graph that runs differently from the
model with no error at all:

* a custom ``torch.autograd.Function`` is traced *through* its ``forward``, so its own
  ``backward`` (straight-through estimators, gradient reversal, fused kernels) is dropped;
* ``with torch.no_grad():`` / ``enable_grad`` / ``set_grad_enabled`` / ``inference_mode`` /
  ``autocast`` regions only
  switched the mode while tracing, so the graph computes gradients (or dtypes) the model does not;
* ``self.avg = ...`` / ``self.calls += 1`` would store a proxy into the user's model, and the
  graph would never perform the update;
* hooks on non-leaf submodules ran once, at trace time.

While ``patched_for_tracing`` is active (one tracer, one thread), ``Function.apply`` on proxies
becomes one ``apply_function`` node that calls the real Function; entering and leaving a
grad-mode or autocast region becomes a pair of nodes that set the mode at run time and restore
the *run-time* previous mode (not the one seen while tracing); and an attribute write on a module
of the traced hierarchy raises ``StateWrite`` before anything is written, so the tracer can keep
the writing module eager (a leaf that performs the update itself) or refuse, naming the line.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.fx import Proxy
from torch.fx.node import has_side_effect
from torch.utils import _pytree as pytree

from fxdebug.capture.faithful_reads import caller_location, reads_scope, targets as reads_targets
from fxdebug.graph.module_state import _MODULE_INTERNALS, _PLAIN, restore_plain_state, saved_plain_state, user_attributes

__all__ = [
    "StateWrite",
    "apply_function",
    "autocast_enter",
    "autocast_exit",
    "clean_graph_meta",
    "function_key",
    "grad_enter",
    "grad_exit",
    "has_call_hooks",
    "inference_enter",
    "inference_exit",
    "sync_attributes",
    "sync_tensors",
    "patched_for_tracing",
]

_FUNCTIONS: dict[str, type] = {}
_ACTIVE = threading.local()
_LOCK = threading.RLock()
_depth = 0  # active patch scopes over all threads (the patches are process-global)


class StateWrite(Exception):
    """A module's forward assigned one of its attributes while being traced (nothing was written)."""

    def __init__(self, module: nn.Module, name: str) -> None:
        kind = "buffer" if name in module._buffers else "parameter" if name in module._parameters else "attribute"
        super().__init__(f"forward assigns the {kind} self.{name} of {type(module).__name__} (a state update "
                         "that a captured graph would not perform)")
        self.name = name
        self.kind = kind
        self.described = f"{'an' if kind == 'attribute' else 'a'} {kind}"  # "a buffer", "an attribute"


# -- run-time targets of the nodes the tracer records --------------------------------------------------
def function_key(cls: type) -> str:
    """A stable name for an ``autograd.Function`` class: ``module.QualName`` (made unique if reused)."""
    key = f"{cls.__module__}.{cls.__qualname__}"
    with _LOCK:
        known = _FUNCTIONS.get(key)
        if known is not None and known is not cls:
            key = f"{key}#{id(cls)}"
        _FUNCTIONS[key] = cls
    return key


def _resolve(key: str) -> type:
    cls = _FUNCTIONS.get(key)
    if cls is not None:
        return cls
    module, _, qualname = key.split("#")[0].rpartition(".")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):  # a class nested in another (a Function defined in a class body)
        obj = getattr(obj, part)
    resolved: type = obj
    _FUNCTIONS[key] = resolved
    return resolved


@has_side_effect
def apply_function(key: str, *args: Any, **kwargs: Any) -> Any:
    """``Function.apply(*args)`` for the autograd.Function named ``key``: its own forward and backward."""
    return _resolve(key).apply(*args, **kwargs)  # type: ignore[attr-defined]


@has_side_effect
def grad_enter(mode: bool) -> bool:
    """Set grad mode for a region of the graph; returns the mode to restore at its end."""
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(mode)
    return prev


@has_side_effect
def grad_exit(prev: bool) -> None:
    """End a grad-mode region: put back the mode that was active when it began (at run time)."""
    torch._C._set_grad_enabled(prev)


@has_side_effect
def autocast_enter(device_type: str, dtype: Any, enabled: bool, cache_enabled: Any) -> Any:
    """Enter ``torch.autocast(...)`` for a region of the graph; returns the context to leave."""
    ctx: contextlib.AbstractContextManager[Any] = torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled,
                                                                 cache_enabled=cache_enabled)
    ctx.__enter__()
    return ctx


@has_side_effect
def autocast_exit(ctx: Any) -> None:
    ctx.__exit__(None, None, None)


@has_side_effect
def inference_enter(mode: bool) -> Any:
    """Enter ``torch.inference_mode(mode)`` for a region of the graph; returns the context to leave."""
    ctx: contextlib.AbstractContextManager[Any] = torch._C._InferenceMode(mode)
    ctx.__enter__()
    return ctx


@has_side_effect
def inference_exit(ctx: Any) -> None:
    ctx.__exit__(None, None, None)


def has_call_hooks(module: nn.Module) -> bool:
    """True if ``module`` has forward, forward-pre or backward hooks of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def sync_attributes(src: nn.Module, dst: nn.Module) -> None:
    """Rebind on ``dst`` every user attribute ``src`` holds a different object for (shell <-> model)."""
    theirs = dst.__dict__
    for k, v in user_attributes(src).items():
        if theirs.get(k, _MISSING) is not v:
            theirs[k] = v


def sync_tensors(src: nn.Module, dst: nn.Module, *, parameters: bool = True) -> None:
    """Point ``dst``'s buffer (and parameter) entries at ``src``'s objects where they differ:
    a forward rebinds a buffer (``self.avg = ...``), ``model.to()`` may replace either."""
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = [(src._buffers, dst._buffers)]
    if parameters:
        pairs.append((src._parameters, dst._parameters))
    for mine, theirs in pairs:
        for k, v in mine.items():
            if theirs.get(k, _MISSING) is not v:
                theirs[k] = v


_MISSING = object()


# -- the patches ------------------------------------------------------------------------------------
def _tracer() -> Any:
    return getattr(_ACTIVE, "tracer", None)


def _has_proxy(tree: Any) -> bool:
    return any(isinstance(v, Proxy) for v in pytree.tree_leaves(tree))


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@contextlib.contextmanager
def patched_for_tracing(tracer: Any, root: nn.Module, *, on_write: str = "raise") -> Iterator[None]:
    """Record Functions, grad-mode and autocast regions through ``tracer``; guard attribute writes.

    ``on_write="raise"`` raises ``StateWrite`` on any attribute assignment to a module of
    ``root``'s hierarchy (symbolic tracing); ``"record"`` lets it through and lists it in
    ``tracer.fxdebug_writes`` (torch.export, which handles buffer updates itself).
    ``tracer`` may be ``None`` (no graph is recorded: export records grad mode by itself).
    """
    global _depth
    prev = (getattr(_ACTIVE, "tracer", None), getattr(_ACTIVE, "modules", None), getattr(_ACTIVE, "on_write", None))
    _ACTIVE.tracer = tracer
    _ACTIVE.modules = {id(m) for m in root.modules()}
    _ACTIVE.on_write = on_write
    _ACTIVE.writes = [] if prev[1] is None else getattr(_ACTIVE, "writes", [])
    _ACTIVE.functions = [] if prev[1] is None else getattr(_ACTIVE, "functions", [])
    _ACTIVE.reads = {} if prev[1] is None else getattr(_ACTIVE, "reads", {})
    with _LOCK:
        if _depth == 0:
            _install()
        _depth += 1
    swapped = _watch_reads(root)
    try:
        with reads_scope(tracer):  # torch's modes read, torch.manual_seed called (faithful_reads)
            yield
    finally:
        for m, cls in swapped:
            object.__setattr__(m, "__class__", cls)
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                _uninstall()
        if tracer is not None:
            tracer.fxdebug_writes = list(_ACTIVE.writes)
            tracer.fxdebug_functions = list(_ACTIVE.functions)
            tracer.fxdebug_reads = dict(_ACTIVE.reads)
        _ACTIVE.tracer, _ACTIVE.modules, _ACTIVE.on_write = prev


def attribute_reads() -> dict[tuple[int, str], tuple[nn.Module, Any]]:
    """Plain attributes (flags, sizes, modes) forward read in the current patch scope: what the
    captured graph may have been specialised to (``if self.use_cache:``), with the values seen."""
    return dict(getattr(_ACTIVE, "reads", {}))


def writes_and_functions() -> tuple[list[tuple[nn.Module, str, str | None]], list[tuple[type, str | None]]]:
    """Attribute writes and Functions seen in the current (innermost) patch scope."""
    return list(getattr(_ACTIVE, "writes", [])), list(getattr(_ACTIVE, "functions", []))


_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _targets() -> list[tuple[Any, str, Any]]:
    from torch.amp.autocast_mode import autocast
    from torch.autograd import grad_mode
    from torch.autograd.function import Function

    return [
        (Function, "apply", classmethod(_apply)),
        (grad_mode.no_grad, "__enter__", _make_enter(False)),
        (grad_mode.no_grad, "__exit__", _grad_region_exit),
        (grad_mode.enable_grad, "__enter__", _make_enter(True)),
        (grad_mode.enable_grad, "__exit__", _grad_region_exit),
        (grad_mode.set_grad_enabled, "__init__", _set_grad_init),
        (grad_mode.set_grad_enabled, "__exit__", _grad_region_exit),
        (grad_mode.inference_mode, "__enter__", _inference_enter),
        (grad_mode.inference_mode, "__exit__", _inference_exit),
        (autocast, "__enter__", _autocast_enter),
        (autocast, "__exit__", _autocast_exit),
        (nn.Module, "__setattr__", _setattr),
        *reads_targets(),
    ]


def _install() -> None:
    for owner, name, replacement in _targets():
        # kept after uninstalling: a patched __exit__ another thread entered before may still run
        _ORIGINALS.setdefault((owner, name), owner.__dict__[name])
        setattr(owner, name, replacement)


def _uninstall() -> None:
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)


def _original(owner: Any, name: str) -> Any:
    return _ORIGINALS[(owner, name)]


@contextlib.contextmanager
def _unrecorded() -> Iterator[None]:
    """Run torch's own implementation without recording (no_grad.__enter__ calls set_grad_enabled)."""
    tracer = getattr(_ACTIVE, "tracer", None)
    _ACTIVE.tracer = None
    try:
        yield
    finally:
        _ACTIVE.tracer = tracer


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    from torch.autograd.function import Function

    tracer = _tracer()
    if getattr(_ACTIVE, "modules", None) is not None:
        _ACTIVE.functions.append((cls, caller_location()))
    if tracer is not None and _has_proxy((args, kwargs)):
        return tracer.create_proxy("call_function", apply_function, (function_key(cls), *args), kwargs,
                                   name=_snake(cls.__name__))
    return _original(Function, "apply").__func__(cls, *args, **kwargs)


def _make_enter(mode: bool) -> Callable[[Any], None]:
    from torch.autograd import grad_mode

    owner = grad_mode.enable_grad if mode else grad_mode.no_grad

    def enter(self: Any) -> None:
        tracer = _tracer()
        if tracer is not None:
            self._fxdebug_prev = tracer.create_proxy("call_function", grad_enter, (mode,), {})
        with _unrecorded():
            _original(owner, "__enter__")(self)

    return enter


def _grad_region_exit(self: Any, *exc: Any) -> None:
    from torch.autograd import grad_mode

    proxy = self.__dict__.pop("_fxdebug_prev", None)
    tracer = _tracer()
    if tracer is not None and proxy is not None:
        tracer.create_proxy("call_function", grad_exit, (proxy,), {})
    for owner in (grad_mode.no_grad, grad_mode.enable_grad, grad_mode.set_grad_enabled):
        if isinstance(self, owner):
            with _unrecorded():
                _original(owner, "__exit__")(self, *exc)  # torch's __exit__ returns None: nothing suppressed
            return None
    return None


def _set_grad_init(self: Any, mode: bool) -> None:
    from torch.autograd import grad_mode

    tracer = _tracer()
    if tracer is not None:
        self._fxdebug_prev = tracer.create_proxy("call_function", grad_enter, (bool(mode),), {})
    with _unrecorded():
        _original(grad_mode.set_grad_enabled, "__init__")(self, mode)


def _inference_enter(self: Any) -> None:
    from torch.autograd import grad_mode

    tracer = _tracer()
    if tracer is None:
        _original(grad_mode.inference_mode, "__enter__")(self)
        return None
    self._fxdebug_ctx = tracer.create_proxy("call_function", inference_enter, (bool(self.mode),), {})
    return None


def _inference_exit(self: Any, *exc: Any) -> None:
    from torch.autograd import grad_mode

    proxy = self.__dict__.pop("_fxdebug_ctx", None)
    if proxy is None:
        _original(grad_mode.inference_mode, "__exit__")(self, *exc)
        return None
    tracer = _tracer()
    if tracer is not None:
        tracer.create_proxy("call_function", inference_exit, (proxy,), {})
    return None


def _autocast_enter(self: Any) -> Any:
    from torch.amp.autocast_mode import autocast

    tracer = _tracer()
    if tracer is None:
        return _original(autocast, "__enter__")(self)
    self._fxdebug_ctx = tracer.create_proxy(
        "call_function", autocast_enter, (self.device, self.fast_dtype, self._enabled, self._cache_enabled), {})
    return self  # the region only switches modes at run time; proxies compute nothing now


def _autocast_exit(self: Any, *exc: Any) -> Any:
    from torch.amp.autocast_mode import autocast

    proxy = self.__dict__.pop("_fxdebug_ctx", None)
    tracer = _tracer()
    if proxy is None:
        return _original(autocast, "__exit__")(self, *exc)
    if tracer is not None:
        tracer.create_proxy("call_function", autocast_exit, (proxy,), {})
    return False


_FX_NAMES = ("_tensor_constant", "_fx_", "_param_constant")
_WATCHED: dict[tuple[type, frozenset[str]], type] = {}
_WATCHED_SET: set[type] = set()


def _watched_class(cls: type, names: frozenset[str]) -> type:
    """A subclass of ``cls`` whose plain attributes ``names`` are properties that record each read.

    Only those reads pay a Python call (a data descriptor wins over the instance dict); every
    other attribute, parameter and submodule is found as fast as before. The subclass keeps the
    name, module and qualname of ``cls``, so leaf decisions and module stacks read the same.
    """
    key = (cls, names)
    sub = _WATCHED.get(key)
    if sub is None:
        def prop(name: str) -> property:
            def get(self: nn.Module) -> Any:
                value = self.__dict__[name]
                reads = getattr(_ACTIVE, "reads", None)  # None in other threads running the model meanwhile
                if reads is not None and getattr(_ACTIVE, "modules", None) is not None:
                    reads.setdefault((id(self), name), (self, value))
                return value

            def set_(self: nn.Module, value: Any) -> None:
                self.__dict__[name] = value

            return property(get, set_)

        body: dict[str, Any] = {n: prop(n) for n in names}
        body.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
        sub = _WATCHED[key] = type(cls.__name__, (cls,), body)
        _WATCHED_SET.add(sub)
    return sub


def unwatched(value: Any) -> Any:
    """``value`` with every read-recording subclass replaced by the user's class (module stacks that
    torch recorded while tracing name ``type(module)``; the graph must pickle and read as the model's)."""
    if isinstance(value, type):
        return value.__bases__[0] if value in _WATCHED_SET else value
    if isinstance(value, dict):
        fixed = {k: unwatched(v) for k, v in value.items()}
        if any(fixed[k] is not v for k, v in value.items()):
            value = type(value)(fixed) if type(value) in (dict, OrderedDict) else fixed
        return value
    if type(value) in (tuple, list):
        items = [unwatched(v) for v in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value)) else value
    return value


def clean_graph_meta(graph: Any) -> None:
    """Apply ``unwatched`` to every node's metadata."""
    if not _WATCHED_SET:
        return
    for node in graph.nodes:
        for key, value in list(node.meta.items()):
            fixed = unwatched(value)
            if fixed is not value:
                node.meta[key] = fixed


def _watch_reads(root: nn.Module) -> list[tuple[nn.Module, type]]:
    """Swap each module's class for one that records reads of its plain attributes; returns the undo."""
    swapped = []
    for m in {id(m): m for m in root.modules()}.values():
        cls = type(m)
        if "__getattribute__" in vars(cls) or "__slots__" in vars(cls) or isinstance(m, torch.jit.ScriptModule):
            continue
        names = frozenset(k for k, v in m.__dict__.items() if type(v) in _PLAIN and k not in _MODULE_INTERNALS
                          and not k.startswith("_fxdebug") and not isinstance(getattr(cls, k, None), property))
        if names:
            object.__setattr__(m, "__class__", _watched_class(cls, names))
            swapped.append((m, cls))
    return swapped


def _setattr(self: nn.Module, name: str, value: Any) -> None:
    modules = getattr(_ACTIVE, "modules", None)
    if modules is not None and id(self) in modules and not name.startswith(_FX_NAMES) and name != "forward":
        if _ACTIVE.on_write == "raise":
            raise StateWrite(self, name)
        _ACTIVE.writes.append((self, name, caller_location()))
    _original(nn.Module, "__setattr__")(self, name, value)
