"""Which call site a graph Dynamo handed over runs at: one row per tensor per place in the model's call tree.

Dynamo keys what it captures by code object: a helper behind a graph break (torchvision's box
helpers, called from the box head, the mask head, the keypoint head) is one frame, its graph one
graph, whichever call ran it. Named by code location alone, two call sites would share every
row: their statistics merged, and ``ShapeAssert`` comparing the mask head's ``(N, 5)`` boxes with
the box head's ``(N, 4)``.

``call_site`` reads the Python stack while the graph runs (a handful of frames, from the graph's
own frame up to the innermost ``nn.Module`` call) and names the site:

* ``module`` — the path of the innermost module whose call ran the frame (``""``: the model);
* ``caller`` — the first frame above the graph's own function (``file:function:line``; a
  resume function after a graph break counts as the function it resumes);
* ``occurrence`` — how many times this graph's code already ran at that (module, caller) in this
  call of the model (a helper called twice on one line, or in a loop).

The root forward and its resume functions are the *trivial* site (model, no caller, first
occurrence): their graphs keep the names they always had, and the root forward's own graph is
recognised by its code without reading the stack at all.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

from fxdebug.capture.dynamo import DynamoGraph
from fxdebug.capture.dynamo_names import ENTRY_DIR, root_codes
from fxdebug.capture.dynamo_regions import REGION_NAME

__all__ = ["Site", "SiteBook", "SitedGraph", "at_site", "call_site", "root_codes"]

_MODULE_PY = os.path.normcase(os.path.abspath(sys.modules[nn.Module.__module__].__file__ or ""))
_TORCH = os.path.join(os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__ or ""))), "")
_FXDEBUG = os.path.join(os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "")
_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+?)_at_\d+$")
_USER, _SKIP, _MODULE_CALL = 0, 1, 2
_INFOS: dict[CodeType, tuple[int, tuple[str, str], str, bool]] = {}
_MAX_DEPTH = 200
MAX_OCCURRENCES = 32  # calls of one graph at one place in one call that get rows of their own


@dataclass(frozen=True)
class Site:
    """One place in the model's call tree where a graph's frame ran (see the module docstring)."""

    module: str
    caller: str
    occurrence: int
    function: str  # the graph's own function (a resume function's original name)

    @property
    def trivial(self) -> bool:
        return not self.module and not self.caller and not self.occurrence

    @property
    def label(self) -> str:
        """Short and readable: ``box_head/boxes``, ``boxes#1`` (the second call at one place)."""
        where = "/".join(p for p in (self.module, self.function) if p)
        return where + (f"#{self.occurrence}" if self.occurrence else "")


@dataclass(eq=False)
class SitedGraph(DynamoGraph):
    """A graph Dynamo handed over, at one call site: instrumented once per site, with its own node names."""

    site: Site | None = None
    base: DynamoGraph | None = None  # the graph Dynamo handed over

    @property
    def key(self) -> str:
        return f"{self.frame}/{self.recompile}" + (f"@{self.site.label}" if self.site is not None else "")


@dataclass
class SiteBook:
    """What the call-site look-up keeps for one live module (its ``LiveState.sites``), between graph runs."""

    counts: dict[tuple[Any, ...], int] = field(default_factory=dict)
    """``(frame, module path, caller)`` -> runs so far in the current call: the next run's occurrence. The live
    module starts a fresh one at each call, so occurrences count within one call of the model."""
    graphs_this_call: int = 0
    """Graphs run in the current call: none means Dynamo skipped the model's forward whole (``live_skips``)."""
    roots: set[str] | None = None
    """The code keys of the model's own forward (``root_codes``), found at the first graph run: its graphs are at the
    trivial site, recognised without a stack walk."""
    paths: dict[int, str] = field(default_factory=dict)
    """``id(module)`` -> its path in the model: the site's module path without a ``named_modules`` walk per run."""
    capped: dict[tuple[Any, ...], str] = field(default_factory=dict)
    """The note for each site past ``MAX_OCCURRENCES`` (a loop), which the live call adds to the report's notes."""
    sited: dict[tuple[Any, ...], DynamoGraph] = field(default_factory=dict)
    """``(graph, path, caller, occurrence, function)`` -> the one graph for that site: each site is one part."""


def _cached_info(code: CodeType) -> tuple[int, tuple[str, str], str, bool]:
    """``_info(code)``, from the cache where the code object can be a key: a code object hashes its constants, and
    code Dynamo generated may hold a dict among them (torchvision's Mask R-CNN paste_masks_in_image), which is not
    hashable; such a code is described afresh at each look-up."""
    try:
        return _INFOS.get(code) or _info(code)
    except TypeError:
        return _info(code, cache=False)


