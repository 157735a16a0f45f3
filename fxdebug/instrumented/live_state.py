"""``LiveState``: everything a live (Dynamo) module keeps besides the model, as one typed object.

``LiveInstrumented`` is an ``nn.Module``: an attribute set on it would go through ``nn.Module.__setattr__``
(a tensor or module value registered into the *model's* shared dictionaries) and its ``__getattr__``
falls back to the model's attributes. Its bookkeeping therefore lives in the instance ``__dict__`` under
one key, ``STATE_KEY``, as this dataclass: every field named, typed and explained here, read through
``live_state(module)`` by the modules beside it (``live_skips``, ``live_snapshots``, ``verify``). The model
itself and the example inputs are declared on the module (``dbg.model``, ``dbg.example_inputs``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fxdebug.authoring.pipeline import Pass
from fxdebug.capture.dynamo import DynamoGraph, NodeNamer
from fxdebug.capture.dynamo_skips import Skip
from fxdebug.capture.dynamo_sites import SiteBook
from fxdebug.instrumented.live_parts import _Part
from fxdebug.report.report import Report

__all__ = ["STATE_KEY", "LiveState", "live_state"]

STATE_KEY = "_live_state"  # the one instance-``__dict__`` key of a live module's state


@dataclass(eq=False)
class LiveState:
    """A live module's bookkeeping (see the module docstring); one per ``LiveInstrumented``."""

    passes: list[Pass]
    """The passes every captured graph runs through (``run_part``), as ``instrument()`` was given them; a graph
    captured at a later recompile runs the same ones. ``instrument(dbg, more)`` starts from these."""
    prior: Report | None
    """A report from an earlier run that passes may read (``instrument(..., prior=)``), for every graph."""
    backend: str
    """``instrument(backend=)``: ``"eager"`` (the debugging default) or ``"inductor"``, which compiles the
    instrumented graphs; copies, reloads and ``instrument(dbg, more)`` keep it."""
    compiled: Any
    """The model's entry under ``torch.compile`` with fxdebug's backend for ``backend``: what a call runs."""
    global_hooks: int
    """The number of global module hooks when instrumented: Dynamo does not guard them, so each call checks it."""
    regional: bool = False
    """Whether its repeated blocks are regions of their own, each traced once (``live_regions``): ``FXDEBUG_REGIONS=1``,
    or ``frontend="auto"`` on a model above ``api.LIVE_MODULE_LIMIT`` modules that repeats blocks; copies, reloads
    and ``retrace()`` keep it."""
    parts: dict[DynamoGraph, _Part] = field(default_factory=dict)
    """Every graph Dynamo handed over (one per graph break, recompile and call site), and the snapshots taken of
    what it skipped, mapped to its instrumented part, in capture order: ``parts()``, ``report()``, ``reset()``."""
    namer: NodeNamer = field(default_factory=NodeNamer)
    """Stable node names across every capture of this module, so a recompile's rows merge with the first's."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    """Held while a new graph is instrumented: two threads calling at once instrument a graph once."""
    calls: int = 0
    """Calls of the module since the last ``reset()``: the report's call count and each graph's call index."""
    entries: list[tuple[Any, Any]] = field(default_factory=list)
    """``(composite backend, compiled entry)`` for each outer ``torch.compile(dbg)`` backend met so far: under
    an outer compile the graphs go to that backend's compiler, through an entry compiled for it."""
    ran: bool = False
    """A call has completed: from then on the model's own exceptions are its own, not a typed ``TraceError``
    (the first call is the capture), and Dynamo no longer captures with its first-call settings
    (``dynamo_config(first=True)``: static shapes)."""
    capturing_examples: bool = False
    """``instrument()`` is calling the module on its example inputs: the graphs are captured and instrumented,
    but Dynamo's plain graphs run (no breakpoint, raise-mode check or hook fires at instrument time), and a
    failure of the model's forward names the example inputs."""
    produced: dict[int, tuple[Any, str]] = field(default_factory=dict)
    """While ``instrument()`` captures: each graph's output tensors so far, by id, with a weak reference and the
    node that made them (``live_parts.record_flow``); emptied when the capture ends."""
    feeds: dict[str, str] = field(default_factory=dict)
    """A part's input placeholder -> the node of an earlier part whose output it took, seen on the example inputs:
    what ``render()`` joins the parts of a capture in several graphs (block regions, graph breaks) by."""
    lifted: list[list[Any]] = field(default_factory=list)
    """The user's dispatch modes lifted off the stack for the current call (a stack: calls may nest), put back
    around each captured graph's run (``_call_under_modes``)."""
    sites: SiteBook = field(default_factory=SiteBook)
    """The call-site look-up's counters and tables (``capture/dynamo_sites.py``): one part per call site."""
    saved: list[tuple[Report, Any]] = field(default_factory=list)
    """Each capture's report from before a save/load or copy (``__reduce__``): Dynamo's graphs do not survive
    the process, so the loaded module captures again and its rows merge with these."""
    saved_notes: list[str] = field(default_factory=list)
    """The summary notes of the module before it was saved (graphs, recompiles, graph breaks), for the report."""
    skipped_modules: dict[str, Skip] | None = None
    """Submodule path -> the skip of its forward (Dynamo ran it without a graph), routed through a snapshot at
    each call (``live_skipped_modules``); ``None`` until the first call looked for them."""
    skipped_seen: dict[str, Skip] = field(default_factory=dict)
    """Skipped submodule forwards whose calls are captured as graphs of their own: noted once, not routed."""
    module_snapshots: dict[str, Any] = field(default_factory=dict)
    """Skipped submodule path -> its subtrees snapshot (or the marker that none could be made), made at its first
    routed call."""
    fallback: nn.Module | None = None
    """The snapshot of the whole model that calls run through once Dynamo skipped the model's forward whole."""
    regions: Any = None
    """The model's regions (``capture.dynamo_regions.Regions``: repeated blocks traced once), found at the first
    call; ``None`` until then (``live_regions``)."""
    region_routes: dict[int, list[tuple[Any, Any, Any]]] = field(default_factory=dict)
    """``id(compiler)`` -> ``(module, route, group key)`` for each region: the instance ``forward`` set for one call, entering
    the region's function compiled with fxdebug's backend for that compiler (eager, Inductor, an outer compile's)."""
    region_seen: dict[Any, set[int]] = field(default_factory=dict)
    """Group key -> ``id`` of the instances that ran its region so far, while it is not known to share one graph."""
    region_fresh: dict[Any, int] = field(default_factory=dict)
    """Group key -> instances after the first that needed a graph of their own (three: the group is captured
    inlined from then on)."""
    region_shared: set[Any] = field(default_factory=set)
    """Groups whose second instance ran the first one's graph: their calls are no longer checked."""
    templates: dict[Any, Any] = field(default_factory=dict)
    """Region graph (the one Dynamo handed over for a group) -> ``live_copies.Template``: the group's first
    instrumented instance, of which its later instances' parts are renamed copies."""
    region_copies: int = 0
    """Parts made as copies of their group's first instance (the passes ran once for all of them)."""
    fast: Any = None
    """What the call's fast path (``live_skips``: a call after the first, settings entered only while Dynamo
    compiles) last noted: the graph breaks and capped sites it had seen, so that a call with nothing new skips it."""


def live_state(module: Any) -> LiveState | None:
    """The live module's state; ``None`` for any other module (a snapshot capture, a plain model)."""
    found = getattr(module, "__dict__", {}).get(STATE_KEY)
    return found if isinstance(found, LiveState) else None
