"""The graphs a live (Dynamo) capture hands over, as ``InstrumentedGraphModule`` parts that read the model's state
live, and how each runs with Dynamo's calling convention; the model's entry compiled with fxdebug's
backend (``_compiled_entry``: eager, or a composite with a compiler, ``capture.dynamo_backends``)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
import weakref
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from fxdebug.authoring.context import NAMESPACE
from fxdebug.capture.dynamo import Prepared
from fxdebug.capture.dynamo_backends import composite
from fxdebug.capture.dynamo_compiling import on_compile
from fxdebug.capture.dynamo_recover import observing_after_errors
from fxdebug.graph.meta import KEY
from fxdebug.instrumented.module import InstrumentedGraphModule


@dataclass
class _Part:
    part: InstrumentedGraphModule
    keep: list[int]  # Dynamo's arguments the graph takes (the rest are model state, read live)
    run: Any = None  # what runs it: a copy of the graph whose model state comes in as Dynamo's arguments
    calls: list[int] = field(default_factory=list)  # the module's call index of each of this graph's calls


def _runner(part: InstrumentedGraphModule, count: int, keep: list[int]) -> Any:
    """The part's code with Dynamo's calling convention: every argument, model state included.

    The passes saw the model's parameters and buffers as ``get_attr`` nodes (what ``ParamGrads`` and
    friends look for); at run time Dynamo hands over those very tensors (checked when the graph was
    prepared), so they become placeholders again: no attribute walk per parameter per call. The
    part itself (its graph, observers, report) is unchanged.
    """
    graph = Graph()
    env: dict[Node, Node] = {}
    kept = [n for n in part.graph.nodes if n.op == "placeholder"]
    by_index: dict[int, Node] = {}
    state: dict[Any, Node] = {}  # Dynamo's argument index -> the get_attr node reading it (the first, as before)
    for n in part.graph.nodes:
        if n.op == "get_attr":
            state.setdefault(n.meta.get(KEY, {}).get("dynamo_arg"), n)
    for node in kept:
        by_index[keep[len(by_index)]] = node
    for i in range(count):
        if i in by_index:
            env[by_index[i]] = graph.placeholder(by_index[i].name)
        else:
            owner = state.get(i)  # a look-up, not a scan of every get_attr per argument (quadratic in the model)
            p = graph.placeholder(owner.name if owner is not None else f"_unused_{i}")
            if owner is not None:
                env[owner] = p
    for node in part.graph.nodes:
        if node in env or node.op == "placeholder":
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    gm = GraphModule(part, graph, class_name=type(part).__name__)
    gm._modules = part._modules
    gm.__dict__[NAMESPACE] = part.__dict__.get(NAMESPACE)
    return gm.forward


def _user_arguments(placeholders: list[Node], args: tuple[Any, ...]) -> list[Any] | None:
    """``args`` (the user's tensors) as a part's placeholders take them: a dynamic size (Dynamo's
    ``s0`` placeholder) read from the tensor whose captured shape holds it; ``None`` if they do not fit."""
    tensors = [n for n in placeholders if not isinstance(n.meta.get("example_value"), torch.SymInt)]
    if len(tensors) != len(args):
        return None
    sizes: dict[str, int] = {}
    for n, a in zip(tensors, args):
        value = n.meta.get("example_value")
        if isinstance(value, torch.Tensor) and isinstance(a, torch.Tensor) and value.dim() == a.dim():
            for dim, size in zip(value.shape, a.shape):
                if isinstance(dim, torch.SymInt):
                    sizes.setdefault(str(dim), int(size))
    out, given = [], iter(args)
    for n in placeholders:
        value = n.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            if str(value) not in sizes:
                return None
            out.append(sizes[str(value)])
        else:
            out.append(next(given))
    return out


def _part_over(model: nn.Module, prepared: Prepared) -> InstrumentedGraphModule:
    """An ``InstrumentedGraphModule`` graph that reads the model's state live: the model's own dictionaries.

    fxdebug's modules (observers, Dynamo's constants) live under ``fxdebug`` in the part's own
    ``__dict__``, never inside the model's ``_modules``.
    """
    space, consts = nn.Module(), nn.Module()
    for name, value in prepared.constants.items():
        if isinstance(value, nn.Module):
            consts.add_module(name, value)
        elif isinstance(value, nn.Parameter):
            consts.register_parameter(name, value)
        else:
            consts.register_buffer(name, value, persistent=False)
    space.add_module("constants", consts)
    holder = nn.Module()
    holder._modules = OrderedDict(model._modules)
    holder._modules[NAMESPACE] = space
    holder._parameters = model._parameters
    holder._buffers = model._buffers
    part = InstrumentedGraphModule(holder, prepared.graph, class_name=type(model).__name__)
    part._modules = model._modules
    part._parameters = model._parameters
    part._buffers = model._buffers
    part._non_persistent_buffers_set = model._non_persistent_buffers_set
    part.__dict__[NAMESPACE] = space
    return part


def _entry(model: nn.Module) -> Any:
    """``model(...)`` behind a code object of its own.

    Dynamo keeps its compiled entries on the code object of the frame it compiles, with a recompile limit per code
    object. ``torch.compile(module)`` enters through one wrapper function shared by every compiled module of the
    process (``external_utils.wrap_inline``'s ``inner``): after some tens of live modules (a notebook, a test
    session) the limit was hit and every new one ran eagerly, unobserved. A fresh copy of this trampoline's code
    per model class keeps a class's entries, and its limit, to that class (instances of one class still share
    Dynamo's cache: a second model of a class already captured costs only fxdebug's part).
    """
    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    # a new code object (same bytecode) per model class: Dynamo's cache is per code object
    call.__code__ = _ENTRY_CODES.setdefault(type(model), call.__code__.replace())
    return call


_ENTRY_CODES: "weakref.WeakKeyDictionary[type, Any]" = weakref.WeakKeyDictionary()


def _compiled_entry(model: nn.Module, compiler: Any = None, scope: Any = None) -> Any:
    """``torch.compile`` of the model's entry with fxdebug's backend for ``compiler`` (``None``: the graphs run
    eagerly); a failed call leaves none of its codes skipped by Dynamo for good (issue 35 B1). With ``scope``
    (``live_skips.compile_scope``), its Dynamo callback enters ``scope()`` around each compile, and the entry says
    whether it could (``SCOPED``): then a call whose guards hold needs no settings around it."""
    entry = _entry(model)
    compiled = torch.compile(entry, backend=composite(compiler))
    run = observing_after_errors(compiled, entry)
    run.fxdebug_compile_scoped = scope is not None and on_compile(compiled, scope)  # type: ignore[attr-defined]
    return run