def _info(code: CodeType, cache: bool = True) -> tuple[int, tuple[str, str], str, bool]:
    """``(kind, (file, function), file's base name, in fxdebug)`` of a code object, cached."""
    info = _INFOS.get(code) if cache else None
    if info is None:
        name = os.path.normcase(os.path.abspath(code.co_filename))
        ours = name.startswith(_FXDEBUG)
        if name == _MODULE_PY:
            kind = _MODULE_CALL if code.co_name == "_call_impl" else _SKIP
        elif ours or (name.startswith(_TORCH) and name[len(_TORCH):].startswith("_")):
            kind = _SKIP  # fxdebug, and torch's private machinery (torch/_dynamo, torch/_compile.py, ...)
        else:
            kind = _USER
        m = _RESUME.match(code.co_name)
        info = (kind, (code.co_filename, m.group(1) if m else code.co_name), os.path.basename(code.co_filename), ours)
        if cache and len(_INFOS) < 20_000:  # transformed code objects of many recompiles: bounded
            _INFOS[code] = info
    return info


def _walk(frame: FrameType | None) -> tuple[tuple[str, str] | None, tuple[str, str, int] | None, Any]:
    """``(graph's (file, function), caller (base name, function, line), module object)`` from the frame running
    the graph upwards, to the innermost ``nn.Module`` call."""
    own: tuple[str, str] | None = None
    caller: tuple[str, str, int] | None = None
    depth = 0
    while frame is not None and depth < _MAX_DEPTH:
        kind, here, base, ours = _cached_info(frame.f_code)
        if kind == _MODULE_CALL:
            return own, caller, frame.f_locals.get("self")
        if kind == _USER:
            if own is None:
                own = here
            elif caller is None and here != own:
                caller = (base, here[1], frame.f_lineno)
        elif ours and own is not None:
            break  # the live module's entry (its trampoline): out of the model
        frame = frame.f_back
        depth += 1
    return own, caller, None


def _module_path(book: SiteBook, model: nn.Module, module: Any) -> str:
    if module is None or module is model:
        return ""
    paths = book.paths
    found = paths.get(id(module))
    if found is None:  # a module not seen yet (replaced since): the table again
        paths.clear()
        for name, sub in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(sub), name)
        found = paths.setdefault(id(module), type(module).__name__)  # outside the model: its type
    return found


def call_site(book: SiteBook, model: nn.Module, graph: DynamoGraph, frame: FrameType | None) -> Site | None:
    """The site ``graph`` runs at now (``frame``: the dispatcher's caller); ``None`` for the root forward's own graph.

    ``book`` is the live module's: the occurrence counters of the current call, the module-path table, the
    root forward's code. Counts an occurrence: once per graph run.
    """
    found = _locate(book, model, graph, frame)
    return None if found is None else _site(found)


def _locate(book: SiteBook, model: nn.Module, graph: DynamoGraph,
            frame: FrameType | None) -> tuple[str, tuple[str, str, int] | None, int, str] | None:
    """``(module path, caller, occurrence, function)`` of this run of ``graph``; ``None`` at the root forward."""
    book.graphs_this_call += 1
    roots = book.roots
    if roots is None:
        roots = book.roots = root_codes(model)
    if graph.code in roots or (graph.code.startswith(ENTRY_DIR) and REGION_NAME not in graph.code):  # the model's
        # forward, or the entry Dynamo inlined it in (not a region's function: a block's, at the block's site)
        return None
    own, caller, module = _walk(frame)
    function = own[1] if own is not None else ""
    if function == "forward":  # a module's own forward: its module path is its place (above it: decorators, if any)
        caller = None
    path = _module_path(book, model, module)
    counts = book.counts
    key = (graph.frame, path, caller)  # Dynamo numbers frames per code object (two resume functions can share a name)
    seen = counts.get(key, 0)
    counts[key] = seen + 1
    occurrence = min(seen, MAX_OCCURRENCES)  # a helper in a long loop: the calls past the cap share one row
    if seen == MAX_OCCURRENCES and key not in book.capped:
        where = "/".join(p for p in (path, function) if p) or "<root>"
        book.capped[key] = (f"dynamo: {where} ran more than {MAX_OCCURRENCES} times at one place in one call "
                                      f"(a loop): its calls from the {MAX_OCCURRENCES + 1}th on share one set of rows "
                                      f"({where}#{MAX_OCCURRENCES}); ShapeAssert compares them with each other")
    return path, caller, occurrence, function


def _site(found: tuple[str, tuple[str, str, int] | None, int, str]) -> Site:
    path, caller, occurrence, function = found
    return Site(path, ":".join(map(str, caller)) if caller else "", occurrence, function)


def at_site(book: SiteBook, model: nn.Module, graph: DynamoGraph) -> DynamoGraph:
    """``graph`` itself at its trivial site; else the one ``SitedGraph`` for (graph, site), made at its first call.

    Called by the live module for every graph run (``run_graph``), from inside Dynamo's dispatcher: one
    stack walk and a few dictionary look-ups for a graph that is not the root forward's own."""
    found = _locate(book, model, graph, sys._getframe(1))
    if found is None:
        return graph
    sited = book.sited
    key = (graph, *found)
    hit = sited.get(key)
    if hit is None:
        site = _site(found)
        if site.trivial:
            hit = graph
        else:
            values = {f.name: getattr(graph, f.name) for f in dataclasses.fields(graph) if f.init}
            hit = SitedGraph(**values, site=site, base=graph)
        sited[key] = hit
    return hit
