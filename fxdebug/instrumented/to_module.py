"""``dbg.to_module()``: the instrumented model as a plain module you can ship.

Debugging ends in a model to deploy: batch-norm folded, activations swapped, masks applied. The
instrumented module carries fxdebug's observers, clock and input guards, masks applied on every
call through ``Masked`` wrappers, derived layers hidden from ``state_dict``, and the whole of the
model's hierarchy (unused batch-norms included). ``to_module`` returns a plain
``torch.fx.GraphModule`` holding only what its graph computes with:

* every node fxdebug added only to watch (observers, clock, guards, shadows) is removed, its
  users rewired to the value it watched;
* every transform is kept: fused and swapped layers as ordinary modules, graph masks baked into
  plain copies of the layers (``weight * mask``), baked layers without their gradient hooks;
* modules fxdebug added take the model's own module paths where free (``layer1.0.conv1``),
  so ``state_dict()`` reads like the model's and holds only the parameters the graph uses.

The result is a deep copy: it shares nothing with the model or the instrumented module, pickles
with ``torch.save``, and can be given to ``torch.export.export`` and ``torch.jit.trace``. With
the subtrees frontend the eager root stays an ``nn.Module`` (a copy of the model's) whose
captured parts are such plain graph modules. ``shrink=True`` then removes pruned channels
physically (``fxdebug.instrumented.shrink``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from fxdebug.capture.inplace_proxy import writes_in_place
from fxdebug.graph.edits import NAMESPACE
from fxdebug.graph.meta import is_instrumentation, node_meta

__all__ = ["to_module"]


class _Parted(Protocol):
    """An ``Instrumented`` module (``fxdebug.instrumented.module`` imports this module, so it is named by shape)."""

    def parts(self) -> dict[str, Any]: ...


def to_module(dbg: _Parted, shrink: bool = False) -> nn.Module:
    """A plain, shippable module computing what ``dbg``'s transforms compute (see the module doc)."""
    parts = dbg.parts()  # {"": dbg} for one graph; the captured submodules for the subtrees frontend
    if list(parts) == [""]:
        plain = _plain(parts[""])
        return _shrunk(plain) if shrink else plain
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        copied = copy.deepcopy(dbg)
    shell = copied.__dict__["_shell"]
    for path, part in copied.parts().items():
        plain = _plain(part)
        plain = _shrunk(plain) if shrink else plain
        owner, _, name = path.rpartition(".")
        shell.get_submodule(owner)._modules[name] = plain
    for m in shell.modules():  # fxdebug's bookkeeping on the eager copies is not the model's
        m.__dict__.pop("_fxdebug_original", None)
    return cast(nn.Module, shell)


def _shrunk(gm: GraphModule) -> GraphModule:
    from fxdebug.instrumented.shrink import shrink

    return shrink(gm)


def _plain(gm: GraphModule) -> GraphModule:
    with warnings.catch_warnings():  # an export graph's TreeSpecs trip torch's LeafSpec deprecation on copy
        warnings.simplefilter("ignore", FutureWarning)
        src = copy.deepcopy(gm)
    graph = src.graph
    _drop_instrumentation(graph)
    modules = dict(src.named_modules())
    taken = {str(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")
             and not str(n.target).startswith(f"{NAMESPACE}.")}
    root = nn.Module()
    for node in graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        target = str(node.target)
        value = modules.get(target) if node.op == "call_module" else _attr(src, target)
        if node.op == "call_module":
            assert value is not None, f"call_module target {target} is not a submodule"
            value = _shippable(value)
        new = target
        if target.startswith(f"{NAMESPACE}."):
            new = _free_name(_preferred(node, target), taken)
            taken.add(new)
        _put(root, new, value)
        node.target = new
    for node in graph.nodes:  # string annotations (``from __future__ import annotations``) do not pickle
        if isinstance(node.type, str):
            node.type = None
    graph._tracer_cls = None  # GraphModule pickles by code; fxdebug's tracer is not needed to load it
    graph._tracer_extras = None
    out = GraphModule(root, graph, class_name=_class_name(src))
    if not _has_side_effects(out.graph):
        out.graph.eliminate_dead_code()
    out.graph.lint()
    out.recompile()
    out.train(src.training)
    return out


def _class_name(gm: GraphModule) -> str:
    record = gm.meta.get("fxdebug")
    name = record.get("model_type") if isinstance(record, dict) else getattr(record, "model_type", None)
    return name or type(gm).__name__


def _has_side_effects(graph: Graph) -> bool:
    """In-place ops and calls fxdebug cannot judge keep dead-code elimination away."""
    for n in graph.nodes:
        if n.op == "call_method" and str(n.target).endswith("_"):
            return True
        if writes_in_place(n):  # ``y += 1`` recorded as operator.iadd
            return True
        if n.op == "call_function" and getattr(n.target, "__name__", "").endswith("_"):
            return True
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            return True
    return False


def _drop_instrumentation(graph: Graph) -> None:
    for node in reversed(list(graph.nodes)):
        if not is_instrumentation(node):
            continue
        watched = node.args[0] if node.args and isinstance(node.args[0], Node) else None
        if node.users:
            node.replace_all_uses_with(watched)
        graph.erase_node(node)


def _attr(root: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    mod = root.get_submodule(owner) if owner else root
    return getattr(mod, name)


def _preferred(node: Node, target: str) -> str:
    """The model's own path for a module fxdebug made (a fused conv at ``layer1.0.conv1``)."""
    meta = node_meta(node)
    candidates = [meta.stands_for or "", meta.module or ""]
    for name in candidates:
        if name and not name.startswith(f"{NAMESPACE}."):
            return name
    return target[len(NAMESPACE) + 1:].replace(".", "_")


def _free_name(want: str, taken: set[str]) -> str:
    """``want`` unless it, a module above it or one below it is already a target."""
    def clash(name: str) -> bool:
        return any(t == name or t.startswith(f"{name}.") or name.startswith(f"{t}.") for t in taken)

    if want and not clash(want):
        return want
    base = (want or "module").replace(".", "_")
    name, i = base, 1
    while clash(name):
        i += 1
        name = f"{base}_{i}"
    return name


def _put(root: nn.Module, target: str, value: Any) -> None:
    *path, name = target.split(".")
    mod = root
    for part in path:
        nxt = mod._modules.get(part)
        if nxt is None:
            nxt = nn.Module()
            mod.add_module(part, nxt)
        mod = nxt
    if isinstance(value, nn.Module):
        mod.add_module(name, value)
    elif isinstance(value, nn.Parameter):
        mod.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(name, value)
    else:
        setattr(mod, name, value)


def _shippable(module: nn.Module) -> nn.Module:
    """A graph mask baked into a plain copy of its layer; derived copies without fxdebug's hooks."""
    masks = getattr(module, "names", None) if type(module).__name__ == "Masked" else None
    if masks is not None:
        layer: nn.Module = copy.deepcopy(getattr(module, "layer"))
        mask = getattr(module, "mask")
        for name in masks:
            old = getattr(layer, name)
            setattr(layer, name, nn.Parameter((old * mask(name)).detach(), requires_grad=old.requires_grad))
        module = layer
    for m in module.modules():
        m._state_dict_hooks.clear()
        m._load_state_dict_post_hooks.clear()
        m.__dict__.pop("_fxdebug_masks", None)
        for name, p in list(m._parameters.items()):
            if p is not None:  # fresh Parameters: no gradient hooks from PruneMasks(bake=True)
                m._parameters[name] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
    return module
