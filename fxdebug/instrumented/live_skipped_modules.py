"""A submodule whose forward Dynamo skipped, observed another way: a snapshot of that submodule.

Dynamo skips a frame it cannot capture at all (a data-dependent ``if`` inside a loop) and runs it
eagerly, every call. When that frame is a submodule's ``forward``, the graphs around it are still
captured, but nothing inside it is. Here, during each live call (and only then: the model is left as
it was between calls), such a submodule's ``forward`` is routed through a snapshot of it: at its first
call, the subtrees frontend captures it on the arguments of that call (its own forward stays eager, its
largest capturable submodules become graphs, each checked bitwise) with the live module's passes; every
call after runs through it. Its parts join the live module's (``parts()`` keys ``snapshot:<path>``; rows
``l.fc/linear``), and a note says so, or why the snapshot could not be made.

The route is the submodule's instance ``forward``, set before the call and taken away after it; the
routed call is ``torch._dynamo.disable``d (Dynamo skipped that frame anyway) so Dynamo never traces
fxdebug's code.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from fxdebug.capture.dynamo_names import root_codes
from fxdebug.capture.dynamo_skips import SKIPPED, Skip
from fxdebug.graph.meta import KEY
from fxdebug.instrumented.live_snapshots import add_note, snapshot_of

__all__ = ["find_skipped_modules", "routed_skipped_modules"]

_FAILED = object()


def find_skipped_modules(live: Any) -> dict[str, Skip]:
    """Note which submodules' forwards Dynamo skipped (``SKIPPED``, process-wide), to route them from the next call.

    A skipped forward whose calls Dynamo captured as frames of their own (its submodules' forwards, the
    helpers it calls: graphs whose call site is inside it) is observed already, through those graphs, each
    at its own call site: it is not routed (a snapshot would take them out of Dynamo's hands); a note says
    its own code ran eagerly. Returns the routed ones (``LiveState.skipped_modules``)."""
    state = live._live_state
    if state.skipped_modules is None:
        state.skipped_modules = {}
    found, seen = state.skipped_modules, state.skipped_seen
    traced: list[tuple[str, set[str]]] | None = None
    for path, module in live._model.named_modules():
        if not path or path in found or path in seen:
            continue
        skip = next((SKIPPED[c] for c in root_codes(module) if c in SKIPPED), None)
        if skip is None:
            continue
        if traced is None:
            traced = _traced_modules(state.parts)
        if _traced_through(path, traced):  # a code shared by many classes (a decorator's wrapper) skipped for
            continue  # another model: here Dynamo traced this module's forward into a graph of its caller
        inner = sorted({g.site.module or "<root>" for g in state.parts if getattr(g, "site", None) is not None
                        and (g.site.module == path or g.site.module.startswith(path + "."))})
        if inner:
            seen[path] = skip
            add_note(live.trace_info.notes,
                     f"dynamo: {path} ({type(module).__name__}): its forward runs without a graph (Dynamo skipped it, "
                     f"{skip.where}); what it calls is captured as graphs of their own, each at its call site (in "
                     f"{', '.join(inner[:6])}{', ...' if len(inner) > 6 else ''}); its own code between them runs "
                     "eagerly, unobserved.")
        else:
            found[path] = skip
    return found


def _traced_modules(parts: dict[Any, Any]) -> list[tuple[str, set[str]]]:
    """``(call site's module, the modules its nodes come from)`` for each part captured so far."""
    out = []
    for g, found in parts.items():
        site = getattr(g, "site", None)
        modules = {n.meta.get(KEY, {}).get("module") or "" for n in found.part.graph.nodes}
        out.append((site.module if site is not None else "", modules))
    return out


def _traced_through(path: str, traced: list[tuple[str, set[str]]]) -> bool:
    """Whether a graph called from outside ``path`` holds ops of ``path`` or of a module inside it: Dynamo inlined
    its forward there (Dynamo skips a code only where it meets it as a frame of its own)."""
    inside = path + "."
    for site, modules in traced:
        if site == path or site.startswith(inside):
            continue
        if any(m == path or m.startswith(inside) for m in modules):
            return True
    return False


class routed_skipped_modules:  # noqa: N801 - a context manager, used as a function
    """For the length of one live call, each skipped submodule's ``forward`` is its snapshot."""

    def __init__(self, live: Any) -> None:
        self.live = live
        self.installed: list[nn.Module] = []

    def __enter__(self) -> None:
        state = self.live._live_state
        for path in state.skipped_modules or {}:
            snapshot = state.module_snapshots.get(path)
            if snapshot is _FAILED:
                continue
            try:
                module = self.live._model.get_submodule(path)
            except AttributeError:  # removed or renamed since
                continue
            if "forward" in module.__dict__:  # the user's own instance forward: left alone
                continue
            module.__dict__["forward"] = functools.partial(_ROUTED, self.live, path, module)
            self.installed.append(module)

    def __exit__(self, *exc: Any) -> None:
        for module in self.installed:
            module.__dict__.pop("forward", None)
        self.installed.clear()


def _routed(live: Any, path: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    route = module.__dict__.pop("forward", None)  # the snapshot copies the module's attributes: not this one
    try:
        snapshot = live._live_state.module_snapshots.get(path)
        if snapshot is None:
            snapshot = _snapshot(live, path, module, args, kwargs)
        if snapshot is _FAILED:
            return type(module).forward(module, *args, **kwargs)
        if snapshot.training != module.training:
            snapshot.train(module.training)
        return snapshot(*args, **kwargs)
    finally:
        if route is not None:
            module.__dict__["forward"] = route


_ROUTED: Callable[..., Any] = torch._dynamo.disable(_routed)


def _snapshot(live: Any, path: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    state = live._live_state
    skip = (state.skipped_modules or {})[path]
    name = type(module).__name__
    sub, parts, why = snapshot_of(live, module, path, args, kwargs)
    if sub is None:
        state.module_snapshots[path] = _FAILED
        add_note(live.trace_info.notes,
                 f"dynamo: {path} ({name}): its forward runs without a graph (Dynamo skipped it, {skip.where}) and "
                 f"could not be observed another way: the subtrees frontend failed ({why}); the report has no rows "
                 "inside it.")
        return _FAILED
    state.module_snapshots[path] = sub
    add_note(live.trace_info.notes,
             f"dynamo: {path} ({name}): its forward runs without a graph (Dynamo skipped it, {skip.where}); observed "
             f"instead through a snapshot of its submodules (the subtrees frontend, from its first call in call "
             f"{state.calls}): {len(parts)} part(s): {', '.join(parts) or 'none'}. Its own code between "
             "them runs eagerly, unobserved.")
    return sub
