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

``observing_after_errors(compiled, entry)`` wraps the compiled entry: when a call raises, the code
objects whose compile this failure ended get Dynamo's default strategy back: frames on the
exception's way that Dynamo tried to compile during the call (its own list of traced frames), and
the resume functions after a graph break among them (the forward's rest, after a ``print``). Their
compiled entries (the graphs captured before) are kept, so the next call with the earlier shapes
runs the captured graphs again; a new shape is captured again (and, if it raises again, runs
eagerly again, with the same real exception). Frames Dynamo did not try (skipfiles, functions the
user marked ``torch._dynamo.skip`` / ``disable``, FX-generated forwards Dynamo skips on purpose)
and the frames the exception did not pass through keep whatever Dynamo decided for them.
"""

from __future__ import annotations

import types
from typing import Any, Callable

__all__ = ["observing_after_errors", "unskip_codes"]


def _default_strategy() -> Any:
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    return FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)


_RESUME = "torch_dynamo_resume_in"  # Dynamo's resume functions after a graph break (not in its list of traced frames)


def _attempts() -> list[str] | None:
    """Dynamo's per-thread list of the frames it tried to compile (``"name file:line"``), ``None`` on another torch."""
    tls = _TLS[0] if _TLS else _dynamo_tls()
    found = getattr(tls, "traced_frame_infos", None)
    return found if isinstance(found, list) else None


_TLS: list[Any] = []  # Dynamo's thread-local, looked up once (read at every live call: no import statement per call)


def _dynamo_tls() -> Any:
    tls: Any = None
    try:
        from torch._dynamo.eval_frame import dynamo_tls as tls
    except ImportError:
        pass
    _TLS.append(tls)
    return tls


def _failed_codes(tb: types.TracebackType | None, attempted: set[str] | None) -> list[types.CodeType]:
    """The code objects of ``tb``'s frames whose compile this failure ended: frames Dynamo tried to compile in this
    call (``attempted``; any it ever took as input when that list is unknown), or a resume function of one.

    A frame Dynamo did not try (a skipfile, ``torch._dynamo.skip``/``disable``, an FX-generated forward that Dynamo
    skips on purpose) and Dynamo's own transformed bytecode of a compiled frame are left as they are.
    """
    try:
        from torch._dynamo.convert_frame import input_codes, output_codes
    except ImportError:
        return []
    codes: list[types.CodeType] = []
    while tb is not None:
        code = tb.tb_frame.f_code
        tb = tb.tb_next
        if code in codes or code not in input_codes or code in output_codes:
            continue
        if (attempted is None or code.co_name.startswith(_RESUME)
                or f"{code.co_name} {code.co_filename}:{code.co_firstlineno}" in attempted):
            codes.append(code)
    return codes


def unskip_codes(exc: BaseException, attempted: set[str] | None) -> list[types.CodeType]:
    """Give Dynamo's default strategy back to the codes whose compile ``exc`` ended (see ``_failed_codes``).

    ``attempted``: the frames Dynamo tried to compile during the call (``None``: unknown). Returns the codes;
    ``[]`` when this torch has no per-code strategy to set.
    """
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        strategy = _default_strategy()
    except (ImportError, AttributeError):  # another torch: nothing to take back
        return []
    codes = _failed_codes(exc.__traceback__, attempted)
    for code in codes:
        set_code_exec_strategy(code, strategy)
    return codes


def observing_after_errors(compiled: Callable[..., Any], entry: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (``torch.compile(entry, ...)``), whose failed calls leave no code skipped for good.

    ``entry`` is not needed to find the codes (after a graph break the entry frame runs as Dynamo's transformed
    bytecode, another code object); it stays in the signature the live module calls it with.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        log = _attempts()
        start = len(log) if log is not None else 0
        try:
            return compiled(*args, **kwargs)
        except BaseException as exc:
            unskip_codes(exc, set(log[start:]) if log is not None else None)
            raise

    _skipped_by_dynamo(call)
    return call


def _skipped_by_dynamo(fn: Callable[..., Any]) -> None:
    """A region's entry is called inside a compiled caller's eager stretch (``capture.dynamo_regions``), where
    Dynamo's callback is on: this wrapper's own frame must not be compiled (its callee, the region, is)."""
    import torch._dynamo

    torch._dynamo.eval_frame.skip_code(fn.__code__)
