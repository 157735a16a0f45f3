"""Repeated blocks captured once: which modules of a model are regions of their own for Dynamo (issue 33).

Dynamo traces every module call it inlines afresh: a 32-layer transformer costs 32 traces of one layer's
code, most of a live capture's start-up. Under Dynamo a block's parameters are graph inputs and its
guards check the module's type, structure and the attributes its code reads, not which instance it is;
so a frame whose ``self`` is the block compiles once and serves every instance of matching structure
(what torch calls regional compilation). Here:

* ``find_regions(model)`` — the modules to capture as regions: the outermost instances of a module class
  that repeats with matching structure (same class, same submodule types, same parameter and buffer
  shapes, dtypes and devices; at least ``MIN_REPEATS`` of them), and, where such blocks sit in a
  ``ModuleList`` / ``ModuleDict`` that the owner's forward loops over, the owner's other children:
  Dynamo cannot resume after a graph break inside a loop, so it runs the owner's forward eagerly,
  and its embedding before the loop and its norm after it become regions too, instead of unobserved.
* ``takes_state(cls)`` / ``state_free(model, kwargs)`` — a block whose forward takes a per-call state object (a
  KV cache) reads its own slot of it (``cache.layers[self.layer_idx]``), which Dynamo guards on: shared, every
  instance would be traced on its own. Such a group is a region only for the calls that pass no such object
  (Hugging Face's ``use_cache=False``, in the call or in the model's config, and no cache given).
* ``region_function(key)`` — what Dynamo compiles for one group: ``type(self).forward(self, ...)``
  behind a code object of the group's own (Dynamo keeps its cache, and its recompile limit, per code
  object; instances of one group share it).
* ``ENTER`` — the trampoline a region's call goes through: a frame Dynamo skips without disabling the
  frames it calls, so a traced caller graph-breaks at the block's call (the block is not inlined) and
  the region's compiled frame runs the block.

What is routed, and when, is the live module's business (``instrumented/live_regions.py``).
"""

from __future__ import annotations

import inspect
import os
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["ENTER", "MIN_REPEATS", "REGION_NAME", "covered", "is_region_break", "region_code", "regions_enabled", "Regions", "find_regions",
           "region_function", "state_free", "takes_state"]

MIN_REPEATS = 4  # instances of one class that make it a block worth one trace for all (a transformer's layers)
REGION_NAME = "fxdebug_region_"  # the start of a region function's name (its code key names it)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass
class Regions:
    """The regions of one model: ``{path: group key}``; a group is one class with one structure."""

    paths: dict[str, tuple[Any, ...]]
    blocks: int  # how many of them are repeated blocks (the rest are an eager owner's other children)
    groups: int
    stateful: frozenset[tuple[Any, ...]] = frozenset()  # groups whose forward takes a per-call state (takes_state)

    def __bool__(self) -> bool:
        return bool(self.paths)


