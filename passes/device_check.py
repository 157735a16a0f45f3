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

import fxdebug
from fxdebug import DeviceMismatchError, PassContext, PassResult

__all__ = ["DeviceCheck", "check_devices"]


def _counts(t: Tensor) -> bool:
    return not (t.dim() == 0 and t.device.type == "cpu")


def check_devices(info: tuple[str, str, str, str, str, tuple[str, ...]], module: nn.Module | None, *inputs: Any) -> None:
    """Raise ``DeviceMismatchError`` if ``inputs`` and ``module``'s tensors span several devices.

    ``info`` is ``(description, node, module path, op, source line, input names)``, fixed at
    instrumentation time so the success path only reads devices.
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


def _error(info: tuple[str, str, str, str, str, tuple[str, ...]], module: nn.Module | None, inputs: tuple[Any, ...]) -> DeviceMismatchError:
    describe, node, path, op, where, names = info
    parts = []
    for name, t in zip(names, inputs):
        if isinstance(t, Tensor):
            parts.append(f"input '{name}' {tuple(t.shape)} on {t.device}")
    module_devices: dict[str, list[str]] = {}
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
    return DeviceMismatchError(f"DeviceCheck: {describe} would mix devices: {'; '.join(parts)}. {fix}{at}",
                               node=node, module=path, op=op)


class DeviceCheck(fxdebug.Pass):
    """Guard every op that could mix devices; see the module docstring.

    Args:
        where: limit the guarded nodes (globs over module paths / node names, or a predicate).
    """

    name = "device-check"
    observe_only = True

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        added = []
        for node in ctx.nodes(gm, self.where):
            module = fxdebug.get_module(gm, node)
            has_state = module is not None and any(True for _ in _module_tensors(module))
            tensors = [a for a in node.all_input_nodes if not fxdebug.is_instrumentation(a)
                       and ctx.tensor_spec(a) is not None]
            if len(tensors) + (1 if has_state else 0) < 2:
                continue
            added.extend(self._guard(gm, node, tensors, has_state))
        return PassResult(gm, added=added)

    @staticmethod
    def _guard(gm: GraphModule, node: Node, tensors: list[Node], has_state: bool) -> list[Node]:
        info = (fxdebug.describe(node), node.name, fxdebug.module_path(node), fxdebug.op_label(node),
                fxdebug.source_line(node) or "", tuple(a.name for a in tensors))
        new: list[Node] = []
        with gm.graph.inserting_before(node):
            owner = gm.graph.get_attr(str(node.target)) if has_state else None
            guard = gm.graph.call_function(check_devices, (info, owner, *tensors))
        for n in (owner, guard):
            if n is None:
                continue
            meta = fxdebug.fx_meta(n)
            meta["role"], meta["observes"], meta["module"] = "instrumentation", node.name, fxdebug.module_path(node)
            meta["probes"] = ["device-check"]
            if "stack_trace" in node.meta:
                n.meta["stack_trace"] = node.meta["stack_trace"]
            new.append(n)
        return new
