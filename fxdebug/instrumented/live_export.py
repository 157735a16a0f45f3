"""``to_module()`` of a live (Dynamo) module: one plain module that computes what the live module computes.

A live capture is graphs around eager code, not one module, so ``to_module()`` captures a snapshot
of the model as it is now (symbolic tracing, else ``torch.export`` on the example inputs given to
``instrument()``). Its transforms are not left behind (issue 35 B4: ``fixed =
fxdebug.instrument(dbg, [SwapActivation(only_dead=0.5)])`` exported the unfixed model): the live
module's transform passes run over the snapshot, with the prior report they ran with (the dead
fractions ``only_dead`` reads), and the state those transforms made on the live graphs is carried
over to the snapshot's, so the exported module computes with what the live one computes with:

* pruning masks (``Masked`` / ``MaskedValue``, whichever the live graph and the snapshot hold) are
  the live ones, matched by layer path and parameter name: re-ranking weights that training moved
  since would choose other entries;
* any other module a transform added (a fused conv, a baked pruned layer) takes the parameters and
  buffers of the live module added under the same name, when type and shapes agree (they train
  with the live module and drift from the model's own).

Observe-only passes leave nothing in a plain module, as ``to_module()`` of any capture.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn
from torch.fx import GraphModule

from fxdebug.authoring.pipeline import Pass
from fxdebug.capture.base import TraceOptions
from fxdebug.errors import PassError, TraceError, UsageError
from fxdebug.graph.edits import NAMESPACE
from fxdebug.graph.meta import graph_record
from fxdebug.graph.inputs import normalize_inputs
from fxdebug.report.report import Report

__all__ = ["live_to_module", "refuse_tracing"]


def live_to_module(model: nn.Module, passes: Sequence[Pass], prior: Report | None, example_inputs: Any,
                   parts: Iterable[nn.Module], shrink: bool = False) -> nn.Module:
    """A plain module of ``model`` as it is now with the transforms of ``passes`` (see the module doc).

    ``parts``: the live module's instrumented graphs (where the transforms' state is read from).
    """
    from fxdebug.instrumented.pipeline import capture_module, run_pipeline

    inputs = normalize_inputs(example_inputs)
    transforms = [p for p in passes if not p.observe_only]
    why = []
    for frontend in ("symbolic", "export"):
        if frontend == "export" and inputs is None:
            why.append("export needs the example inputs, and instrument() was given none")
            break
        try:
            snapshot = capture_module(frontend, model, inputs, TraceOptions())
        except TraceError as exc:
            why.append(f"{frontend}: {exc.message}")
            continue
        if transforms:
            parts = list(parts)
            snapshot = run_pipeline(snapshot, transforms, example_inputs, prior)
            _refuse_vanished(parts, snapshot, transforms)
            carry_transform_state(parts, snapshot)
        return snapshot.to_module(shrink=shrink)
    raise UsageError("to_module() makes one plain GraphModule, a snapshot of the model, and none could be captured ("
                     + "; ".join(why) + "). A live (Dynamo) capture is graphs around eager code, not one module.")


def refuse_tracing(model: nn.Module) -> None:
    """A typed error when TorchScript traces a live module (``torch.jit.trace``; ``torch.onnx.export(...,
    dynamo=False)``, which traces with it): its graphs run through TorchDynamo, which tracing cannot enter, and torch
    would fail deep inside ("using FX to torch.jit.trace a dynamo-optimized function"). The plain module is the
    thing to trace or export."""
    if torch.jit.is_tracing():
        name = type(model).__name__
        raise UsageError(f"torch.jit.trace / torch.onnx.export(dynamo=False) of the live (Dynamo) instrumented {name}: "
                         "TorchScript tracing cannot run Dynamo's graphs. Trace or export the plain module instead: "
                         "torch.onnx.export(dbg.to_module(), args, ...) or torch.jit.trace(dbg.to_module(), args); "
                         "it keeps the transforms and leaves fxdebug's observers out.", module="", op="torch.jit.trace")


def _changes(modules: Iterable[nn.Module], name: str) -> list[str]:
    """The nodes pass ``name`` added or replaced in ``modules``' graphs (their records of what each pass did)."""
    out: list[str] = []
    for gm in modules:
        if not isinstance(gm, GraphModule):
            continue
        for result in graph_record(gm).passes:
            if result.pass_name == name:
                out.extend(n for n in [*result.replaced, *result.added] if n not in out)
    return out


