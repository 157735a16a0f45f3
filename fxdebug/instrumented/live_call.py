"""How a live module is called, and which backend ran its graphs.

``live_call`` is the live module's ``__call__``. For an outer ``torch.compile(dbg, mode=..., options=...)`` it is
a skipped frame (Dynamo runs it, does not trace it, and leaves its eval-frame callback set): the callback is
switched off for fxdebug's own Python and its backend (the user's Inductor) compiles the instrumented graphs
(``capture.dynamo_backends``). ``backend_note`` is the report's note saying which backend ran.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import _pop_mode, _push_mode

from fxdebug.capture.dynamo import DynamoGraph
from fxdebug.capture.dynamo_backends import compiler_label, outer_compiler
from fxdebug.instrumented.live_parts import _Part

__all__ = ["backend_note", "live_call", "live_forward", "modes_on", "outer_now"]


def live_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``dbg(...)``: the live call; through ``nn.Module``'s call when hooks were registered on the live module itself
    (``fully_shard(dbg)`` gathers the parameters in its pre-forward hook; a user's hook on ``dbg``). The model's own
    hooks run inside the live call, as the model's.

    Under an outer ``torch.compile(dbg)`` this frame is skipped, not traced (``_skip``): it runs with the outer
    eval-frame callback still set. The callback is switched off here (fxdebug's own Python is never compiled) and
    its backend, the user's (Inductor with their ``mode=`` / ``options=``), compiles the instrumented graphs."""
    prior = _set_eval_frame(None)
    if prior is None and _NOW.outer is None:  # an eager call (no outer compile now or around it): nothing to switch
        if _own_hooks(self.__dict__):
            return nn.Module._call_impl(self, *args, **kwargs)
        return self._live_call(*args, **kwargs)
    saved = _NOW.outer
    _NOW.outer = outer_compiler(prior) if prior else None
    try:
        if _own_hooks(self.__dict__):
            return nn.Module._call_impl(self, *args, **kwargs)
        return self._live_call(*args, **kwargs)
    finally:
        _NOW.outer = saved
        _set_eval_frame(prior)


def _own_hooks(state: dict[str, Any]) -> bool:
    return bool(state.get("_forward_pre_hooks") or state.get("_forward_hooks") or state.get("_backward_pre_hooks")
                or state.get("_backward_hooks"))


def live_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``dbg.forward(...)`` (and what ``nn.Module``'s call runs when ``dbg`` has hooks of its own): the live call.

    A frame Dynamo skips, as ``live_call``, but not marked disabled: ``torch.compile(dbg)`` then enters through
    ``dbg.__call__`` directly instead of a wrapper frame that would graph-break on a disabled forward."""
    prior = _set_eval_frame(None)
    if prior is None:  # inside live_call (its hooks path) or an eager call: the backend live_call found holds
        return self._live_call(*args, **kwargs)
    saved, _NOW.outer = _NOW.outer, (outer_compiler(prior) if prior else None)
    try:
        return self._live_call(*args, **kwargs)
    finally:
        _NOW.outer = saved
        _set_eval_frame(prior)


def outer_now() -> Any:
    """The outer ``torch.compile``'s backend for the live call running now in this thread (``None``: none)."""
    return _NOW.outer


class _Now(threading.local):
    outer: Any = None  # the outer compile's backend of the live call running in this thread


_NOW = _Now()
_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame
_skip: Any = getattr(torch._dynamo.decorators, "skip", None) or torch._dynamo.disable  # (not traced, not disabled)
live_call = _skip(live_call)
torch._dynamo.eval_frame.skip_code(live_forward.__code__)


def backend_note(parts: dict[DynamoGraph, _Part]) -> str:
    """Which backend ran the instrumented graphs since the last ``reset()`` (``Report.notes``)."""
    ran = [g for g, p in parts.items() if p.calls] or list(parts)
    labels = [compiler_label(g.compiler) for g in ran if g.compiler is not None]
    if not labels:
        return "backend: eager: the instrumented graphs ran as captured, not compiled"
    kinds = ", ".join(dict.fromkeys(labels))
    return (f"backend: {kinds} compiled the instrumented graphs ({len(labels)} of {len(ran)} that ran)"
            + ("" if len(labels) == len(ran) else "; the others ran eagerly"))


@contextlib.contextmanager
def modes_on(modes: list[Any]) -> Iterator[None]:
    """Push ``modes`` (top of the stack first, as ``_disable_current_modes`` lists them) back for a block."""
    pushed = 0
    try:
        for mode in reversed(modes):
            _push_mode(mode)
            pushed += 1
        yield
    finally:
        for _ in range(pushed):
            _pop_mode()