def _structure(module: nn.Module) -> tuple[Any, ...]:
    """What Dynamo's guards on a block compare: submodule types, and each parameter's and buffer's metadata."""
    modules = tuple((name, type(m)) for name, m in module.named_modules() if name)
    state = tuple((name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
                  for name, t in [*module.named_parameters(), *module.named_buffers()])
    return (type(module), modules, state)


# a forward that takes a per-call state object (a KV cache) reads a slot of it per layer (``cache.layers[self.layer_idx]``):
# Dynamo guards on that, so with such an object each instance is traced on its own, slower than one inlined capture
# (measured: HF GPT-2 12 layers 16.2 s vs 5.1 s); without one (``use_cache=False``) the instances share one graph
_PER_LAYER_STATE = frozenset({"cache", "past_key_value", "past_key_values", "layer_past", "kv_cache"})
_SIGNATURES: dict[type, bool] = {}


def regions_enabled() -> bool:
    """Whether regional capture is on (``FXDEBUG_REGIONS=1``: opt-in in this release)."""
    return os.environ.get("FXDEBUG_REGIONS", "0") not in ("0", "off", "false", "no")


def _candidate(module: nn.Module) -> bool:
    """A block: a module with submodules, not a container, its forward the class's own (no instance forward)."""
    return not isinstance(module, _CONTAINERS) and bool(module._modules) and "forward" not in module.__dict__


def takes_state(cls: type) -> bool:
    """Whether ``cls.forward`` takes a per-call state object by one of the names models use for a KV cache."""
    found = _SIGNATURES.get(cls)
    if found is None:
        try:
            names = set(inspect.signature(getattr(cls, "forward")).parameters)
        except (TypeError, ValueError):
            names = set()
        found = _SIGNATURES[cls] = bool(names & _PER_LAYER_STATE)
    return found


def state_free(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``model`` with ``kwargs`` passes its blocks no per-call state: no cache given, and
    ``use_cache`` (the call's, else the model's ``config.use_cache``) not true. A model without either is taken at
    its word; a block that still receives a state object is inlined at its first call (``live_regions``)."""
    if any(kwargs.get(name) is not None for name in _PER_LAYER_STATE):
        return False
    use = kwargs.get("use_cache")
    if use is None:
        use = getattr(getattr(model, "config", None), "use_cache", None)
    return not use


def find_regions(model: nn.Module, min_repeats: int = MIN_REPEATS) -> Regions:
    """The regions of ``model`` (see the module docstring); none when nothing repeats."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    named = list(model.named_modules())
    counts: dict[type, int] = {}
    for path, module in named:
        if path:
            counts[type(module)] = counts.get(type(module), 0) + 1
    blocked: set[str] = set()  # a repeated block that cannot be shared: nothing inside it is a region either (its
    for path, module in named:  # frame would only break into pieces)
        if not path or _inside(path, blocked):
            continue
        if _candidate(module):
            groups.setdefault(_structure(module), []).append(path)
        elif counts[type(module)] >= min_repeats and module._modules and not isinstance(module, _CONTAINERS):
            blocked.add(path)
    per_class: dict[type, int] = {}
    for key, paths in groups.items():
        per_class[key[0]] = per_class.get(key[0], 0) + len(paths)
    # a class that repeats: every instance is a region, traced once per structure (its group's own code object)
    repeated = {key: paths for key, paths in groups.items() if per_class[key[0]] >= min_repeats}
    chosen: dict[str, tuple[Any, ...]] = {}
    for key, paths in sorted(repeated.items(), key=lambda kv: min(p.count(".") for p in kv[1])):
        for path in paths:
            if not _inside(path, chosen):  # the outermost repeated block only
                chosen[path] = key
    blocks = len(chosen)
    for owner in _loop_owners(model, chosen):
        for name, child in owner[1]._modules.items():
            path = f"{owner[0]}.{name}" if owner[0] else name
            if child is None or path in chosen or (isinstance(child, _CONTAINERS) and type(child) is not nn.Sequential):
                continue  # (a list or dict of modules is not called; a plain ``nn.Sequential`` is, as one region)
            if any(c.startswith(path + ".") for c in chosen if c.startswith(path)):
                continue
            if "forward" not in child.__dict__:
                chosen[path] = ("child", path)
    stateful = frozenset(k for k in chosen.values() if k[0] != "child" and takes_state(k[0]))
    return Regions(chosen, blocks, len({k for k in chosen.values()}), stateful)


def covered(model: nn.Module, regions: Regions) -> tuple[int, int]:
    """``(modules inside a region, all modules)`` of ``model``: how much of it regional capture traces once per block."""
    total = inside = 0
    for path, _ in model.named_modules():
        total += 1
        if path and (path in regions.paths or _inside(path, regions.paths)):
            inside += 1
    return inside, total


def _inside(path: str, paths: Any) -> bool:
    """Whether a proper ancestor of ``path`` is in ``paths`` (a set or dict of module paths)."""
    cut = path.rfind(".")
    while cut > 0:
        path = path[:cut]
        if path in paths:
            return True
        cut = path.rfind(".")
    return False


def _loop_owners(model: nn.Module, chosen: dict[str, Any]) -> list[tuple[str, nn.Module]]:
    """Modules whose forward loops over regions: the owner of a ``ModuleList`` / ``ModuleDict`` of them, and an
    ``nn.Sequential`` holding them (its forward is that loop: its other children ran unobserved before)."""
    owners: dict[str, nn.Module] = {}
    for path in chosen:
        container_path = path.rpartition(".")[0]
        container = model.get_submodule(container_path) if container_path else model
        if isinstance(container, nn.Sequential):
            owners.setdefault(container_path, container)
        elif isinstance(container, (nn.ModuleList, nn.ModuleDict)) and container_path:
            owner_path = container_path.rpartition(".")[0]
            owners.setdefault(owner_path, model.get_submodule(owner_path) if owner_path else model)
    return list(owners.items())


def _region(self: Any, *args: Any, **kwargs: Any) -> Any:
    return type(self).forward(self, *args, **kwargs)


_CODES: "dict[tuple[Any, ...], types.CodeType]" = {}


def region_function(key: tuple[Any, ...], cls: type) -> Callable[..., Any]:
    """The function Dynamo compiles for the group ``key`` (one code object per group, named for its class)."""
    code = _CODES.get(key)
    if code is None:
        # a name of its own per group: the report counts frames (and recompiles) by code location
        code = _CODES[key] = _region.__code__.replace(co_name=f"{REGION_NAME}{cls.__name__}_{len(_CODES)}")
    fn = types.FunctionType(code, _region.__globals__, code.co_name)
    fn.__qualname__ = f"fxdebug_region[{cls.__qualname__}]"
    return fn


def region_code(key: tuple[Any, ...]) -> types.CodeType | None:
    """The code object Dynamo compiles for group ``key`` (``None`` before ``region_function`` made it)."""
    return _CODES.get(key)


def _enter(module: nn.Module, compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return compiled(module, *args, **kwargs)


# skipped, its callees compiled; a traced caller graph-breaks at its call (it is marked as disabled for inlining)
ENTER: Callable[..., Any] = torch._dynamo.decorators.skip(_enter)


def is_region_break(reason: str) -> bool:
    """Whether a graph break Dynamo reported is a region's boundary (fxdebug's own, not the model's)."""
    return f"<function {_enter.__name__} at" in reason and "disable" in reason
