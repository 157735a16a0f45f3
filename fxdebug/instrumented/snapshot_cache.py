"""The one check before every call of a snapshot module: which graph holds for this call.

A symbolic, export or subtrees module is a snapshot of the model (``snapshot_recipe``). Before each
call ``check_call``:

1. runs the current snapshot's ``StalenessGuard`` (``fxdebug.capture.staleness``): the module tree,
   hooks and symbolic call signature the graph assumed; it follows the root's own flags and refuses
   what cannot be followed (after a switch in step 3, the new snapshot's guard runs too);
2. export: compares the call's signature (arity, keyword names, Python values, container
   structure; shapes too where the capture could not be made dynamic) with the example inputs'.
   A call of another signature runs a capture of its own, made once per signature by the same
   frontend with the same passes on that call's inputs: its own module, with its own observers
   (its rows read ``node@labels`` in the report: ``with_signatures``);
3. compares the training flags of the root and of every submodule, and the attribute values and
   torch modes the graph read, with the current snapshot's. When they differ, the snapshot for the
   new key is taken from the store or captured (once), by the same frontend, on a shell of the model
   whose root carries the new flag, run through the same passes, and swapped in. The note on
   ``trace_info`` says whether the graphs differ. Statistics live in each snapshot's own observers.

One key, one store (``Recipe.snapshots``), one check; the fast path (nothing changed) is a tuple
of flags and one comparison per guarded object.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fxdebug.authoring.context import NAMESPACE
from fxdebug.capture.faithful_reads import mode_now
from fxdebug.errors import TraceError
from fxdebug.instrumented.snapshot_recipe import (
    ModeKey, Recipe, Snapshot, graph_code, graph_digest, guard_holds, guards_of, mark, mode_key, recipe, trace_of)

__all__ = ["call_signature", "check_call", "other_signatures", "with_signatures"]

_LOCK = threading.RLock()
_NAME = "_fxdebug_signature_name"


def check_call(gm: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module | None:
    """Before a call of ``gm``: the module to run instead (a capture of another signature), or ``None``
    to run ``gm``, whose graph is then the one captured for the call's flags and attribute values."""
    rec = recipe(gm)
    if rec is None:
        _without_recipe(gm, args, kwargs)
        return None
    snap = rec.current
    if snap is None:
        return None
    guard = snap.staleness
    if guard is not None:
        guard.follow(gm)
        guard.check(gm, args, kwargs)
    if not rec.frontend:
        return None
    if rec.frontend == "export" and rec.recapture is not None:
        if rec.signature_shapes is None:
            _example_signature(gm, rec)
        if call_signature(args, kwargs, bool(rec.signature_shapes)) != rec.signature:
            return _other_signature(gm, rec, args, kwargs)
    flags = mode_key(gm.training, rec.modules)
    if flags == snap.flags and snap.holds():
        return None
    with _LOCK:
        before = rec.current
        if before is not None and not (flags == before.flags and before.holds()):
            _switch(gm, rec, flags)
    after = rec.current
    guard = after.staleness if after is not None else None
    if guard is not None and guard is not snap.staleness:  # the graph switched to holds its own assumptions
        guard.check(gm, args, kwargs)
    return None


# -- call signatures (export) ------------------------------------------------------------------------
def _kind(value: Any, shapes: bool) -> Any:
    if isinstance(value, Tensor):  # torch.Size compares as a tuple; a dtype compares and hashes as itself
        return ("tensor", value.shape if shapes else value.dim(), value.dtype)
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    leaves, _ = pytree.tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
        return ("object", type(value).__qualname__)
    return ("tree", type(value).__qualname__, len(leaves), tuple(_kind(v, shapes) for v in leaves))


def call_signature(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: bool = False) -> Any:
    """What an export capture fixes about a call: arity, keyword names, values, container shapes.

    ``shapes=True`` adds every tensor's shape, for captures that could not be made dynamic.
    """
    kind = _kind  # read per export call: lists, not generators (no frame per item); no sort without keywords
    return (tuple([kind(a, shapes) for a in args]),
            tuple(sorted([(k, kind(v, shapes)) for k, v in kwargs.items()])) if kwargs else ())


def _dynamic(gm: Any) -> bool:
    return any("dynamic dimensions" in n for n in gm.trace_info.notes)


