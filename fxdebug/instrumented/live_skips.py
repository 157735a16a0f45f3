"""Nothing unobserved without a word: the frames Dynamo skipped in a live call, noted, and the model's
forward observed another way when Dynamo skipped it whole.

``watched(live, entry)`` is what the live module calls instead of its compiled entry. While the
call runs, ``capture.dynamo_skips.recorded_skips`` gathers the frames Dynamo skipped for the first
time; each becomes a note naming the function, its file:line and Dynamo's reason. When the
model's own forward was skipped (no graph ran in the call: a graph break in a loop, say), the
call's output was right but nothing was observed; the model is then captured by the subtrees
frontend on that call's arguments (its root stays eager, its largest capturable submodules become
graphs, each checked bitwise) with the same passes, and the next calls run through it. Its parts
join the live module's (``live_snapshots``), so ``report()`` merges their rows; a note says which
way the model was observed, or why it could not be. A submodule whose forward Dynamo skipped is
observed the same way, through a snapshot of that submodule (``live_skipped_modules``).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

from fxdebug.capture.dynamo_names import root_codes
from fxdebug.capture.dynamo_skips import BREAKS, SKIPPED, Skip, recorded_breaks, recorded_skips
from fxdebug.capture.dynamo_regions import is_region_break
from fxdebug.instrumented.live_regions import NotShared, forget_entry, routed_regions
from fxdebug.instrumented.live_skipped_modules import find_skipped_modules, routed_skipped_modules
from fxdebug.instrumented.live_snapshots import add_note, skip_note, snapshot_of

__all__ = ["watched"]


def watched(live: Any, entry: Callable[..., Any]) -> Callable[..., Any]:
    """What the live call runs: ``entry`` (Dynamo's) with its skips noted, or the snapshot that replaced it."""
    fallback = live._live_state.fallback
    if fallback is not None:
        return functools.partial(_through_snapshot, live, fallback)
    return functools.partial(_run, live, entry)


def _run(live: Any, entry: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    state = live._live_state
    state.sites.graphs_this_call = 0
    with routed_skipped_modules(live), recorded_skips() as skips, recorded_breaks(type(live._model)):
        captured = len(state.parts)
        try:
            with routed_regions(live, kwargs):
                out = entry(*args, **kwargs)
        except NotShared:  # instrument()'s example call: a group of blocks needs a graph each: captured inlined
            for graph in list(state.parts)[captured:]:  # the parts of the abandoned try
                del state.parts[graph]
            forget_entry(live._model)  # the entry's graphs broke at every block: traced again, blocks inlined
            state.sites = type(state.sites)()
            with routed_regions(live, kwargs):
                out = entry(*args, **kwargs)
    notes = live.trace_info.notes
    _note_breaks(live, notes)
    for note in state.sites.capped.values():  # (capture/dynamo_sites.py)
        add_note(notes, note)
    for skip in skips:
        add_note(notes, skip_note(skip))
    if skips or state.skipped_modules is None:  # a submodule's forward skipped (now, or by another live module)
        for skip in find_skipped_modules(live).values():  # also those Dynamo skipped before, for good
            add_note(notes, skip_note(skip))
    if not state.sites.graphs_this_call:
        model = live._model
        root = next((SKIPPED[c] for c in root_codes(model) if c in SKIPPED), None)
        if root is not None:
            if root not in skips:  # skipped before, in another live module of this class: Dynamo skips it for good
                add_note(notes, skip_note(root))
            _observe_otherwise(live, root, args, kwargs)
    return out


def _note_breaks(live: Any, notes: list[str]) -> None:
    """A note for each graph break Dynamo logged that no captured graph ends at (nothing before it in that frame
    was a graph: the break comes first, or it broke inside ``torch.utils.checkpoint``)."""
    known = BREAKS.get(type(live._model))
    if not known:
        return
    ends = {g.where.split(" ", 1)[0] for g in live.graphs() if getattr(g, "where", "")}
    for b in known:
        if is_region_break(b.reason):  # a region's boundary (live_regions), named in its own note
            continue
        if f"{os.path.basename(b.file)}:{b.line}" not in ends:
            add_note(notes, f"dynamo: graph break at {b.where}: the code from there to the next graph ran eagerly, "
                            f"unobserved (no graph ends there); Dynamo's reason: {b.reason[:300]}")


def _observe_otherwise(live: Any, root: Skip, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Capture the model by the subtrees frontend on this call's arguments; later calls run through it."""
    state = live._live_state
    name = type(live._model).__name__
    sub, parts, why = snapshot_of(live, live._model, "", args, kwargs)
    if sub is None:
        add_note(live.trace_info.notes,
                 f"dynamo: {name}'s forward ran without a graph (Dynamo skipped it, {root.where}) and could not be "
                 f"observed another way: the subtrees frontend failed ({why}); the report has no rows for it. Make the "
                 "forward capturable (torch.cond, no data-dependent branch in a loop) or instrument it with "
                 "frontend='subtrees' and example_inputs.")
        return
    state.fallback = sub
    sub.train(live.training)
    add_note(live.trace_info.notes,
             f"dynamo: {name}'s forward ran without a graph (Dynamo skipped it, {root.where}); observed instead through "
             f"a snapshot of its submodules (the subtrees frontend, from the arguments of call {state.calls}): "
             f"{len(parts)} part(s): {', '.join(parts) or 'none'}. The root's own code between them runs eagerly, "
             "unobserved, and the calls before it were not observed; a submodule replaced on the model afterwards is "
             "not seen (instrument again).")


def _through_snapshot(live: Any, sub: Any, *args: Any, **kwargs: Any) -> Any:
    if sub.training != live.training:
        sub.train(live.training)
    return sub(*args, **kwargs)
