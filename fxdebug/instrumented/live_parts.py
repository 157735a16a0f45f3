"""The graphs a live (Dynamo) capture hands over, as ``InstrumentedGraphModule`` parts that read the model's state
live, and how each runs with Dynamo's calling convention; the model's entry compiled with fxdebug's
backend (``_compiled_entry``: eager, or a composite with a compiler, ``capture.dynamo_backends``)."""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
import weakref
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.fx.node import map_arg

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

    The copy is named by position (``arg0``, ``v3``) and reaches fxdebug's own modules through slots of its
    own (``_fxdebug_slot0``: the part's observer, clock, constants module), so the parts of one repeated block
    (a region's 2,500 instances) have the same code: it is generated once (``_RunnerModule``), not per part.
    """
    graph = Graph()
    env: dict[Node, Node] = {}
    kept = [n for n in part.graph.nodes if n.op == "placeholder"]
    by_index: dict[int, Node] = {}
    for node in kept:
        by_index[keep[len(by_index)]] = node
    state: dict[int, list[Node]] = {}  # Dynamo's argument index -> every get_attr reading it (one look-up each)
    for n in part.graph.nodes:
        if n.op == "get_attr":
            index = n.meta.get(KEY, {}).get("dynamo_arg")
            if isinstance(index, int) and 0 <= index < count and index not in by_index:
                state.setdefault(index, []).append(n)
    for i in range(count):
        p = graph.placeholder(f"arg{i}")
        if i in by_index:
            env[by_index[i]] = p
        for owner in state.get(i, ()):  # what the model holds now: what Dynamo hands over as this argument
            env[owner] = p
    slots = _Slots(part)
    key: list[Any] | None = [count]
    for node in part.graph.nodes:
        if node in env or node.op == "placeholder":
            continue
        target = slots.target(node.op, node.target) if node.op in ("call_module", "get_attr") else node.target
        args, kwargs = map_arg(node.args, env.__getitem__), map_arg(node.kwargs, env.__getitem__)
        name = "output" if node.op == "output" else f"v{len(env)}"
        new = env[node] = graph.create_node(node.op, target, args, kwargs, name, node.type)
        new.meta = copy.copy(node.meta)
        if key is not None:
            key = _keyed(key, new)
    if key is not None:
        graph.__dict__[_CODE_KEY] = tuple(key)
    root = nn.Module()  # what the targets name: the model's paths, fxdebug's namespace and the slots
    root._modules = part._modules
    root.__dict__[NAMESPACE] = part.__dict__.get(NAMESPACE)
    root.__dict__.update(slots.objects)
    root.training = part.training
    gm = _RunnerModule(root, graph, class_name=type(part).__name__)
    gm._modules = part._modules
    gm.__dict__[NAMESPACE] = part.__dict__.get(NAMESPACE)
    gm.__dict__.update(slots.objects)  # fxdebug's modules, found without nn.Module.__getattr__ at each call
    return gm.forward


_SLOT = "_fxdebug_slot"


class _Slots:
    """The copy's targets: a module under fxdebug's namespace becomes a slot of the copy (``_fxdebug_slot0``; a
    tensor ``_fxdebug_slot1.c0``, read from its module at each call, as before); the model's own paths stay as
    they are, read live from the model's dictionaries."""

    def __init__(self, part: InstrumentedGraphModule) -> None:
        self.part = part
        self.names: dict[str, str] = {}  # module path under fxdebug's namespace -> its slot
        self.objects: dict[str, nn.Module] = {}  # slot -> the module

    def target(self, op: str, target: Any) -> Any:
        out = target
        if isinstance(target, str) and target.startswith(NAMESPACE + "."):
            path, _, leaf = (target, "", "") if op == "call_module" else target.rpartition(".")
            slot = self.names.get(path)
            if slot is None:
                try:
                    module = self.part.get_submodule(path)
                except AttributeError:
                    module = None
                if module is not None:
                    slot = self.names[path] = f"{_SLOT}{len(self.names)}"
                    self.objects[slot] = module
            if slot is not None:
                out = f"{slot}.{leaf}" if leaf else slot
        return out


_CODE_KEY = "_fxdebug_code_key"  # a runner graph's structure (``_keyed``), read once by ``_RunnerModule.recompile``
_CODES: dict[tuple[Any, ...], tuple[Any, str, Any, Any]] = {}  # structure -> (forward, source, line map, prologue)
_MAX_CODES = 4096
_SCALARS = frozenset({int, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout})
_SEQUENCES = frozenset({tuple, list, immutable_list})


class _Uncached(Exception):
    """An argument whose generated code the structure key cannot vouch for (the part's code is generated)."""


def _keyed(key: list[Any], node: Node) -> list[Any] | None:
    """``key`` with ``node`` appended: everything FX's code generation reads of it (names are positional, so two
    copies with equal keys have the same code); ``None`` when an argument is not one the key describes."""
    try:
        key.append((node.op, node.target, node.name, _arg_key(node.args), _arg_key(node.kwargs), node.type,
                    bool(node.meta.get("is_wrapped", False))))
        hash(key[-1])
    except (_Uncached, TypeError):
        return None
    return key


def _arg_key(a: Any) -> Any:
    kind = type(a)
    if kind is Node:
        return ("node", a.name)
    if kind in _SCALARS:
        return (kind, a)
    if kind is float:
        return (float, repr(a))  # -0.0 and nan written as they are
    if kind in _SEQUENCES:
        return (kind, *(_arg_key(x) for x in a))
    if kind is dict or kind is immutable_dict:
        return (kind, *((type(k), k, _arg_key(v)) for k, v in a.items()))
    if kind is slice:
        return (slice, _arg_key(a.start), _arg_key(a.stop), _arg_key(a.step))
    if a is Ellipsis:
        return (kind,)
    raise _Uncached(kind)


class _RunnerModule(GraphModule):
    """The runner's ``GraphModule``: its code generated once per structure (``_CODES``) and reused by every
    copy with that structure. Called through ``forward`` (``compiled`` reads its ``graph``); a later edit of its
    graph generates code afresh, as any ``GraphModule``'s."""

    def recompile(self) -> Any:
        key = self._graph.__dict__.pop(_CODE_KEY, None)
        if key is None or _verbose_codegen():
            return super().recompile()
        hit = _CODES.get(key)
        if hit is None:
            made = super().recompile()
            if len(_CODES) < _MAX_CODES:
                _CODES[key] = (type(self).forward, self._code, self._lineno_map, self._prologue_start)
            return made
        forward, self._code, self._lineno_map, self._prologue_start = hit
        type(self).forward = forward
        return None


def _verbose_codegen() -> bool:
    """FX's code generation writes node metadata into the code (``FX_GRAPH_SHOW_META``, profiler metadata): the
    structure key does not hold it, so such code is generated per part."""
    if os.environ.get("FX_GRAPH_SHOW_META", "0") == "1":
        return True
    try:
        from torch.fx.experimental import _config

        return bool(getattr(_config, "enrich_profiler_metadata", False))
    except ImportError:
        return False


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


_BLANK: list[InstrumentedGraphModule] = []  # one never-used part: the state a new one starts with


def _fresh_part(class_name: str) -> InstrumentedGraphModule:
    """A new ``InstrumentedGraphModule`` over an empty graph, its class named ``class_name``, made from a blank one's
    state: its containers (hook tables, parameter tables, ``meta``) copied, the rest shared. A deep model's capture
    makes a part per block instance, tens of thousands; ``GraphModule.__init__`` (its attributes set through
    ``nn.Module.__setattr__``) took ~46 us of each, this ~16 us."""
    if not _BLANK:
        _BLANK.append(InstrumentedGraphModule({}, Graph()))
    new = InstrumentedGraphModule.__new__(InstrumentedGraphModule)  # a class of its own, as GraphModule makes one
    type(new).__name__ = class_name
    new.__dict__.update({k: v.copy() if isinstance(v, (dict, set, list)) else v for k, v in _BLANK[0].__dict__.items()})
    return new


def record_flow(state: Any, found: _Part, args: tuple[Any, ...], out: Any) -> Any:
    """``out``, a graph's result on the example inputs, after noting which of the part's inputs an earlier part
    made (``LiveState.feeds``) and which nodes made this part's outputs. Tensors are matched by identity, checked
    through a weak reference, so a freed tensor's id reused by another never joins two unrelated nodes."""
    graph = found.part.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, i in zip(placeholders, found.keep):
        value = args[i] if i < len(args) else None
        hit = state.produced.get(id(value)) if isinstance(value, torch.Tensor) else None
        if hit is not None and hit[0]() is value:
            state.feeds[node.name] = hit[1]
    result = next(iter(reversed(graph.nodes)), None)
    made = result.args[0] if result is not None and result.op == "output" and result.args else ()
    if isinstance(out, (tuple, list)) and isinstance(made, (tuple, list)) and len(out) == len(made):
        for value, node in zip(out, made):
            if isinstance(value, torch.Tensor) and isinstance(node, Node):
                state.produced[id(value)] = (weakref.ref(value), node.name)
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
    # built over an empty graph, then given its own: GraphModule's construction would copy every target's
    # attribute into a hierarchy of the part's own, which the model's own dictionaries replace right after
    part = _fresh_part(type(model).__name__)
    graph = prepared.graph
    part.graph = graph  # (the lazy recompile: code is generated at the part's first call)
    if graph._tracer_cls and "<locals>" not in graph._tracer_cls.__qualname__:
        part._tracer_cls = graph._tracer_cls  # as GraphModule's construction keeps them
    if graph._tracer_extras:
        part._tracer_extras = graph._tracer_extras
    part._modules = model._modules
    part._parameters = model._parameters
    part._buffers = model._buffers
    part._non_persistent_buffers_set = model._non_persistent_buffers_set
    part.__dict__[NAMESPACE] = space
    return part


def _entry(model: nn.Module, regional: bool = False) -> Any:
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
    # one per regional setting too: a regional capture's entry graph-breaks at every block, and a break in a loop
    # (``nn.Sequential.forward``) makes Dynamo skip the entry's code for good: a later inlined capture of the class
    # through that code captured nothing
    codes = _ENTRY_CODES.setdefault(type(model), {})
    call.__code__ = codes.setdefault(regional, call.__code__.replace())
    return call


_ENTRY_CODES: "weakref.WeakKeyDictionary[type, dict[bool, Any]]" = weakref.WeakKeyDictionary()


def _compiled_entry(model: nn.Module, compiler: Any = None, scope: Any = None, regional: bool = False) -> Any:
    """``torch.compile`` of the model's entry with fxdebug's backend for ``compiler`` (``None``: the graphs run
    eagerly); a failed call leaves none of its codes skipped by Dynamo for good (issue 35 B1). With ``scope``
    (``live_skips.compile_scope``), its Dynamo callback enters ``scope()`` around each compile, and the entry says
    whether it could (``SCOPED``): then a call whose guards hold needs no settings around it."""
    entry = _entry(model, regional)
    compiled = torch.compile(entry, backend=composite(compiler))
    run = observing_after_errors(compiled, entry)
    run.fxdebug_compile_scoped = scope is not None and on_compile(compiled, scope)  # type: ignore[attr-defined]
    return run
