"""One graph per training mode: an instrumented module never runs the other mode's graph.

A captured graph is specialised to the modes its modules were in: symbolic tracing evaluates
``if self.training:`` and ``F.dropout(x, training=self.training)`` once, and ``torch.export``
bakes the mode into every op (``aten.dropout(train=False)``, batch-norm without running
statistics). After ``dbg.train()`` on a module instrumented in eval, that graph would keep
computing eval-mode results with no error.

Every instrumented module remembers how it was made (the model, frontend, example inputs, trace
options and passes: a ``Recipe``). Each call compares the training flags of the root and of
every submodule with those the current graph was captured under (a tuple of booleans, a few
microseconds); when they differ, the graph for the new modes is captured (once: it is kept) by
the same frontend on a shell of the model whose root carries the new flag, run through the same
passes, and swapped in. The note on ``trace_info`` says whether the two graphs differ. Statistics
live in each mode's own observers: the report shows the current mode's.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.fx import Graph

from fxdebug.capture.faithful_reads import TORCH, guard_value, mode_now
from fxdebug.errors import TraceError

NAMESPACE = "fxdebug"  # fxdebug's own modules on an instrumented module (context.NAMESPACE)

__all__ = ["Recipe", "ensure_mode", "follow_mode", "mode_key", "recipe", "remember"]

_ATTR = "_fxdebug_recipe"
_LOCK = threading.RLock()

ModeKey = tuple[bool, ...]


Guards = list[tuple[Any, str, Any]]  # (module or config object, attribute, value the capture saw; None: torch's mode)
# (model, frontend, passes, example inputs, trace options) -> the module captured again with those passes:
# fxdebug.instrumented.pipeline.recapture, given by whoever records a recipe (this module never imports it)
Recapture = Callable[[nn.Module, str, Sequence[Any], Any, dict[str, Any]], Any]


@dataclass
class Capture:
    """One graph, the training flags it was captured under and the plain attributes it read."""

    flags: ModeKey
    guards: Guards
    graph: Graph
    space: nn.Module | None
    meta: Any
    base: bytes | None = None  # _signature of the captured graph before any pass ran (symbolic: reuse across modes)
    _check: Any = field(default=None, repr=False, compare=False)

    def holds(self) -> bool:
        """Every guard still holds (``_holds``, compiled once: an HF config gives ~150 guards, read per call)."""
        check = self._check
        if check is None:
            check = self._check = _Checker(self.guards)
        return bool(check())


@dataclass
class Recipe:
    """How an instrumented module was captured, so that it can be captured again in other modes.

    ``frontend`` is ``""`` where the module itself is never re-captured (the eager root of the
    subtrees frontend: its captured parts carry their own recipes). ``current`` is the capture
    installed now; ``captures`` every one made so far (a graph holds for the flags it was
    captured under and whatever values of attributes it never read).
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
    current: Capture | None = None
    captures: list[Capture] = field(default_factory=list)


def recipe(gm: Any) -> Recipe | None:
    return gm.__dict__.get(_ATTR)


_MISSING = object()


def mode_key(root_training: bool, modules: Sequence[nn.Module]) -> ModeKey:
    """The training flags of the root and of every submodule, in order."""
    if torch.compiler.is_compiling():  # Dynamo cannot call an attrgetter (a graph break)
        return (root_training, *(m.training for m in modules))
    return (root_training, *map(_TRAINING, modules))  # map + attrgetter: no generator frame per module (read every call)


_TRAINING = operator.attrgetter("training")


def _holds(guards: Guards) -> bool:
    for m, name, value in guards:
        now = m.__dict__.get(name, _MISSING) if m is not None else mode_now(name)  # None: one of torch's modes
        if now is not value and (type(now) is not type(value) or now != value):
            return False
    return True


class _Checker:
    """``_holds(guards)`` as one C-level ``itemgetter`` and tuple comparison per object guarded: ~150 guards
    of a config object cost a few microseconds a call instead of ~100 (values compare by ``==``)."""

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


def _guards_of(record: Any, model: nn.Module) -> Guards:
    """``(object, attribute, value)`` for each guard of a capture: a module's attribute, a config object's
    (``"cfg.scale"``), or ``(None, "is_grad_enabled", True)`` for a mode of torch the trace read."""
    info = record.get("trace") if hasattr(record, "get") else None
    out: Guards = []
    for path, name, value in getattr(info, "guards", ()):
        if path == TORCH:
            out.append((None, name, value))
            continue
        try:
            owner, attr = guard_value(model.get_submodule(path), name)
        except (AttributeError, KeyError):
            continue
        out.append((owner, attr, value))
    return out


def _descendants(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules() if name]


