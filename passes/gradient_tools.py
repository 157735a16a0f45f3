"""Gradient tools as graph edits: ``GradientScale`` (scale, reverse or stop a gradient) and
``Freeze`` (parameters of some modules get no gradient).

Debugging guides do both with hand-written hooks: a backward hook multiplying the gradient
(domain-adversarial training's gradient reversal layer), or toggling ``requires_grad`` and
rebuilding the optimizer to freeze a backbone. Here they are passes over the graph, switchable
at run time, that never touch the model's parameters, their ``requires_grad`` flags or the
optimizer.

``GradientScale`` leaves the forward alone: the inserted node only registers a gradient hook on
the selected value and returns nothing, so outputs stay bitwise equal. ``Freeze`` runs each
frozen module with its parameters detached (``torch.func.functional_call``): the same values, so
the same outputs, but autograd never reaches those parameters and their ``.grad`` stays ``None``;
gradients still flow through the module to the layers before it.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxdebug import UsageError
from fxdebug.authoring import (
    GUARD, Options, Pass, PassContext, PassResult, Where, get_attr, is_instrumentation, node_meta,
)

__all__ = ["Freeze", "GradientScale"]


class _ScaleHook(nn.Module):
    """Registers ``grad * factor`` as the gradient of the watched value; returns nothing."""

    def __init__(self, control: "GradientScale") -> None:
        super().__init__()
        object.__setattr__(self, "_control", control)  # shared switch, not a child module

    def forward(self, x: Any) -> None:
        control = self._control
        if isinstance(x, Tensor) and x.requires_grad and torch.is_grad_enabled() and control.enabled \
                and control.factor != 1:
            factor = control.factor
            x.register_hook(lambda g: g * factor)
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> "_ScaleHook":
        new = _ScaleHook(self._control)
        memo[id(self)] = new
        return new


def _exits(nodes: list[Node]) -> list[Node]:
    """The selected nodes whose value is used outside the selection (or is the graph's output)."""
    chosen = set(nodes)
    out = []
    for n in nodes:
        users = [u for u in n.users if not is_instrumentation(u)]
        if any(u.op == "output" or u not in chosen for u in users):
            out.append(n)
    return out


class GradientScale(Pass):
    """Multiply the gradient flowing back through the selected values by ``factor``.

    ``factor=-1`` is a gradient reversal layer, ``0`` stops the gradient, ``0.1`` damps it. The
    forward is untouched (bitwise equal outputs). The gradient is scaled where the selection's
    values leave it: ``where=fxdebug.outputs_of("layer2")`` is the module's output, and a plain
    ``where="layer2"`` (every op inside) is scaled once at the block's exit(s), not once per op.

    Gradient statistics of the selected node itself (``StatCollector(grads=True)``) may show the
    gradient before or after scaling, depending on which pass inserted its node first; the nodes
    before it always see the scaled gradient.

    ``factor`` and ``enabled`` can be changed after instrumenting (the pass object is the switch)::

        rev = GradientScale(fxdebug.outputs_of("features"), -1.0)
        dbg = fxdebug.instrument(model, [rev], example_inputs=(x,))
        rev.factor = -0.5          # anneal the reversal
        rev.enabled = False        # plain gradients again
    """

    name = "gradient-scale"

    def __init__(self, where: Where, factor: float) -> None:
        if where is None:
            raise UsageError("GradientScale needs where=: the values whose gradient to scale, e.g. "
                             "fxdebug.outputs_of('layer2').")
        self.factor = Options(self).number("factor", factor, doc="a number (-1 reverses, 0 stops the gradient)")
        super().__init__(where=where)
        self.enabled = True

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        picked = ctx.nodes(gm, self.where, float_outputs=ctx.inputs is not None)
        targets = _exits(picked)
        if not targets:
            raise UsageError(f"GradientScale(where={self.where!r}) selects no node of {type(gm).__name__}; "
                             "check the module path (e.g. fxdebug.outputs_of('layer2')).")
        for node in targets:
            hook = ctx.insert_after(node, _ScaleHook(self), (node,), hint=f"grad_scale_{node.name}")
            meta = node_meta(hook)
            meta.keep_unused = True
            meta.watch(GUARD)  # watches a value, computes none: not a node of the model
            ctx.record(hook, {"scales": node.name})
            node_meta(node).notes = [*node_meta(node).notes, f"gradient scaled by {self.factor:g}"]
        return PassResult(gm, replaced={n.name: n.name for n in targets})


class _FrozenCall(nn.Module):
    """Calls a module with (some of) its parameters detached while the switch is on."""

    def __init__(self, control: "Freeze", names: tuple[str, ...]) -> None:
        super().__init__()
        object.__setattr__(self, "_control", control)
        self.names = names  # parameter names (relative to the module) that are frozen

    def forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not self._control.enabled:
            return module(*args, **kwargs)
        own = dict(module.named_parameters())
        detached = {k: own[k].detach() for k in self.names if k in own}
        return torch.func.functional_call(module, detached, args, kwargs, strict=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_FrozenCall":
        new = _FrozenCall(self._control, self.names)
        memo[id(self)] = new
        return new


class _FrozenValue(nn.Module):
    """A parameter read directly (``get_attr``), detached while the switch is on."""

    def __init__(self, control: "Freeze") -> None:
        super().__init__()
        object.__setattr__(self, "_control", control)

    def forward(self, p: Tensor) -> Tensor:
        return p.detach() if self._control.enabled else p

    def __deepcopy__(self, memo: dict[int, Any]) -> "_FrozenValue":
        new = _FrozenValue(self._control)
        memo[id(self)] = new
        return new


def _module_selected(where: Where, path: str) -> bool:
    """Whether module ``path`` is selected: globs (a path also selects what is under it) or ``outputs_of``."""
    covers = getattr(where, "covers", None)
    if covers is not None:  # outputs_of(...): freezing means the modules themselves
        return bool(covers(path))
    if isinstance(where, str):
        where = [where]
    if isinstance(where, (list, tuple)):
        return any(fnmatch.fnmatchcase(path, p) or path.startswith(p + ".") for p in where)
    return False


class Freeze(Pass):
    """Parameters of the selected modules receive no gradient (``.grad`` stays ``None``).

    ``requires_grad`` and the optimizer are left alone; gradients still flow *through* the frozen
    modules to the layers before them, and the forward computes exactly what it computed before.
    ``where`` names modules (``"backbone"``, ``"layer1.*"``, ``fxdebug.outputs_of("stem")``) or is a
    predicate over nodes. Switch it off and on again at run time with ``freeze.enabled``.
    """

    name = "freeze"

    def __init__(self, where: Where) -> None:
        if where is None:
            raise UsageError("Freeze needs where=: the modules whose parameters to freeze, e.g. 'backbone'.")
        super().__init__(where=where)
        self.enabled = True

    def _selects(self, node: Node, path: str) -> bool:
        if callable(self.where) and getattr(self.where, "covers", None) is None:
            return bool(self.where(node))
        return _module_selected(self.where, path)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        changed: list[str] = []
        frozen: set[str] = set()
        for node in list(gm.graph.nodes):
            if is_instrumentation(node):
                continue
            if node.op == "call_module":
                target = str(node.target)
                mod = gm.get_submodule(target)
                names = tuple(k for k, _ in mod.named_parameters()
                              if self._selects(node, f"{target}.{k}".rsplit(".", 1)[0]))
                if not names:
                    continue
                self._wrap_call(gm, ctx, node, target, mod, names)
                frozen.update(f"{target}.{k}" for k in names)
                changed.append(node.name)
            elif node.op == "get_attr" and isinstance(get_attr(gm, str(node.target)), nn.Parameter):
                path = str(node.target).rsplit(".", 1)[0] if "." in str(node.target) else ""
                if not self._selects(node, path or str(node.target)):
                    continue
                new = ctx.insert_after(node, _FrozenValue(self), (node,), rewire=True, hint=f"frozen_{node.name}")
                node_meta(new).module = path
                frozen.add(str(node.target))
                changed.append(new.name)
        if not frozen:
            raise UsageError(f"Freeze(where={self.where!r}) matches no parameter of {type(gm).__name__}; "
                             "name a module that owns parameters (e.g. 'layer1' or 'fc').")
        return PassResult(gm, replaced={n: n for n in changed},
                          notes=[f"frozen: {len(frozen)} parameter tensor(s) ({', '.join(sorted(frozen)[:6])}"
                                 f"{', ...' if len(frozen) > 6 else ''})"])

    def _wrap_call(self, gm: GraphModule, ctx: PassContext, node: Node, target: str, mod: nn.Module,
                   names: tuple[str, ...]) -> None:
        """Turn ``call_module(target, args)`` into ``call_module(frozen, (get_attr target, *args))``, same node."""
        wrapper = ctx.add_module(gm, f"frozen_{node.name}", _FrozenCall(self, names))
        with gm.graph.inserting_before(node):
            ref = gm.graph.get_attr(target)
        node_meta(ref).module = target  # the module object itself, handed to the wrapper
        meta = node_meta(node)
        meta.module = meta.module or target
        meta.module_type = meta.module_type or type(mod).__name__
        ctx.record(node, {"params": list(names)}, stands_for=target)
        node.target = wrapper
        node.args = (ref, *node.args)

