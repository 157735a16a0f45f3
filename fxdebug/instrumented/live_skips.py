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

What only matters while Dynamo compiles is done only then. Dynamo's config entries for a live
capture (``dynamo_config``), its warnings silenced (``QUIET``), the skips and graph breaks recorded:
once a call has run, the compiled entry's callback enters them around each compile
(``compile_scope``, through ``capture.dynamo_compiling``), and a call whose guards all hold
(the steady state) pays none of them; its notes are looked at again only when something compiled,
the graph breaks known for the class grew or a site passed its cap. The first call, a model with
regions, skipped submodules routed through snapshots, or a torch whose callback cannot be scoped
run as before, every context around the whole call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from fxdebug.capture.dynamo_names import root_codes
from fxdebug.capture.dynamo_settings import dynamo_config, quiet_warnings
from fxdebug.capture.dynamo_skips import BREAKS, SKIPPED, Skip, recorded_breaks, recorded_skips
from fxdebug.capture.dynamo_regions import is_region_break
from fxdebug.instrumented.live_regions import NotShared, forget_entry, routed_regions
from fxdebug.instrumented.live_skipped_modules import find_skipped_modules, routed_skipped_modules
from fxdebug.instrumented.live_snapshots import add_note, skip_note, snapshot_of

__all__ = ["QUIET", "SCOPED", "compile_scope", "run_watched", "watched"]

# Dynamo warns when it graph-breaks on a builtin it cannot trace (random.random): the report's notes name the break;
# it reads .grad of a resumed frame's non-leaf inputs while it captures (its warning, not the user's)
QUIET = quiet_warnings(r".*\.grad attribute of a Tensor that is not a leaf", r"Dynamo does not know how to trace")
SCOPED = "fxdebug_compile_scoped"  # True on a compiled entry whose callback enters compile_scope() (live_parts)


def watched(live: Any, entry: Callable[..., Any]) -> Callable[..., Any]:
    """What the live call runs: ``entry`` (Dynamo's) with its skips noted, or the snapshot that replaced it."""
    return functools.partial(run_watched, live, entry)


def run_watched(live: Any, entry: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One call through ``entry`` with Dynamo's settings for a live capture, its skips and breaks noted."""
    state = live._live_state
    if state.fallback is not None:
        return _through_snapshot(live, state.fallback, *args, **kwargs)
    if (state.ran and not state.skipped_modules and state.regions is not None and not state.regions
            and not state.capturing_examples and getattr(entry, SCOPED, False)):
        return _run_fast(live, entry, args, kwargs)
    now = _NOW
    saved, now.live = now.live, None  # (a live module called inside this one's fast call: not its compiles)
    try:
        with dynamo_config(not state.ran), QUIET():
            return _run(live, entry, *args, **kwargs)
    finally:
        now.live = saved


class _Now(threading.local):
    live: Any = None  # the live module whose fast-path call runs now in this thread
    skips: list[Skip] | None = None  # what Dynamo skipped while it compiled in that call (None: nothing compiled)


_NOW = _Now()


@dataclass
class _Seen:
    """What a live module's fast path last noted (``LiveState.fast``): so that a call with nothing new skips it."""

    breaks: int = -1  # graph breaks known for the model's class (``BREAKS``)
    capped: int = -1  # sites past their cap (``SiteBook.capped``)


def compile_scope() -> contextlib.AbstractContextManager[Any]:
    """What a live entry's Dynamo callback enters around each compile (``capture.dynamo_compiling``): the live
    capture's settings and the recorders, for the fast-path call running now in this thread (else nothing: the
    first call's contexts are around the whole call)."""
    live = _NOW.live
    return contextlib.nullcontext() if live is None else _Compiling(live)


class _Compiling:
    def __init__(self, live: Any) -> None:
        self.live = live
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        stack, state = self.stack, self.live._live_state
        stack.enter_context(dynamo_config(not state.ran))
        stack.enter_context(QUIET())
        self.skips = stack.enter_context(recorded_skips())
        stack.enter_context(recorded_breaks(type(self.live._model)))

    def __exit__(self, *exc: Any) -> None:
        self.stack.__exit__(*exc)  # (fills self.skips)
        found = _NOW.skips
        _NOW.skips = self.skips if found is None else found + [s for s in self.skips if s not in found]


def _run_fast(live: Any, entry: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_run`` for a call after the first: nothing set around it; the notes looked at only when something changed."""
    state = live._live_state
    sites = state.sites
    sites.graphs_this_call = 0
    now = _NOW
    saved = now.live, now.skips
    now.live, now.skips = live, None
    try:
        out = entry(*args, **kwargs)
        skips = now.skips
    finally:
        now.live, now.skips = saved
    seen = state.fast
    if seen is None:
        seen = state.fast = _Seen()
    known = BREAKS.get(type(live._model))
    if skips is not None or seen.breaks != len(known or ()) or seen.capped != len(sites.capped):
        _notes_after(live, skips or [], args, kwargs)
        seen.breaks, seen.capped = len(BREAKS.get(type(live._model)) or ()), len(sites.capped)
    elif not sites.graphs_this_call:
        _root_skipped(live, [], args, kwargs)
    return out


def _run(live: Any, entry: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    state = live._live_state
    state.sites.graphs_this_call = 0
    with routed_skipped_modules(live), recorded_skips() as skips, recorded_breaks(type(live._model)):
        captured = len(state.parts)
        try:
            with routed_regions(live, kwargs) as routed:
                out = (live._model if routed.root_eager else entry)(*args, **kwargs)
        except NotShared:  # instrument()'s example call: a group of blocks needs a graph each: captured inlined
            for graph in list(state.parts)[captured:]:  # the parts of the abandoned try
                del state.parts[graph]
            forget_entry(live._model)  # the entry's graphs broke at every block: traced again, blocks inlined
            state.sites = type(state.sites)()
            with routed_regions(live, kwargs):
                out = entry(*args, **kwargs)
    _notes_after(live, skips, args, kwargs)
    return out


def _notes_after(live: Any, skips: list[Skip], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """After a call: notes for its graph breaks, capped sites and skipped frames; the model observed another way
    when Dynamo skipped its forward whole."""
    state = live._live_state
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
        _root_skipped(live, skips, args, kwargs)


def _root_skipped(live: Any, skips: list[Skip], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """No graph ran in the call: when Dynamo skipped the model's forward, the model is observed another way."""
    model = live._model
    root = next((SKIPPED[c] for c in root_codes(model) if c in SKIPPED), None)
    if root is not None:
        if root not in skips:  # skipped before, in another live module of this class: Dynamo skips it for good
            add_note(live.trace_info.notes, skip_note(root))
        _observe_otherwise(live, root, args, kwargs)


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
