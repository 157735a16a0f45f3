"""Regional capture for a live module: each repeated block is its own Dynamo region, traced once (issue 33).

For the length of one live call, every region (``capture.dynamo_regions.find_regions``: the outermost
instances of a repeated block, and the other children of a module that loops over them) gets an
instance ``forward`` that enters the region's compiled function through a skipped trampoline; after
the call the model is as it was. A traced caller graph-breaks at the block's call instead of inlining
it; the block's hooks still run in ``nn.Module``'s call, eagerly, as they would; the region's frame is
compiled once per group (one class, one structure) and its guards decide, as for any frame, whether an
instance needs its own graph (another shape, a config value its code reads). Each instance still gets
its own part and rows: the call-site look-up names a region's graph by the module whose call ran it
(``capture/dynamo_sites.py``), so ``model.layers.17.mlp.down_proj`` keeps its rows.

Opt-in in this release: ``FXDEBUG_REGIONS=1`` turns it on (off, every block is captured inlined, as before).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fxdebug.capture.dynamo_backends import compiler_for, composite
from fxdebug.capture.dynamo_recover import observing_after_errors
from fxdebug.capture.dynamo_regions import ENTER, Regions, find_regions, region_code, region_function, state_free
from fxdebug.instrumented.live_call import outer_now
from fxdebug.instrumented.live_snapshots import add_note

__all__ = ["NotShared", "forget_entry", "routed_regions", "without_regions"]


class routed_regions:  # noqa: N801 - a context manager, used as a function
    """For the length of one live call, each region's ``forward`` enters its compiled region function.

    ``kwargs`` are the call's keywords: a call that passes its blocks a per-call state (a KV cache: ``use_cache``
    true, or a cache given) leaves the groups whose forward takes one inlined for that call, and the other children of
    their loop's owner with them (``dynamo_regions.state_free``); Dynamo keeps both captures of the caller, each
    behind its guards. ``None``: every region is routed."""

    def __init__(self, live: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.live = live
        self.kwargs = kwargs
        self.installed: list[Any] = []
        self.root_eager = False  # the model is a plain ``nn.Sequential`` of routed regions: nothing for Dynamo to trace

    def __enter__(self) -> "routed_regions":
        state = self.live._live_state
        if state.regions is None:
            state.regions = find_regions(self.live._model) if state.regional else Regions({}, 0, 0)
            if state.regions:
                _note(self.live, state.regions)
        if not state.regions:
            return self
        compiler = outer_now()
        if compiler is None:
            compiler = compiler_for(state.backend)
        routes = state.region_routes.get(id(compiler))
        if routes is None:
            routes = state.region_routes[id(compiler)] = _routes(self.live, state.regions, compiler)
        inlined = _inlined_now(self.live, state.regions, self.kwargs)
        for module, route, key in routes:
            if "forward" in module.__dict__ or key in inlined:  # the user's own instance forward, another route, or
                continue  # a group this call gives a cache
            module.__dict__["forward"] = route
            self.installed.append(module)
        self.root_eager = _sequence_of_regions(self.live._model, self.installed)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module in self.installed:
            module.__dict__.pop("forward", None)
        self.installed.clear()


def _sequence_of_regions(model: Any, routed: list[Any]) -> bool:
    """Whether ``model``'s forward is ``nn.Sequential``'s loop over children that all enter their regions now.

    Dynamo cannot resume after a graph break inside a loop, so it would trace that loop up to its first child, break,
    and run the frame eagerly: its graph holds nothing, and the trace (wrapping the model's every submodule) was the
    largest single cost of a deep model's start-up (0.7 s of 4 at 2,500 blocks). Such a root is called eagerly."""
    if type(model).forward is not torch.nn.Sequential.forward or "forward" in model.__dict__:
        return False
    if torch.compiler.is_compiling() or not model._modules:
        return False
    ids = {id(m) for m in routed}
    return all(id(child) in ids for child in model._modules.values())


def _inlined_now(live: Any, regions: Regions, kwargs: dict[str, Any] | None) -> frozenset[Any]:
    """The group keys this call leaves inlined: the stateful groups (and the loop owners' other children) when the
    call passes a per-call state; none otherwise."""
    if not regions.stateful or kwargs is None or state_free(live._model, kwargs):
        return frozenset()
    return regions.stateful | {k for k in regions.paths.values() if k[0] == "child"}


def _routes(live: Any, regions: Regions, compiler: Any) -> list[tuple[Any, Any, Any]]:
    """``(module, its route, its group key)`` for every region, entries compiled for ``compiler`` (one per group)."""
    model = live._model
    compiled: dict[Any, Any] = {}
    out: list[tuple[Any, Any, Any]] = []
    for path, key in regions.paths.items():
        try:
            module = model.get_submodule(path)
        except AttributeError:  # removed or renamed since: Dynamo inlines what is there now
            continue
        entry = compiled.get(key)
        if entry is None:
            fn = region_function(key, type(module))
            entry = compiled[key] = observing_after_errors(torch.compile(fn, backend=composite(compiler)), fn)
        out.append((module, functools.partial(ENTER, module, functools.partial(_watched, live, key, entry)), key))
    return out


class NotShared(Exception):
    """A region's second instance needed a graph of its own (a per-layer value its code reads, such as a cache
    slot indexed by ``layer_idx``): raised while ``instrument()`` captures on its example inputs, which are then
    captured again with that group inlined."""


def _watched(live: Any, key: Any, entry: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
    """The region's call; until its group is known to share one graph across instances, each instance's call checks
    whether Dynamo captured anew for it. Dynamo skips this frame (it runs between a compiled caller and the region)."""
    state = live._live_state
    if key in state.region_shared:
        return entry(module, *args, **kwargs)
    seen = state.region_seen.setdefault(key, set())
    if not seen and not _plain_arguments(args, kwargs):  # a stateful object (a KV cache) per call: a graph per layer
        _unshare(live, key)
        if state.capturing_examples:
            raise NotShared(key)
    code = region_code(key)
    before = _entries(code)
    out = entry(module, *args, **kwargs)
    if seen and id(module) not in seen:
        if _entries(code) == before:
            state.region_shared.add(key)  # another instance ran a graph an earlier one captured
        else:  # another instance, another graph: once is the chain's first block (its input needs no gradient);
            fresh = state.region_fresh[key] = state.region_fresh.get(key, 0) + 1  # again and again is per instance
            if fresh >= _PER_INSTANCE:
                _unshare(live, key)
                if state.capturing_examples:
                    raise NotShared(key)
    seen.add(id(module))
    return out


_PER_INSTANCE = 3  # instances after the first that each needed a graph of their own: the group is not shared


_PLAIN = (torch.Tensor, type(None), bool, int, float, str, torch.dtype, torch.device)


def _plain_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Tensors, numbers, strings and containers of them: what instances of a block can share one graph over. An
    object such as Hugging Face's ``DynamicCache`` is read per layer (``cache.layers[self.layer_idx]``), which
    Dynamo guards on: every instance would be traced on its own, slower than one inlined capture."""
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif not isinstance(value, _PLAIN):
            return False
    return True


def _entries(code: Any) -> int:
    try:
        return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))
    except Exception:  # another torch: regions are trusted to share
        return 0


def _unshare(live: Any, key: Any) -> None:
    """The group's instances need a graph each: they are captured inlined, as before regions, from the next call."""
    state = live._live_state
    regions = state.regions
    paths = [p for p, k in regions.paths.items() if k == key]
    for path in paths:
        del regions.paths[path]
    regions.blocks -= len(paths)
    state.region_routes.clear()
    name = getattr(key[0], "__name__", str(key[0]))
    add_note(live.trace_info.notes,
             f"dynamo: regional capture: {name} ({len(paths)} instances) needs a graph per instance (its code reads a "
             "per-instance value Dynamo guards on, such as a cache slot indexed by layer_idx): captured inlined instead")


for _eager in (_watched, _plain_arguments, _entries):  # fxdebug's own bookkeeping between a caller and a region:
    torch._dynamo.decorators.skip(_eager)  # not frames for Dynamo to compile (they were, one graph-less frame each)


def _note(live: Any, regions: Regions) -> None:
    classes: dict[str, int] = {}
    for path, key in regions.paths.items():
        if key and key[0] != "child":
            name = getattr(key[0], "__name__", str(key[0]))
            classes[name] = classes.get(name, 0) + 1
    listed = ", ".join(f"{n} x{c}" for n, c in classes.items())
    others = len(regions.paths) - regions.blocks
    add_note(live.trace_info.notes,
             f"dynamo: regional capture: {regions.blocks} repeated block(s) ({listed}) are regions of their own, each "
             f"structure traced once and shared by its instances (each instance keeps its own rows)"
             + (f"; {others} other child module(s) of a forward that loops over them are regions too (Dynamo runs "
                "a forward that graph-breaks in a loop eagerly: its own code between them runs eagerly, unobserved)"
                if others else "")
             + ". FXDEBUG_REGIONS=0 captures every block inlined.")


def forget_entry(model: Any) -> None:
    """Drop Dynamo's compiled code for ``model``'s entry (its class's trampoline): the next call traces it afresh."""
    from fxdebug.instrumented.live_parts import _ENTRY_CODES

    for code in _ENTRY_CODES.get(type(model), {}).values():
        torch._dynamo.eval_frame.reset_code(code)


def without_regions(live: Any) -> bool:
    """Turn regional capture off for ``live`` and forget what it captured; ``False`` when it had no regions."""
    state = live._live_state
    if not state.regions:
        return False
    state.regions = Regions({}, 0, 0)
    state.region_routes.clear()
    state.parts.clear()
    state.sites = type(state.sites)()
    forget_entry(live._model)
    add_note(live.trace_info.notes, "dynamo: regional capture off: a pass names a module whose output only the "
                                    "inlined capture has (a stage holding repeated blocks): every block is inlined")
    return True