def _refuse_vanished(parts: list[nn.Module], snapshot: nn.Module, transforms: Sequence[Pass]) -> None:
    """A transform that changed the live graphs and nothing in the snapshot: a typed error, not a module without it.

    The two captures name nodes alike (module path + op + occurrence), but not always (an ``export`` snapshot's aten
    names): ``SwapActivation(only_dead=)`` reads the prior report by node name and could then match nothing.
    """
    snap_parts = list(getattr(snapshot, "parts", lambda: {"": snapshot})().values())
    for p in transforms:
        name = getattr(p, "name", type(p).__name__)
        live = _changes(parts, name)
        if live and not _changes(snap_parts, name):
            raise PassError(f"to_module(): {name} changed the live capture ({len(live)} node(s): "
                            f"{', '.join(live[:5])}) but nothing in the snapshot to_module() builds (the two captures "
                            "do not name those nodes alike). Instrument the model with frontend='symbolic' (or 'export') "
                            "and the same passes, then call to_module() on that.", pass_name=name)


def _added(gm: nn.Module) -> dict[str, nn.Module]:
    """``{target: module}`` of the modules fxdebug's passes added that ``gm``'s graph calls."""
    out: dict[str, nn.Module] = {}
    graph = getattr(gm, "graph", None)
    for node in graph.nodes if graph is not None else ():
        target = str(node.target)
        if node.op != "call_module" or not target.startswith(f"{NAMESPACE}."):
            continue
        value: Any = gm
        try:
            for name in target.split("."):
                value = getattr(value, name)
        except AttributeError:
            continue
        if isinstance(value, nn.Module):
            out[target] = value
    return out


def _masks(module: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """``{(layer path, parameter): mask}`` of a masking module (``Masked``, ``MaskedValue``; by shape: the core
    does not import the pass library)."""
    path = getattr(module, "path", None)
    if not isinstance(path, str):
        return {}
    value, name = getattr(module, "mask_value", None), getattr(module, "name", None)
    if isinstance(value, torch.Tensor) and isinstance(name, str):
        return {(path, name): value}
    names, mask = getattr(module, "names", None), getattr(module, "mask", None)
    if isinstance(names, list) and callable(mask):
        return {(path, n): mask(n) for n in names}
    return {}


def _set_mask(module: nn.Module, name: str, value: torch.Tensor) -> bool:
    attr = "mask_value" if hasattr(module, "mask_value") else f"mask_{name}"
    have = module._buffers.get(attr)
    if have is None or have.shape != value.shape:
        return False
    with torch.no_grad():
        have.copy_(value)
    return True


def carry_transform_state(parts: list[nn.Module], snapshot: nn.Module) -> None:
    """Give ``snapshot``'s transform modules the state of the live ``parts``' (masks; same-named added modules)."""
    live_masks: dict[tuple[str, str], torch.Tensor] = {}
    live_modules: dict[str, nn.Module] = {}
    for part in parts:
        for target, module in _added(part).items():
            found = _masks(module)
            live_masks.update(found)
            if not found:
                live_modules.setdefault(target, module)
    for snap_part in getattr(snapshot, "parts", lambda: {"": snapshot})().values():
        for target, module in _added(snap_part).items():
            found = _masks(module)
            if found:
                for (path, name), _ in found.items():
                    if (path, name) in live_masks:
                        _set_mask(module, name, live_masks[(path, name)])
                continue
            source = live_modules.get(target)
            if source is not None and type(source) is type(module):
                _copy_state(source, module)


def _copy_state(source: nn.Module, dest: nn.Module) -> None:
    have: dict[str, torch.Tensor] = {**dict(source.named_parameters()), **dict(source.named_buffers())}
    want: dict[str, torch.Tensor] = {**dict(dest.named_parameters()), **dict(dest.named_buffers())}
    if set(have) != set(want) or any(have[k].shape != want[k].shape for k in want):
        return  # another structure: the snapshot's own transform stands
    with torch.no_grad():
        for key, tensor in want.items():
            tensor.copy_(have[key])
