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
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

from fxdebug.capture.dynamo import DynamoGraph

__all__ = ["Site", "SitedGraph", "at_site", "call_site", "root_codes"]

_MODULE_PY = os.path.normcase(os.path.abspath(sys.modules[nn.Module.__module__].__file__ or ""))
_TORCH = os.path.join(os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__ or ""))), "")
_FXDEBUG = os.path.join(os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "")
_FXDEBUG_RAW = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
_RESUME = re.compile(r"^torch_dynamo_resume_in_(.+?)_at_\d+$")
_USER, _SKIP, _MODULE_CALL = 0, 1, 2
_KINDS: dict[CodeType, int] = {}
_MAX_DEPTH = 200


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


def _kind(code: CodeType) -> int:
    kind = _KINDS.get(code)
    if kind is None:
        name = os.path.normcase(os.path.abspath(code.co_filename))
        if name == _MODULE_PY:
            kind = _MODULE_CALL if code.co_name == "_call_impl" else _SKIP
        elif name.startswith(_FXDEBUG) or (name.startswith(_TORCH) and name[len(_TORCH):].startswith("_")):
            kind = _SKIP  # fxdebug, and torch's private machinery (torch/_dynamo, torch/_compile.py, ...)
        else:
            kind = _USER
        if len(_KINDS) < 20_000:  # transformed code objects of many recompiles: bounded
            _KINDS[code] = kind
    return kind


def _function(code: CodeType) -> str:
    m = _RESUME.match(code.co_name)
    return m.group(1) if m else code.co_name


def _walk(frame: FrameType | None) -> tuple[str, str, Any]:
    """``(graph's function, caller, module object)`` from the frame running the graph upwards."""
    own: tuple[str, str] | None = None
    caller = ""
    depth = 0
    while frame is not None and depth < _MAX_DEPTH:
        code = frame.f_code
        kind = _kind(code)
        if kind == _MODULE_CALL:
            return (own[1] if own else ""), caller, frame.f_locals.get("self")
        if kind == _SKIP and own is not None and code.co_filename.startswith(_FXDEBUG_RAW):
            break  # the live module's entry (its trampoline): out of the model
        if kind == _USER:
            here = (code.co_filename, _function(code))
            if own is None:
                own = here
            elif not caller and here != own:
                caller = f"{os.path.basename(here[0])}:{here[1]}:{frame.f_lineno}"
        frame = frame.f_back
        depth += 1
    return (own[1] if own else ""), caller, None


def _module_path(state: dict[str, Any], model: nn.Module, module: Any) -> str:
    if module is None or module is model:
        return ""
    paths: dict[int, str] = state.setdefault("_site_paths", {})
    found = paths.get(id(module))
    if found is None:  # a module not seen yet (replaced since): the table again
        paths.clear()
        for name, sub in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(sub), name)
        found = paths.setdefault(id(module), type(module).__name__)  # outside the model: its type
    return found


def root_codes(model: nn.Module) -> set[str]:
    """The code keys (``file:function:first line``) of ``model``'s forward, and of what a decorator wraps."""
    out = set()
    forward = getattr(type(model), "forward", None)
    while forward is not None:  # a decorated forward (``functools.wraps``): the wrapper and what it wraps
        code = getattr(forward, "__code__", None)
        if code is not None:
            out.add(f"{code.co_filename}:{code.co_name}:{code.co_firstlineno}")
        forward = getattr(forward, "__wrapped__", None)
        if len(out) > 8:
            break
    return out


def call_site(state: dict[str, Any], model: nn.Module, graph: DynamoGraph, frame: FrameType | None) -> Site | None:
    """The site ``graph`` runs at now (``frame``: the dispatcher's caller); ``None`` for the root forward's own graph.

    ``state`` is the live module's: the occurrence counters of the current call (``_site_counts``), the
    module-path table, the root forward's code.
    """
    state["_graphs_this_call"] = state.get("_graphs_this_call", 0) + 1  # (instrumented/live_skips.py reads it)
    roots = state.get("_site_roots")
    if roots is None:
        roots = state["_site_roots"] = root_codes(model)
    if graph.code in roots or graph.code.startswith(_FXDEBUG_RAW):  # the model's forward, or the entry Dynamo inlined it in
        return None
    function, caller, module = _walk(frame)
    if function == "forward":  # a module's own forward: its module path is its place (above it: decorators, if any)
        caller = ""
    path = _module_path(state, model, module)
    counts = state.get("_site_counts")
    if counts is None:
        counts = state["_site_counts"] = {}  # the live module starts a fresh one at each call
    key = (graph.frame, path, caller)  # Dynamo numbers frames per code object (two resume functions can share a name)
    occurrence = counts.get(key, 0)
    counts[key] = occurrence + 1
    return Site(path, caller, occurrence, function)


def at_site(state: dict[str, Any], model: nn.Module, graph: DynamoGraph) -> DynamoGraph:
    """``graph`` itself at its trivial site; else the one ``SitedGraph`` for (graph, site), made at its first call.

    Called by the live module for every graph run (``run_graph``), from inside Dynamo's dispatcher."""
    site = call_site(state, model, graph, sys._getframe(1))
    if site is None or site.trivial:
        return graph
    sited: dict[tuple[DynamoGraph, Site], SitedGraph] = state.setdefault("_sited", {})
    found = sited.get((graph, site))
    if found is None:
        values = {f.name: getattr(graph, f.name) for f in dataclasses.fields(graph) if f.init}
        found = sited[(graph, site)] = SitedGraph(**values, site=site, base=graph)
    return found