def _code(graph: Graph) -> str:
    return graph.python_code("self").src


def _signature(graph: Graph) -> bytes:
    """A digest of what ``graph``'s Python code is written from: each node's op, name, target, arguments
    and type annotation, in order, and the code generator's input/output spec. Two symbolic traces with
    the same signature have the same code; it is ~10x cheaper than generating that code (which grows
    faster than the graph: 1.1 s at 100k nodes), and a digest, not the text, is what a capture keeps."""
    digest = hashlib.blake2b(digest_size=32)
    codegen = graph._codegen
    try:
        digest.update(repr((type(codegen).__qualname__, getattr(codegen, "pytree_info", None))).encode())
        for n in graph.nodes:
            digest.update(repr((n.op, n.name, n.target, n.args, n.kwargs, n.type)).encode())
    except Exception:  # an argument whose repr fails: the generated code itself, as before
        return b"code:" + _code(graph).encode()
    return digest.digest()


def _install_recipe(gm: Any, rec: Recipe, base: bytes | None = None) -> None:
    meta = gm.meta.get("fxdebug", {})
    rec.current = Capture(mode_key(gm.training, rec.modules), _guards_of(meta, rec.model), gm.graph,
                          gm._modules.get(NAMESPACE), meta, base)
    rec.captures = [rec.current]
    object.__setattr__(gm, _ATTR, rec)
    _mark(rec, rec.current)


def _mark(rec: Recipe, capture: Capture) -> None:
    """Export graphs bake the modes in: their record keeps the flags, checked even without a recipe."""
    if rec.frontend == "export" and hasattr(capture.meta, "__setitem__"):
        capture.meta["modes"] = capture.flags
    reads = {name: value for m, name, value in capture.guards if m is None}
    if reads and hasattr(capture.meta, "__setitem__"):  # torch's modes the graph read: checked after a copy too
        capture.meta["torch_modes"] = reads


def _refuse_other_modes(gm: Any) -> None:
    """A module loaded from a file (or made without ``instrument``) cannot be captured again: refuse."""
    record: Any = gm.meta.get("fxdebug")  # gm: an Instrumented module (a GraphModule: it has meta)
    read = record.get("torch_modes") if record is not None and hasattr(record, "get") else None
    for name, value in (read or {}).items():
        if mode_now(name) != value:
            raise TraceError(
                f"this {type(gm).__name__}'s graph was captured where torch.{name.split(':')[0]}() was {value} (its "
                "forward branches on it), is called where it is not, and does not know its model any more (it was "
                "loaded from a file or copied without it), so it cannot be captured again. Call it in the modes it "
                "was captured in, or instrument the model again.", module="", op=f"torch.{name.split(':')[0]}")
    fixed = record.get("modes") if record is not None and hasattr(record, "get") else None
    if fixed is None:
        return
    now = (gm.training, *(m.training for n, m in gm.named_modules() if n and n.split(".")[0] != NAMESPACE))
    if now != tuple(fixed):
        raise TraceError(
            f"this {type(gm).__name__} was captured by torch.export with {'training' if fixed[0] else 'eval'}-mode "
            "flags baked into its ops (dropout, batch-norm), is called with other flags, and does not know its model "
            "any more (it was loaded from a file or copied without it), so it cannot be captured again. Put the "
            "modes back (.train()/.eval()) or instrument the model again.", module="", op=type(gm).__name__)


