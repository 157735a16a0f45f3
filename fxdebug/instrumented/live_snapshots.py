"""A snapshot of (part of) the model, for what Dynamo skipped: the subtrees frontend's parts inside a live module.

When Dynamo skips a module's whole ``forward`` (``live_skips``, ``live_skipped_modules``), that module is
captured by the subtrees frontend on the arguments of one call (its own forward stays eager, its largest
capturable submodules become graphs, each checked bitwise), with the live module's passes. Its parts join
the live module's parts (``parts()`` keys ``snapshot:<path>``), their rows named as the subtrees frontend
names them (``fc/linear``, module ``fc``), so the live report merges them with the graphs Dynamo captured.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from fxdebug.capture.base import TraceOptions
from fxdebug.capture.dynamo import DynamoGraph
from fxdebug.capture.dynamo_skips import Skip
from fxdebug.errors import FxDebugError
from fxdebug.graph.inputs import Inputs
from fxdebug.instrumented.live_parts import _Part
from fxdebug.report.report import Report

__all__ = ["SnapshotGraph", "add_note", "skip_note", "snapshot_of"]


@dataclass(eq=False)
class SnapshotGraph(DynamoGraph):
    """A part that observes what Dynamo skipped: a submodule captured by the subtrees frontend."""

    path: str = ""

    @property
    def key(self) -> str:
        return f"snapshot:{self.path}"


def add_note(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def skip_note(skip: Skip) -> str:
    return (f"dynamo: skipped frame {skip.function} ({skip.where}): it runs eagerly, without a graph, every call; "
            f"Dynamo's reason: {skip.reason[:400]}")


def snapshot_of(live: Any, module: nn.Module, path: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[Any, list[str], str]:
    """``(instrumented snapshot, its part paths, "")`` of ``module`` (at ``path`` in the model), its parts added to
    ``live``'s; ``(None, [], why)`` when the subtrees frontend cannot capture it."""
    from fxdebug.instrumented.pipeline import capture_module, run_pipeline

    state = live._live_state
    try:
        sub = capture_module("subtrees", module, (tuple(args), dict(kwargs)), TraceOptions())
        sub = run_pipeline(sub, state.passes, Inputs(*args, **kwargs), state.prior)
    except (FxDebugError, RuntimeError, TypeError, ValueError) as exc:
        return None, [], f"{type(exc).__name__}: {str(exc)[:200]}"
    names = []
    for i, (inner, part) in enumerate(sub.parts().items()):
        where = ".".join(p for p in (path, inner) if p)
        names.append(where)
        graph = SnapshotGraph(part, -1, i, code=f"snapshot:{where}", path=where)
        object.__setattr__(part, "_part_report", functools.partial(_prefixed, part._part_report, where))
        state.parts[graph] = _Part(part, [])
    sub.train(module.training)
    return sub, names, ""


def _prefixed(plain: Callable[[], Report], path: str) -> Report:
    """A snapshot part's report with the names the subtrees frontend gives its rows (``fc/linear``, module ``fc``)."""
    rep = plain()
    if not path:
        return rep
    rep.rows = [dict(row, node=f"{path}/{row['node']}", module=f"{path}.{row.get('module') or ''}".strip("."))
                for row in rep.rows]
    for attr in ("first_nonfinite", "first_nonfinite_grad"):
        if getattr(rep, attr, None) is not None:
            setattr(rep, attr, f"{path}/{getattr(rep, attr)}")
    rep.nonfinite_grad_from = [f"{path}/{n}" for n in rep.nonfinite_grad_from]
    return rep