def _example_signature(gm: nn.Module, rec: Recipe) -> None:
    from fxdebug.graph.inputs import normalize_inputs

    base = normalize_inputs(rec.inputs)
    rec.signature_shapes = not _dynamic(gm)
    rec.signature = call_signature(*base, shapes=rec.signature_shapes) if base is not None else None


def _other_signature(gm: Any, rec: Recipe, args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module:
    sig, shaped = call_signature(args, kwargs), call_signature(args, kwargs, shapes=True)
    found = _routed_for(rec, sig, shaped)
    if found is not None:
        return found
    with _LOCK:
        found = _routed_for(rec, sig, shaped)
        if found is not None:
            return found
        from fxdebug.graph.inputs import Inputs

        assert rec.recapture is not None
        options = {k: v for k, v in rec.options.items() if k in ("dynamic_batch",)}
        other = rec.recapture(rec.model, "export", rec.passes, Inputs(*args, **kwargs), options)
        dynamic = _dynamic(other)
        rec.snapshots.append(Snapshot(None, [], None, None, None, signature=sig if dynamic else shaped,
                                      shapes=not dynamic, routed=other))
        names = sorted(kwargs) if kwargs else [f"{len(args)} positional"]
        other.__dict__[_NAME] = "+".join(n.replace(" ", "_") for n in names)  # its rows read ``node@labels``
        gm.trace_info.notes.append(
            f"export: captured again for a call with another signature ({', '.join(names)}); "
            f"{len(other_signatures(gm))} extra capture(s), reported by "
            "fxdebug.instrumented.snapshot_cache.other_signatures(dbg)")
    return other


def _routed_for(rec: Recipe, sig: Any, shaped: Any) -> nn.Module | None:
    for snap in rec.snapshots:
        if snap.routed is not None and snap.signature == (shaped if snap.shapes else sig):
            return snap.routed
    return None


def other_signatures(gm: nn.Module) -> list[nn.Module]:
    """The captures made for calls of other signatures (export), in the order they were made."""
    rec = recipe(gm)
    return [s.routed for s in rec.snapshots if s.routed is not None] if rec is not None else []


def with_signatures(gm: nn.Module, report: Any) -> Any:
    """``report`` (of ``gm``'s own graph) with the rows and calls of its captures for other signatures.

    A training loop that always passes ``labels=`` runs only the capture for that signature: without
    these rows the report said 0 calls. Rows of such a capture read ``node@labels``.
    """
    extras = other_signatures(gm)
    if not extras:
        return report
    rows, calls = list(report.rows), report.calls
    first = report.first_nonfinite
    for other in extras:
        rep = other.report()  # type: ignore[operator]
        tag = f"@{other.__dict__.get(_NAME, 'signature')}"
        rows.extend(dict(row, node=f"{row['node']}{tag}") for row in rep.rows)
        calls += rep.calls
        if first is None and rep.first_nonfinite is not None:
            first = f"{rep.first_nonfinite}{tag}"
    return dataclasses.replace(report, rows=rows, calls=calls, first_nonfinite=first)


# -- a module without its recipe (loaded from a file, copied) ------------------------------------------
def _without_recipe(gm: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """It cannot be captured again: follow what its record allows, refuse the modes it was not captured in."""
    meta = gm.__dict__.get("meta")
    record: Any = meta.get("fxdebug") if meta is not None else None
    if record is None:
        return
    guard = getattr(trace_of(record), "staleness", None)
    if guard is not None:
        guard.follow(gm)
        guard.check(gm, args, kwargs)
    read = record.get("torch_modes") if hasattr(record, "get") else None
    for name, value in (read or {}).items():
        if mode_now(name) != value:
            raise TraceError(
                f"this {type(gm).__name__}'s graph was captured where torch.{name.split(':')[0]}() was {value} (its "
                "forward branches on it), is called where it is not, and does not know its model any more (it was "
                "loaded from a file or copied without it), so it cannot be captured again. Call it in the modes it "
                "was captured in, or instrument the model again.", module="", op=f"torch.{name.split(':')[0]}")
    fixed = record.get("modes") if hasattr(record, "get") else None
    if fixed is None:
        return
    now = (gm.training, *(m.training for n, m in gm.named_modules() if n and n.split(".")[0] != NAMESPACE))
    if now != tuple(fixed):
        raise TraceError(
            f"this {type(gm).__name__} was captured by torch.export with {'training' if fixed[0] else 'eval'}-mode "
            "flags baked into its ops (dropout, batch-norm), is called with other flags, and does not know its model "
            "any more (it was loaded from a file or copied without it), so it cannot be captured again. Put the "
            "modes back (.train()/.eval()) or instrument the model again.", module="", op=type(gm).__name__)


# -- another key: flags or attribute values ------------------------------------------------------------
def _switch(gm: Any, rec: Recipe, flags: ModeKey) -> None:
    found = next((s for s in rec.snapshots if s.flags == flags and s.holds()), None)
    if found is None:
        found = _capture(gm, rec, flags)
        rec.snapshots.append(found)
        mark(rec, found)
    if found.space is None:
        gm._modules.pop(NAMESPACE, None)
    else:
        gm._modules[NAMESPACE] = found.space
    gm.graph = found.graph  # recompiles
    gm.meta["fxdebug"] = found.meta
    rec.current = found


def _capture(gm: Any, rec: Recipe, flags: ModeKey) -> Snapshot:
    recapture = rec.recapture
    before = rec.current
    assert before is not None and before.flags is not None and recapture is not None
    shell: Any = copy.copy(rec.model)  # shares children, parameters, buffers; carries the root's new flag
    object.__setattr__(shell, "training", flags[0])
    was = "training" if before.flags[0] else "eval"
    now = "training" if flags[0] else "eval"
    reused: Snapshot | None = None
    base = None
    try:
        # outside the call's grad mode and autocast, unless the graph read them (then it is captured in those)
        with _capture_modes(any(m is None for m, _, _ in before.guards)):
            if rec.frontend == "symbolic" and any(s.base for s in rec.snapshots):
                # symbolic tracing is cheap: trace first, and keep one graph (and its statistics) for
                # every set of modes that traces to the same code
                new = recapture(shell, "symbolic", [], rec.inputs, rec.options)
                base = graph_digest(new.graph)
                reused = next((s for s in rec.snapshots if s.base == base), None)
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
        info = trace_of(reused.meta)
        if info is not None and note not in info.notes:
            info.notes.append(note)
        return Snapshot(flags, guards_of(new.meta.get("fxdebug", {}), rec.model), reused.graph, reused.space,
                        reused.meta, base, staleness=reused.staleness)
    meta = new.meta.get("fxdebug", {})
    _note_capture(gm, rec, before, flags, new, meta)
    return Snapshot(flags, guards_of(meta, rec.model), new.graph, new._modules.get(NAMESPACE), meta, base,
                    staleness=getattr(trace_of(meta), "staleness", None))


def _note_capture(gm: Any, rec: Recipe, before: Snapshot, flags: ModeKey, new: Any, meta: Any) -> None:
    """Both snapshots' reports say why the graph was captured again and whether it differs."""
    assert before.flags is not None
    now = "training" if flags[0] else "eval"
    same = graph_code(new.graph) == graph_code(gm.graph)
    changed = sum(a != b for a, b in zip(before.flags, flags))
    attrs = [f"torch.{n.split(':')[0]}()" if m is None else f"{_path(rec.model, m)}.{n}".lstrip(".")
             for m, n, v in before.guards if not guard_holds(m, n, v)]
    why = f"{changed} module flag(s) changed" + (f"; attributes changed: {', '.join(attrs)}" if attrs else "")
    cause = "those attributes" if attrs and not changed else "the training flag"
    note = (f"modes: captured again by {rec.frontend} when called in {now} mode ({why}); "
            + (f"the graph is the same as before: it does not depend on {cause}" if same else
               f"the graph differs from the one before: it depends on {cause}; each set of modes runs its own graph"))
    for record in (meta, gm.meta.get("fxdebug", {})):
        info = trace_of(record)
        if info is not None and note not in info.notes:
            info.notes.append(note)
    if rec.passes and any(not getattr(p, "observe_only", False) for p in rec.passes):
        note2 = "modes: the transform passes ran again on the new graph (their decisions may differ from the first run)"
        info = trace_of(meta)
        if info is not None and note2 not in info.notes:
            info.notes.append(note2)


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


class _no_cuda_autocast:  # noqa: N801 - a context manager used like torch's
    """Capture outside any CUDA autocast region the call happens to run in."""

    def __enter__(self) -> None:
        self._ctx = torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else None
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