def remember(gm: Any, model: Any, passes: Sequence[Any], example_inputs: Any,
             options: dict[str, Any], recapture: Recapture) -> None:
    """Record on ``gm`` (and on each captured part) how to capture it again in other modes."""
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
            base = _signature(gm.graph) if not passes and inner is None else None
        _install_recipe(gm, rec, base)
        return
    rec.part_inputs = dict(previous.part_inputs) if previous is not None else {}
    known = rec.part_inputs
    _install_recipe(gm, rec)
    from fxdebug.capture.symbolic import Inputs

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
        _install_recipe(part, Recipe(
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


def ensure_mode(gm: Any) -> None:
    """Before a call: make sure ``gm`` runs the graph captured for the modes its modules are in now."""
    rec = gm.__dict__.get(_ATTR)
    if rec is None:
        _refuse_other_modes(gm)
        return
    if not rec.frontend or rec.current is None:
        return
    flags = mode_key(gm.training, rec.modules)
    if flags == rec.current.flags and rec.current.holds():
        return
    with _LOCK:
        if not (flags == rec.current.flags and rec.current.holds()):
            _switch(gm, rec, flags)


def _switch(gm: Any, rec: Recipe, flags: ModeKey) -> None:
    found = next((c for c in rec.captures if c.flags == flags and c.holds()), None)
    if found is None:
        found = _capture(gm, rec, flags)
        rec.captures.append(found)
        _mark(rec, found)
    if found.space is None:
        gm._modules.pop(NAMESPACE, None)
    else:
        gm._modules[NAMESPACE] = found.space
    gm.graph = found.graph  # recompiles
    gm.meta["fxdebug"] = found.meta
    rec.current = found


def _capture(gm: Any, rec: Recipe, flags: ModeKey) -> Capture:
    recapture = rec.recapture
    before = rec.current
    assert before is not None and recapture is not None
    shell: Any = copy.copy(rec.model)  # shares children, parameters, buffers; carries the root's new flag
    object.__setattr__(shell, "training", flags[0])
    was = "training" if before.flags[0] else "eval"
    now = "training" if flags[0] else "eval"
    reused: Capture | None = None
    base = None
    try:
        # outside the call's grad mode and autocast, unless the graph read them (then it is captured in those)
        with _capture_modes(any(m is None for m, _, _ in before.guards)):
            if rec.frontend == "symbolic" and any(c.base for c in rec.captures):
                # symbolic tracing is cheap: trace first, and keep one graph (and its statistics) for
                # every set of modes that traces to the same code
                new = recapture(shell, "symbolic", [], rec.inputs, rec.options)
                base = _signature(new.graph)
                reused = next((c for c in rec.captures if c.base == base), None)
                if reused is None and rec.passes:
                    new = recapture(new, "symbolic", rec.passes, rec.inputs, rec.options)
            else:
                new = recapture(shell, rec.frontend, rec.passes, rec.inputs, rec.options)
    except Exception as exc:
        raise TraceError(
            f"{type(rec.model).__name__} was captured in {was} mode and is now called in {now} mode; capturing "
            f"it again for the new modes failed: {getattr(exc, 'message', str(exc))}. Instrument the model in "
            "the mode you run it in.", module="", op=type(rec.model).__name__) from exc
    if reused is not None:
        note = (f"modes: called in {now} mode; {rec.frontend} traces the same graph as for the modes before, "
                "so one graph and its statistics serve both: it does not depend on the training flag")
        info = reused.meta.get("trace") if hasattr(reused.meta, "get") else None
        if info is not None and note not in info.notes:
            info.notes.append(note)
        return Capture(flags, _guards_of(new.meta.get("fxdebug", {}), rec.model), reused.graph, reused.space,
                       reused.meta, base)
    meta = new.meta.get("fxdebug", {})
    same = _code(new.graph) == _code(gm.graph)
    changed = sum(a != b for a, b in zip(before.flags, flags))
    attrs = [f"torch.{n.split(':')[0]}()" if m is None else f"{_path(rec.model, m)}.{n}".lstrip(".")
             for m, n, v in before.guards if not _holds([(m, n, v)])]
    why = f"{changed} module flag(s) changed" + (f"; attributes changed: {', '.join(attrs)}" if attrs else "")
    cause = "those attributes" if attrs and not changed else "the training flag"
    note = (f"modes: captured again by {rec.frontend} when called in {now} mode ({why}); "
            + (f"the graph is the same as before: it does not depend on {cause}" if same else
               f"the graph differs from the one before: it depends on {cause}; each set of modes runs its own graph"))
    for record in (meta, gm.meta.get("fxdebug", {})):  # both modes' reports say it
        info = record.get("trace") if hasattr(record, "get") else None
        if info is not None and note not in info.notes:
            info.notes.append(note)
    if rec.passes and any(not getattr(p, "observe_only", False) for p in rec.passes):
        note2 = "modes: the transform passes ran again on the new graph (their decisions may differ from the first run)"
        if note2 not in getattr(meta.get("trace"), "notes", [note2]):
            meta.get("trace").notes.append(note2)
    return Capture(flags, _guards_of(meta, rec.model), new.graph, new._modules.get(NAMESPACE), meta, base)


def _path(model: nn.Module, module: Any) -> str:
    """The module path of ``module``, or ``path.attr`` of the config object a module holds."""
    for p, m in model.named_modules():
        if m is module:
            return p
        held = next((k for k, v in m.__dict__.items() if v is module), None)
        if held is not None:
            return f"{p}.{held}".lstrip(".")
    return "?"


@contextlib.contextmanager
def _capture_modes(as_called: bool) -> Iterator[None]:
    if as_called:
        yield
        return
    with torch.enable_grad(), torch.autocast("cpu", enabled=False), _no_cuda_autocast():
        yield


class _no_cuda_autocast:
    """Capture outside any CUDA autocast region the call happens to run in."""

    def __enter__(self) -> None:
        self._ctx = torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else None
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
