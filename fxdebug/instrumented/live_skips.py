"""Nothing unobserved without a word: the frames Dynamo skipped in a live call, noted, and the model's
forward observed another way when Dynamo skipped it whole.

``watched(live, entry)`` is what the live module calls instead of its compiled entry. While the
call runs, ``capture.dynamo_skips.recorded_skips`` gathers the frames Dynamo skipped for the first
time; each becomes a note naming the function, its file:line and Dynamo's reason. When the
model's own forward was skipped (no graph ran in the call: a graph break in a loop, say), the
call's output was right but nothing was observed; the model is then captured by the subtrees
frontend on that call's arguments (its root stays eager, its largest capturable submodules become
graphs, each checked bitwise) with the same passes, and the next calls run through it. Its parts
join the live module's (``parts()`` keys ``snapshot:<path>``), so ``report()`` merges their rows;
a note says which way the model was observed, or why it could not be.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from fxdebug.capture.base import TraceOptions
from fxdebug.capture.dynamo import DynamoGraph
from fxdebug.capture.dynamo_sites import root_codes
from fxdebug.capture.dynamo_skips import SKIPPED, Skip, recorded_skips
from fxdebug.errors import FxDebugError
from fxdebug.graph.inputs import Inputs
from fxdebug.instrumented.live_parts import _Part
from fxdebug.report.report import Report

__all__ = ["SnapshotGraph", "watched"]


@dataclass(eq=False)
class SnapshotGraph(DynamoGraph):
    """A part that observes what Dynamo skipped: a submodule captured by the subtrees frontend."""

    path: str = ""

    @property
    def key(self) -> str:
        return f"snapshot:{self.path}"


def watched(live: Any, entry: Callable[..., Any]) -> Callable[..., Any]:
    """What the live call runs: ``entry`` (Dynamo's) with its skips noted, or the snapshot that replaced it."""
    fallback = live.__dict__.get("_fallback")
    if fallback is not None:
        return functools.partial(_through_snapshot, live, fallback)
    return functools.partial(_run, live, entry)


def _run(live: Any, entry: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    state = live.__dict__
    state["_graphs_this_call"] = 0
    with recorded_skips() as skips:
        out = entry(*args, **kwargs)
    notes = live.trace_info.notes
    for skip in skips:
        _add(notes, _skip_note(skip))
    if not state.get("_graphs_this_call"):
        model = live._model
        root = next((SKIPPED[c] for c in root_codes(model) if c in SKIPPED), None)
        if root is not None:
            if root not in skips:  # skipped before, in another live module of this class: Dynamo skips it for good
                _add(notes, _skip_note(root))
            _observe_otherwise(live, root, args, kwargs)
    return out


def _skip_note(skip: Skip) -> str:
    return (f"dynamo: skipped frame {skip.function} ({skip.where}): it runs eagerly, without a graph, every call; "
            f"Dynamo's reason: {skip.reason[:400]}")


def _add(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def _observe_otherwise(live: Any, root: Skip, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Capture the model by the subtrees frontend on this call's arguments; later calls run through it."""
    from fxdebug.instrumented.pipeline import capture_module, run_pipeline

    state = live.__dict__
    model = live._model
    name = type(model).__name__
    inputs = Inputs(*args, **kwargs)
    try:
        sub = capture_module("subtrees", model, (tuple(args), dict(kwargs)), TraceOptions())
        sub = run_pipeline(sub, state["_passes"], inputs, state.get("_prior"))
    except (FxDebugError, RuntimeError, TypeError, ValueError) as exc:
        _add(live.trace_info.notes,
             f"dynamo: {name}'s forward ran without a graph (Dynamo skipped it, {root.where}) and could not be observed "
             f"another way: the subtrees frontend failed ({type(exc).__name__}: {str(exc)[:200]}); the report has no "
             "rows for it. Make the forward capturable (torch.cond, no data-dependent branch in a loop) or "
             "instrument it with frontend='subtrees' and example_inputs.")
        return
    parts = sub.parts()
    for i, (path, part) in enumerate(parts.items()):
        graph = SnapshotGraph(part, -1, i, code=f"snapshot:{path}", path=path)
        object.__setattr__(part, "_part_report", functools.partial(_prefixed, part._part_report, path))
        state["_parts"][graph] = _Part(part, [])
    state["_fallback"] = sub
    sub.train(live.training)
    _add(live.trace_info.notes,
         f"dynamo: {name}'s forward ran without a graph (Dynamo skipped it, {root.where}); observed instead through a "
         f"snapshot of its submodules (the subtrees frontend, from the arguments of call {state.get('_calls', 0)}): "
         f"{len(parts)} part(s): {', '.join(p or '<root>' for p in parts) or 'none'}. The root's own code between "
         "them runs eagerly, unobserved, and the calls before it were not observed; a submodule replaced on the model "
         "afterwards is not seen (instrument again).")


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


def _through_snapshot(live: Any, sub: Any, *args: Any, **kwargs: Any) -> Any:
    if sub.training != live.training:
        sub.train(live.training)
    return sub(*args, **kwargs)
