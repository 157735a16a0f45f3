"""What a snapshot module keeps to be captured again: its ``Recipe`` and the ``Snapshot``s made from it.

A symbolic or export graph is specialised to what forward read while it was captured: the training
flags of the root and of every submodule (``if self.training:``, ``aten.dropout(train=False)``),
plain attributes (``if self.config.use_cache:``), torch's grad mode or autocast, and, for export,
the call signature (which keywords, Python values, container structure). Every instrumented module
remembers how it was made (the model, frontend, example inputs, trace options and passes: a
``Recipe``) and the ``Snapshot``s captured from it so far, one store. The per-call check that picks
the snapshot for a call, and captures a new one, is ``snapshot_cache.check_call``.

A snapshot's key is what it was captured under: the training flags (``flags``), the values of the
attributes and torch modes it read (``guards``, compared by value), and, for export, the call
signature (``signature``). ``remember`` writes the recipe and the first snapshot; nothing here
captures (capturing is ``instrumented.pipeline.recapture``, handed in as data, one floor up).
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.fx import Graph

from fxdebug.authoring.context import NAMESPACE
from fxdebug.capture.faithful_reads import TORCH, guard_value, mode_now

__all__ = ["Recipe", "Snapshot", "follow_mode", "graph_digest", "mode_key", "recipe", "remember"]

_ATTR = "_fxdebug_recipe"

ModeKey = tuple[bool, ...]
Guards = list[tuple[Any, str, Any]]  # (module or config object, attribute, value the capture saw; None: torch's mode)
# (model, frontend, passes, example inputs, trace options) -> the module captured again with those passes:
# fxdebug.instrumented.pipeline.recapture, given by whoever records a recipe (this module never imports it)
Recapture = Callable[[nn.Module, str, Sequence[Any], Any, dict[str, Any]], Any]


@dataclass
class Snapshot:
    """One captured graph and the key it holds for: training flags, attribute values read, call signature.

    ``flags`` is ``None`` for a capture of another call signature (export): it is a module of its own
    (``routed``), with its own recipe and snapshots for the modes it is called in.
    """

    flags: ModeKey | None
    guards: Guards
    graph: Graph | None
    space: nn.Module | None  # fxdebug's modules (observers) the graph refers to
    meta: Any
    base: bytes | None = None  # graph_digest of the graph before any pass ran (symbolic: reuse across modes)
    signature: Any = None  # export: the call signature this snapshot takes (shapes or not: ``shapes``)
    shapes: bool = False
    routed: nn.Module | None = None  # a capture of another signature: the call runs this module
    staleness: Any = None  # the capture's StalenessGuard (fxdebug.capture.staleness), checked before each call
    _check: Any = field(default=None, repr=False, compare=False)

    def holds(self) -> bool:
        """Every attribute value and torch mode the graph read is still what it was (``_Checker``, built once)."""
        check = self._check
        if check is None:
            check = self._check = _Checker(self.guards)
        return bool(check())


@dataclass
class Recipe:
    """How an instrumented module was captured, so that it can be captured again for another key.

    ``frontend`` is ``""`` where the module itself is never re-captured (the eager root of the
    subtrees frontend: its captured parts carry their own recipes). ``current`` is the snapshot
    installed now; ``snapshots`` the one store: every snapshot made so far, of every key.
    """

    model: nn.Module
    frontend: str
    inputs: Any
    options: dict[str, Any]
    passes: list[Any]
    modules: list[nn.Module]
    recapture: Recapture | None = None  # capture + passes on this floor (fxdebug.instrumented.pipeline)
    part_inputs: dict[str, Any] = field(default_factory=dict)  # subtrees: each part's recorded inputs
    part: bool = False  # a captured submodule of the subtrees frontend (it stands in for ``model``)
    current: Snapshot | None = None
    snapshots: list[Snapshot] = field(default_factory=list)
    signature: Any = None  # export: the example inputs' call signature, worked out at the first call
    signature_shapes: bool | None = None  # None: not worked out yet


def recipe(gm: Any) -> Recipe | None:
    return gm.__dict__.get(_ATTR)


_MISSING = object()
_TRAINING = operator.attrgetter("training")


def mode_key(root_training: bool, modules: Sequence[nn.Module]) -> ModeKey:
    """The training flags of the root and of every submodule, in order."""
    if torch.compiler.is_compiling():  # Dynamo cannot call an attrgetter (a graph break)
        return (root_training, *(m.training for m in modules))
    return (root_training, *map(_TRAINING, modules))  # map + attrgetter: no generator frame per module (read every call)


def guard_holds(owner: Any, name: str, value: Any) -> bool:
    now = owner.__dict__.get(name, _MISSING) if owner is not None else mode_now(name)  # None: one of torch's modes
    return now is value or (type(now) is type(value) and now == value)


class _Checker:
    """Every guard of a snapshot as one C-level ``itemgetter`` and tuple comparison per object guarded: ~150
    guards of an HF config cost a few microseconds a call instead of ~100 (values compare by ``==``)."""

    def __init__(self, guards: Guards) -> None:
        by_owner: dict[int, tuple[Any, list[str], list[Any]]] = {}
        self.modes: list[tuple[str, Any]] = []
        for m, name, value in guards:
            if m is None:
                self.modes.append((name, value))
                continue
            entry = by_owner.setdefault(id(m), (m, [], []))
            entry[1].append(name)
            entry[2].append(value)
        # a tuple compares its items by identity first (a NaN value seen holds); one name: a 1-tuple too
        self.objects = [(m.__dict__, operator.itemgetter(*names) if len(names) > 1 else _one(names[0]), tuple(values))
                        for m, names, values in by_owner.values()]

    def __call__(self) -> bool:
        try:
            for state, get, values in self.objects:
                if get(state) != values:
                    return False
        except KeyError:
            return False
        return all(mode_now(name) == value for name, value in self.modes)


class _one:  # noqa: N801 - an itemgetter of one name that returns a 1-tuple (picklable, unlike a closure)
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, state: dict[str, Any]) -> tuple[Any]:
        return (state[self.name],)


def trace_of(record: Any) -> Any:
    """The ``TraceInfo`` of a graph's fxdebug record (a ``GraphRecord`` or a plain dict), or ``None``."""
    return record.get("trace") if hasattr(record, "get") else getattr(record, "trace", None)


