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

__all__ = ["backend_note", "live_call", "modes_on", "outer_now"]

_OWN_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def live_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``dbg(...)``: the live call; through ``nn.Module``'s call when hooks were registered on the live module itself
    (``fully_shard(dbg)`` gathers the parameters in its pre-forward hook; a user's hook on ``dbg``). The model's own
    hooks run inside the live call, as the model's.

    Under an outer ``torch.compile(dbg)`` this frame is skipped, not traced (``_skip``): it runs with the outer
    eval-frame callback still set. The callback is switched off here (fxdebug's own Python is never compiled) and
    its backend, the user's (Inductor with their ``mode=`` / ``options=``), compiles the instrumented graphs."""
    prior = _set_eval_frame(None)
    saved = getattr(_NOW, "outer", None)
    _NOW.outer = outer_compiler(prior) if prior else None
    try:
        if any(self.__dict__.get(name) for name in _OWN_HOOKS):
            return nn.Module._call_impl(self, *args, **kwargs)
        return self._live_call(*args, **kwargs)
    finally:
        _NOW.outer = saved
        _set_eval_frame(prior)


def outer_now() -> Any:
    """The outer ``torch.compile``'s backend for the live call running now in this thread (``None``: none)."""
    return getattr(_NOW, "outer", None)


_NOW = threading.local()
_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame
_skip: Any = getattr(torch._dynamo.decorators, "skip", None) or torch._dynamo.disable  # (not traced, not disabled)
live_call = _skip(live_call)


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
