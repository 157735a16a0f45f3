"""``DeviceCheck``: before an op runs, are all its tensors (parameters included) on one device?

Torch's own error names an aten op ("Expected all tensors to be on the same device ... for
argument #1 'mat1'"). This pass inserts, *before* each op that could mix devices, a guard that
reads ``tensor.device`` of every tensor input and of the module's parameters and buffers —
metadata, no device work — and raises ``DeviceMismatchError`` naming the node, its module, each
input with the node that produced it and its device, and what to move.

Ops with a single tensor input and no parameters cannot mix devices and get no guard. 0-d CPU
tensors are exempt, as in torch (they act as scalars on any device).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxdebug import DeviceMismatchError
from fxdebug.authoring import (
    INSTRUMENTATION,
    Pass,
    PassContext,
    PassResult,
    describe,
    get_module,
    is_instrumentation,
    module_path,
    node_identity,
    node_meta,
    op_label,
    source_line,
)

__all__ = ["DeviceCheck", "check_devices"]


def _counts(t: Tensor) -> bool:
    return not (t.dim() == 0 and t.device.type == "cpu")


_Info = tuple[tuple[str, str, str], str, str, str, str, tuple[str, ...], tuple[str, ...]]


def check_devices(info: _Info, module: nn.Module | None, *inputs: Any) -> None:
    """Raise ``DeviceMismatchError`` if ``inputs`` and ``module``'s tensors span several devices.

    ``info`` is ``(description, node, module path, op, source line, input names, held)``, fixed at
    instrumentation time so the success path only reads devices; ``held[i]`` is the qualified name of
    the parameter or buffer input ``i`` reads (a ``get_attr`` node: how Dynamo and export graphs pass
    weights to ``torch.linear``), else ``""``.
    """
    first: torch.device | None = None
    mixed = False
    for t in inputs:
        if isinstance(t, Tensor) and _counts(t):
            if first is None:
                first = t.device
            elif t.device != first:
                mixed = True
                break
    if not mixed and module is not None:
        for t in _module_tensors(module):
            if first is None:
                first = t.device
            elif t.device != first:
                mixed = True
                break
    if mixed:
        raise _error(info, module, inputs)


def _module_tensors(module: nn.Module) -> Any:
    yield from module.parameters()
    yield from module.buffers()


def _error(info: _Info, module: nn.Module | None, inputs: tuple[Any, ...]) -> DeviceMismatchError:
    named, node, path, op, where, names, held = info
    parts = []
    module_devices: dict[str, list[str]] = {}
    for name, qualname, t in zip(names, held, inputs):
        if isinstance(t, Tensor) and qualname:  # the model's own weights, read as a graph input
            module_devices.setdefault(str(t.device), []).append(qualname)
        elif isinstance(t, Tensor):
            parts.append(f"input '{name}' {tuple(t.shape)} on {t.device}")
    if module is not None:
        for pname, t in list(module.named_parameters()) + list(module.named_buffers()):
            module_devices.setdefault(str(t.device), []).append(f"{path}.{pname}" if path else pname)
    for dev, tensors in module_devices.items():
        shown = ", ".join(tensors[:4]) + (f" and {len(tensors) - 4} more" if len(tensors) > 4 else "")
        parts.append(f"parameters {shown} on {dev}")
    if module_devices and len(module_devices) == 1:
        target = next(iter(module_devices))
        fix = (f"Move the inputs to {target} (x = x.to('{target}')), or the model to the inputs' device "
               "(model.to(x.device)); create tensors inside forward with device=x.device.")
    else:
        fix = ("Move them to one device: model.to(device) for parameters, x.to(device) for inputs, and "
               "device=x.device for tensors created inside forward.")
    at = f" Defined at {where}." if where else ""
    return DeviceMismatchError(f"DeviceCheck: {describe(named)} would mix devices: {'; '.join(parts)}. {fix}{at}",
                               node=node, module=path, op=op)


def _state_read(gm: GraphModule) -> set[str]:
    """The ``get_attr`` targets of ``gm`` that are a parameter or buffer, by the name the graph reads (a shared one
    may be read under either of its names). Looked up per node: a live part over a large model reads a few of its
    parameters, and walking all of them for each part was quadratic in the model's depth."""
    out = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        path, _, attr = str(node.target).rpartition(".")
        try:
            owner = gm.get_submodule(path) if path else gm
        except AttributeError:
            continue
        if attr in owner._parameters or attr in owner._buffers:
            out.add(str(node.target))
    return out


class DeviceCheck(Pass):
    """Guard every op that could mix devices; see the module docstring.

    Args:
        where: limit the guarded nodes (globs over module paths / node names, or a predicate).
    """

    name = "device-check"
    observe_only = True
    shares_instances = True  # its guards' facts are identities (node_identity), worded when a guard fails
    requires = ("shapes",)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        added = []
        state = _state_read(gm)
        for node in ctx.nodes(gm, self.where):
            module = get_module(gm, node)
            has_state = module is not None and any(True for _ in _module_tensors(module))
            tensors = [a for a in node.all_input_nodes if not is_instrumentation(a)
                       and ctx.tensor_spec(a) is not None]
            if len(tensors) + (1 if has_state else 0) < 2:
                continue
            added.extend(self._guard(ctx, node, tensors, has_state, state))
        return PassResult(gm, added=added)

    @staticmethod
    def _guard(ctx: PassContext, node: Node, tensors: list[Node], has_state: bool, state: set[str]) -> list[Node]:
        info = (node_identity(node), node.name, module_path(node), op_label(node), source_line(node) or "",
                tuple(a.name for a in tensors),
                tuple(str(a.target) if a.op == "get_attr" and str(a.target) in state else "" for a in tensors))
        owner = ctx.insert_before(node, str(node.target)) if has_state else None
        guard = ctx.insert_before(node, check_devices, (info, owner, *tensors))
        new = [n for n in (owner, guard) if n is not None]
        for n in new:
            meta = node_meta(n)
            meta.watch(INSTRUMENTATION, observes=node)
            meta.add_probe("device-check")
        return new
