"""Which failure a live call's headline names when a new graph failed and an older one is replayed.

When the ops of a graph Dynamo has just captured fail on the call's arguments while their shapes are
learnt, the live module replays the graphs captured before on the same arguments (``_guarded``): a
pass's run-time guard there (``ShapeAssert``'s expected vs produced, ``DeviceCheck``) says what changed
better than the op's error. But an older graph is specialized to the arguments it was captured for
(GPT-2's ``input_ids.view(-1, 8)`` for 8 tokens): an op of it failing on other arguments is not the
model's failure. Issue 35 B15: 20 tokens for 16 positions blamed ``transformer_view`` ("shape '[-1, 8]'
is invalid") while the real failure, the position embedding ``wpe`` indexing out of range, was only the
``__cause__``. Only a guard's error takes the headline; an op failure of a replayed graph does not.
"""

from __future__ import annotations

from fxdebug.errors import FxDebugError

__all__ = ["guard_error"]


def guard_error(err: FxDebugError | None) -> FxDebugError | None:
    """``err`` when a pass's run-time guard raised it; ``None`` when it is an op of the replayed graph failing.

    An op failure is the typed error ``raise_op_failure`` raises *from* the op's own exception (a torch
    ``RuntimeError``, ``IndexError``, ...); a guard's error is raised by the pass itself, caused by nothing else.
    """
    if err is None:
        return None
    cause = err.__cause__
    if cause is not None and cause is not err and not isinstance(cause, FxDebugError):
        return None
    return err
