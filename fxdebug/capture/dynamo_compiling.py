"""Work a live call needs only while Dynamo compiles, done only then: around Dynamo's callback, not every call.

A live module's call ran its compiled entry inside several contexts: Dynamo's config entries a live
capture needs (``dynamo_config``: hook guards, recompile limits, RNN capture), Dynamo's own
warnings silenced (``quiet_warnings``), the frames Dynamo skips and the graph breaks it logs
recorded (``dynamo_skips``). Each of them matters only while Dynamo traces a frame, and Dynamo
traces only inside its eval-frame callback: a frame whose cached guards hold runs its compiled code
without calling it. Set and put back around every call, they cost ~25 µs a call (a tiny GPT-2's
compiled forward is ~400 µs).

``on_compile(compiled, scope)`` makes the callback of a ``torch.compile``'d function enter
``scope()`` around each of its invocations (each frame Dynamo is asked to compile or recompile:
the entry's, a resume function after a graph break, a function it calls): the steady state pays
nothing, a guard failure pays once. It changes the class of that one callback object (Dynamo's
``CatchErrorsWrapper``) to a subclass, so every attribute Dynamo and fxdebug read from it (the
backend chain ``_torchdynamo_orig_backend``, its hooks) is as it was. On a torch whose
``torch.compile`` is built otherwise it returns ``False`` and the caller keeps its per-call
contexts.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

__all__ = ["on_compile", "scoped"]

_SCOPE = "_fxdebug_compile_scope"
_CLASSES: dict[type, type] = {}


def _callback_of(compiled: Callable[..., Any]) -> Any:
    """The eval-frame callback ``torch.compile`` built for ``compiled`` (its ``compile_wrapper``'s), or ``None``."""
    code, cells = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None)
    if code is None or not cells or "callback" not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index("callback")].cell_contents
    except ValueError:  # an empty cell
        return None


def _scoped_class(base: type) -> type:
    made = _CLASSES.get(base)
    if made is None:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - the callback Dynamo calls
            with self.__dict__[_SCOPE]():
                return base.__call__(self, *args, **kwargs)

        made = _CLASSES[base] = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    return made


def on_compile(compiled: Callable[..., Any], scope: Callable[[], contextlib.AbstractContextManager[Any]]) -> bool:
    """Enter ``scope()`` around every invocation of ``compiled``'s Dynamo callback; ``False`` where it cannot."""
    callback = _callback_of(compiled)
    if callback is None or not callable(callback) or not hasattr(callback, "__dict__"):
        return False
    base = type(callback)
    if type(base.__call__) is not type(on_compile):  # a Python class's __call__ (CatchErrorsWrapper)
        return False
    try:
        callback.__class__ = _scoped_class(base)
    except TypeError:
        return False
    callback.__dict__[_SCOPE] = scope
    return True


def scoped(compiled: Callable[..., Any]) -> bool:
    """``compiled``'s callback enters a scope around each compile (``on_compile`` succeeded on it)."""
    callback = _callback_of(compiled)
    return callback is not None and _SCOPE in getattr(callback, "__dict__", {})
