"""``GradientCentralize``: subtract the mean of each weight gradient, at the node.

Gradient centralisation (Yong et al., 2020) replaces the gradient ``g`` of a conv or linear weight
with ``g - g.mean(dims other than the output channel)``. The guides teach it as a hook on each
weight (``w.register_hook(...)``), which lives on the model until someone removes it. Here the
weight reaching each selected conv/linear passes through an identity whose backward centralises
the gradient: a ``Conv*d``/``Linear`` module call is replaced by a call of the same module with the
wrapped weight, and a functional or aten call (``F.linear``, ``aten.convolution`` in export graphs)
gets the wrapper between its weight's ``get_attr`` and itself. The forward is unchanged (bitwise
the same output), the weight gradient equals what the hand-written hook gives, and dropping the
instrumented module leaves nothing behind on the model.

One-dimensional weights (and biases) are left alone, as in the paper. A module called at several
nodes is centralised at each call; the gradient contributions are centralised before they sum,
which is the same as centralising the sum, since centralisation is linear.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxdebug import UsageError
from fxdebug.authoring import (
    Pass, PassContext, PassResult, Where, describe, fx_meta, get_module, is_conv, is_linear, module_path,
)

__all__ = ["GradientCentralize", "centralize", "centralized_weight"]


def centralize(g: Tensor) -> Tensor:
    """``g`` minus its mean over every dim but the first (the output channel)."""
    if g.dim() < 2:
        return g
    return g - g.mean(dim=tuple(range(1, g.dim())), keepdim=True)


class _Centralized(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: Tensor) -> Tensor:
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return centralize(g)


def centralized_weight(w: Tensor) -> Tensor:
    """``w`` itself in the forward; its gradient centralised in the backward (graph-level form)."""
    if torch.is_grad_enabled() and w.requires_grad and w.dim() > 1:
        return _Centralized.apply(w)
    return w


class _CentralizedCall(nn.Module):
    """Calls the original conv/linear with its weight passed through ``_Centralized``.

    The module is referenced, not registered: its parameters stay where the model has them, so
    ``state_dict()`` keys are unchanged and training this trains the model.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_target", module)

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        m = self._target
        w = _Centralized.apply(m.weight) if torch.is_grad_enabled() and m.weight.requires_grad else m.weight
        if isinstance(m, nn.Linear):
            return F.linear(x, w, m.bias)
        return m._conv_forward(x, w, m.bias)  # type: ignore[union-attr]

    def extra_repr(self) -> str:
        return f"centralizes {type(self._target).__name__}.weight"


_SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class GradientCentralize(Pass):
    """Centralise the weight gradients of the selected conv/linear modules.

    Args:
        where: the modules' nodes (globs / predicate); default every Conv1d/2d/3d and Linear.
    """

    name = "gradient-centralize"

    def __init__(self, *, where: Where = None) -> None:
        super().__init__(where=where)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        replaced: dict[str, str] = {}
        added = []
        for node in ctx.nodes(gm, ops=("call_function",)):  # functional / aten convs and linears (export graphs)
            if not (is_conv(node, gm) or is_linear(node, gm)) or len(node.args) < 2:
                continue
            if getattr(node.target, "__name__", "").startswith("addmm"):  # addmm(bias, x, w.t()): no weight slot
                continue
            w = node.args[1]
            if not isinstance(w, Node) or w.op != "get_attr":
                continue
            with gm.graph.inserting_before(node):
                wrapped = gm.graph.call_function(centralized_weight, (w,))
            fx_meta(wrapped).update(module=module_path(node), added_by=self.name)
            node.args = (node.args[0], wrapped, *node.args[2:])
            added.append(wrapped)
        for node in ctx.nodes(gm, ops=("call_module",)):
            module = get_module(gm, node)
            if type(module) not in _SUPPORTED or module.weight.dim() < 2:
                continue
            if node.kwargs or len(node.args) != 1:
                raise UsageError(f"GradientCentralize: {describe(node)} is called with extra arguments; "
                                 "exclude it with where=.")
            new = ctx.replace_with_module(node, _CentralizedCall(module), args=node.args)
            fx_meta(new)["module_type"] = type(module).__name__
            fx_meta(new)["module"] = str(node.target)
            replaced[node.name] = new.name
        if not replaced and not added:
            raise UsageError(f"GradientCentralize: where={self.where!r} selects no Conv or Linear module.")
        return PassResult(gm, added=added, replaced=replaced)