def guards_of(record: Any, model: nn.Module) -> Guards:
    """``(object, attribute, value)`` for each guard of a capture: a module's attribute, a config object's
    (``"cfg.scale"``), or ``(None, "is_grad_enabled", True)`` for a mode of torch the trace read."""
    out: Guards = []
    for path, name, value in getattr(trace_of(record), "guards", ()):
        if path == TORCH:
            out.append((None, name, value))
            continue
        try:
            owner, attr = guard_value(model.get_submodule(path), name)
        except (AttributeError, KeyError):
            continue
        out.append((owner, attr, value))
    return out


def graph_code(graph: Graph) -> str:
    return graph.python_code("self").src


def graph_digest(graph: Graph) -> bytes:
    """A digest of what ``graph``'s Python code is written from: each node's op, name, target, arguments
    and type annotation, in order, and the code generator's input/output spec. Two symbolic traces with
    the same digest have the same code; it is ~10x cheaper than generating that code (which grows
    faster than the graph: 1.1 s at 100k nodes), and a digest, not the text, is what a snapshot keeps."""
    digest = hashlib.blake2b(digest_size=32)
    codegen = graph._codegen
    try:
        digest.update(repr((type(codegen).__qualname__, getattr(codegen, "pytree_info", None))).encode())
        for n in graph.nodes:
            digest.update(repr((n.op, n.name, n.target, n.args, n.kwargs, n.type)).encode())
    except Exception:  # an argument whose repr fails: the generated code itself
        return b"code:" + graph_code(graph).encode()
    return digest.digest()


