"""Which failure a live call's headline names when a new graph failed and an older one is replayed.

When the ops of a graph Dynamo has just captured fail on the call's arguments while their shapes are
learnt, the live module replays the graphs captured before on the same arguments (``_guarded``): a
pass's run-time guard there (``ShapeAssert``'s expected vs produced, ``DeviceCheck``) says what changed
better than the op's error. But an older graph is specialized to the arguments it was captured for
(GPT-2's ``input_ids.view(-1, 8)`` for 8 tokens): an op of it failing on other arguments is not the
model's failure. Issue 35 B15: 20 tokens for 16 positions blamed ``transformer_view`` ("shape '[-1, 8]'
is invalid") while the real failure, the position embedding ``wpe`` indexing out of range, was only the
``__cause__``. Only a guard's error takes the headline; an op failure of a replayed graph does not.

When Dynamo's own capture of these arguments failed on its fake tensors (no new graph to run), its error
names the op that fails on them (``call_function <built-in function mul>(...)``): a replayed graph's op
failure is kept then only when it is that op (``replayed_blame``); a view specialized to the old length
failing first is not.
"""

from __future__ import annotations

from typing import Any, Iterable

from fxdebug.errors import FxDebugError

__all__ = ["guard_error", "replayed_blame"]


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


def replayed_blame(err: FxDebugError | None, fake_failure: BaseException, parts: Iterable[Any]) -> FxDebugError | None:
    """``err`` (a replayed graph's error) when it may take the headline over Dynamo's fake-tensor ``fake_failure``.

    A guard's error may; an op failure only at the op Dynamo's message names (``"{op} {target}("``, the same
    node objects' targets: each part is a copy of a Dynamo graph), found by the failing node's name in ``parts``.
    """
    if err is None or guard_error(err) is not None:
        return err
    text = str(fake_failure)
    for part in parts:
        graph = getattr(part, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.name == err.node:
                return err if f"{node.op} {node.target}(" in text else None
    return None
