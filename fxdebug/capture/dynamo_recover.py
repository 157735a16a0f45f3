"""Observation that survives an exception: Dynamo's "skip this code for good" taken back after a failed call.

When the user's code raises while Dynamo traces a frame (the model's own ``ValueError`` in
``forward``, a ``TypeError`` for a wrong argument), Dynamo gives up on the frame ("Observed
exception"), runs it eagerly (so the user gets the real exception from the real line) and, by
default, marks the frame's *code object* as skipped, for every later call: ``ConvertFrameReturn``
applies ``SKIP`` to the code, not to the one frame. For a live module that code is the per-class
entry trampoline (``instrumented/live.py``'s ``_entry``) and the model's ``forward``: from then on
every call of that module, and of every new ``instrument()`` of the same class in the process, ran
eagerly, unobserved (report rows stayed at their old counts, ``NaNCheck(mode="raise")`` let NaN
through).

``observing_after_errors(compiled, entry)`` wraps the compiled entry: when a call raises, every code
object the exception passed through, from the entry frame down to the line that raised, gets
Dynamo's default strategy back. Their compiled entries (the graphs captured before) are kept, so
the next call with the earlier shapes runs the captured graph again; a new shape is captured
again (and, if it raises again, runs eagerly again, with the same real exception). Frames the
exception did not pass through keep whatever Dynamo decided for them (a skipfile, a recompile
limit): nothing is re-attempted that did not fail because of this exception.
"""

from __future__ import annotations

import types
from typing import Any, Callable

__all__ = ["observing_after_errors", "unskip_codes"]


def _default_strategy() -> Any:
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    return FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)


def _codes_below(tb: types.TracebackType | None, entry: types.CodeType) -> list[types.CodeType]:
    """The code objects of ``tb``'s frames from the first frame running ``entry`` down to the raise."""
    codes: list[types.CodeType] = []
    found = False
    while tb is not None:
        code = tb.tb_frame.f_code
        found = found or code is entry
        if found and code not in codes:
            codes.append(code)
        tb = tb.tb_next
    return codes


def unskip_codes(exc: BaseException, entry: types.CodeType) -> list[types.CodeType]:
    """Give Dynamo's default strategy back to the codes ``exc`` passed through below ``entry``; returns them.

    A no-op (returns ``[]``) when this torch has no per-code strategy to set.
    """
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        strategy = _default_strategy()
    except (ImportError, AttributeError):  # another torch: nothing to take back
        return []
    codes = _codes_below(exc.__traceback__, entry)
    for code in codes:
        set_code_exec_strategy(code, strategy)
    return codes


def observing_after_errors(compiled: Callable[..., Any], entry: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (``torch.compile(entry, ...)``), whose failed calls leave no code skipped for good."""
    code = entry.__code__

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except BaseException as exc:
            unskip_codes(exc, code)
            raise

    return call