def snapshot_of(gm: Any, rec: Recipe, flags: ModeKey, base: bytes | None = None) -> Snapshot:
    """The snapshot ``gm`` (a captured module) is, for ``rec``'s model and the flags it was captured under."""
    meta = gm.meta.get("fxdebug", {})
    return Snapshot(flags, guards_of(meta, rec.model), gm.graph, gm._modules.get(NAMESPACE), meta, base,
                    staleness=getattr(trace_of(meta), "staleness", None))


def mark(rec: Recipe, snap: Snapshot) -> None:
    """What a graph read, written into its record, so that a copy without its recipe still refuses other
    modes (``snapshot_cache``): export graphs bake the training flags in; any graph, torch's modes read."""
    if not hasattr(snap.meta, "__setitem__"):
        return
    if rec.frontend == "export":
        snap.meta["modes"] = snap.flags
    reads = {name: value for m, name, value in snap.guards if m is None}
    if reads:
        snap.meta["torch_modes"] = reads


def _install(gm: Any, rec: Recipe, base: bytes | None = None) -> None:
    rec.current = snapshot_of(gm, rec, mode_key(gm.training, rec.modules), base)
    rec.snapshots = [rec.current]
    object.__setattr__(gm, _ATTR, rec)
    mark(rec, rec.current)


def _descendants(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules() if name]


def remember(gm: Any, model: Any, passes: Sequence[Any], example_inputs: Any,
             options: dict[str, Any], recapture: Recapture) -> None:
    """Record on ``gm`` (and on each captured part) how to capture it again for another key."""
    inner = recipe(model)
    if inner is not None:  # instrument(instrument(m)): the same model, the passes of both
        model, passes, example_inputs = inner.model, [*inner.passes, *passes], inner.inputs
        options = {**inner.options, **options}
    options = {k: v for k, v in options.items() if k in ("leaf_modules", "auto_leaf", "dynamic_batch")}
    frontend = gm.trace_info.frontend
    parts = gm.parts()
    top = frontend if frontend in ("symbolic", "export") else ""
    previous = recipe(gm)
    rec = Recipe(model, top, example_inputs, dict(options), list(passes), _descendants(model), recapture)
    if top:
        if previous is not None and previous.current is not None and previous.current.graph is gm.graph:
            base = previous.current.base  # instrument(): trace() saw this graph before the passes
        else:
            base = graph_digest(gm.graph) if not passes and inner is None else None
        _install(gm, rec, base)
        return
    rec.part_inputs = dict(previous.part_inputs) if previous is not None else {}
    known = rec.part_inputs
    _install(gm, rec)
    from fxdebug.graph.inputs import Inputs

    for path, part in parts.items():
        if not path or part is gm:
            continue
        module: Any = model.get_submodule(path)
        recorded = part.recorded_inputs()  # Part.inputs, as the frontend recorded them
        inputs = Inputs(*recorded[0], **recorded[1]) if recorded is not None else known.get(path)
        rec.part_inputs[path] = inputs
        prefix = f"{path}."
        leaves = [x if isinstance(x, type) else str(x)[len(prefix):] for x in options.get("leaf_modules", ())
                  if isinstance(x, type) or str(x).startswith(prefix)]
        sub = {**options, "leaf_modules": leaves}
        frontend_of_part = part.trace_info.frontend
        _install(part, Recipe(
            module, frontend_of_part if inputs is not None or frontend_of_part == "symbolic" else "",
            inputs, sub, list(passes), _descendants(module), recapture, part=True))


def follow_mode(gm: Any, mode: bool) -> None:
    """``part.train(mode)``: the submodule a captured part stands in for takes the flag too.

    With one graph the model's submodules are the instrumented module's own, so ``dbg.train()``
    reaches them; a part of the subtrees frontend replaces its module in the eager root, so
    the module is switched here, and the model reads the same modes either way.
    """
    rec = gm.__dict__.get(_ATTR)
    if rec is not None and rec.part:
        rec.model.training = mode
