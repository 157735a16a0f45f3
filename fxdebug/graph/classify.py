"""Op classification: one question ("is this a ReLU?") answered for every form FX can meet.

A ReLU may reach a graph as a module call (``nn.ReLU``), a torch function (``torch.relu``,
``F.relu``), a tensor method (``x.relu()``, ``x.relu_()``) or, in export graphs, an aten overload
(``aten.relu.default``). Passes ask here instead of spelling out each form. The tables are keyed
by *kind*; a missing kind is a plain ``False``, never a crash.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

__all__ = [
    "OpKind",
    "get_attr",
    "get_module",
    "is_batchnorm",
    "is_conv",
    "is_inplace",
    "is_kind",
    "is_linear",
    "is_relu",
    "is_view",
    "register_kind",
]

OpKind = str

_aten = torch.ops.aten


def _aten_overloads(*names: str) -> set[Any]:
    out: set[Any] = set()
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is None:
            continue
        out.add(packet)
        for overload in packet.overloads():
            out.add(getattr(packet, overload))
    return out


# kind -> (module types, functions, method names)
_KINDS: dict[OpKind, tuple[tuple[type, ...], set[Any], set[str]]] = {
    "relu": (
        (nn.ReLU,),
        {torch.relu, torch.relu_, F.relu, F.relu_} | _aten_overloads("relu", "relu_"),
        {"relu", "relu_"},
    ),
    "conv": (
        (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
        {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
        | _aten_overloads("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
        set(),
    ),
    "linear": ((nn.Linear,), {F.linear} | _aten_overloads("linear", "addmm"), set()),
    "batchnorm": (
        (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
        {F.batch_norm}
        | _aten_overloads(
            "batch_norm",
            "_native_batch_norm_legit_no_training",
            "_native_batch_norm_legit",
            "_native_batch_norm_legit_functional",
            "native_batch_norm",
        ),
        set(),
    ),
    "add": (
        (),
        {operator.add, operator.iadd, torch.add} | _aten_overloads("add", "add_"),
        {"add", "add_"},
    ),
    "cat": ((), {torch.cat, torch.concat} | _aten_overloads("cat"), set()),
    # Ops whose output holds only values already in their input, rearranged or selected: they
    # cannot create NaN/Inf, and their statistics repeat their input's. Observers skip them.
    "view": (
        (nn.Flatten, nn.Unflatten, nn.Identity),
        {torch.flatten, torch.reshape, torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze, torch.t,
         torch.movedim, torch.swapaxes, torch.narrow, torch.select, operator.getitem}
        | _aten_overloads("view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze",
                          "expand", "alias", "slice", "select", "narrow", "unflatten", "flatten", "movedim"),
        {"view", "reshape", "permute", "transpose", "flatten", "unflatten", "unsqueeze", "squeeze", "contiguous",
         "expand", "expand_as", "view_as", "reshape_as", "t", "movedim", "swapaxes", "narrow", "select"},
    ),
}


def register_kind(kind: OpKind, *, modules: tuple[type, ...] = (), functions: Iterable[Any] = frozenset(), methods: Iterable[str] = frozenset()) -> None:
    """Teach the classifier a new kind, or more forms of an existing one (for pass authors)."""
    mods, funcs, meths = _KINDS.get(kind, ((), set(), set()))
    _KINDS[kind] = (tuple(mods) + tuple(modules), set(funcs) | set(functions), set(meths) | set(methods))


def get_module(gm: torch.nn.Module, node: Node) -> nn.Module | None:
    """The module a ``call_module`` node calls, or ``None`` for any other node."""
    if node.op != "call_module":
        return None
    found: Any = gm  # the children's own tables first: get_submodule's getattr per atom goes through an
    for atom in str(node.target).split("."):  # instrumented module's attribute fallbacks (~3 µs a node)
        found = found._modules.get(atom) if isinstance(found, nn.Module) else None
        if found is None:
            break
    if found is not None:
        return found
    try:
        return gm.get_submodule(str(node.target))
    except AttributeError:
        return None


def get_attr(gm: torch.nn.Module, target: str) -> Any:
    """What the dotted path ``target`` of a ``get_attr`` node names on ``gm`` (a parameter, a
    buffer, a constant, a submodule), or ``None`` when nothing is there."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def is_kind(node: Node, kind: OpKind, gm: torch.nn.Module | None = None) -> bool:
    """True if ``node`` computes ``kind`` in any of its forms."""
    if kind not in _KINDS:
        return False
    mods, funcs, meths = _KINDS[kind]
    if node.op == "call_module":
        owner = gm if gm is not None else getattr(node.graph, "owning_module", None)
        mod = get_module(owner, node) if owner is not None else None
        return mod is not None and isinstance(mod, mods)
    if node.op == "call_function":
        try:
            return node.target in funcs
        except TypeError:  # unhashable target
            return False
    if node.op == "call_method":
        return node.target in meths
    return False


def is_relu(node: Node, gm: torch.nn.Module | None = None) -> bool:
    """``nn.ReLU`` (any ``inplace``), ``F.relu``, ``torch.relu(_)``, ``Tensor.relu(_)``, ``aten.relu(_)``."""
    return is_kind(node, "relu", gm)


def is_conv(node: Node, gm: torch.nn.Module | None = None) -> bool:
    return is_kind(node, "conv", gm)


def is_linear(node: Node, gm: torch.nn.Module | None = None) -> bool:
    return is_kind(node, "linear", gm)


def is_batchnorm(node: Node, gm: torch.nn.Module | None = None) -> bool:
    return is_kind(node, "batchnorm", gm)


def is_view(node: Node, gm: torch.nn.Module | None = None) -> bool:
    """Reshapes, permutes, slices and selections: the output holds only input values."""
    return is_kind(node, "view", gm)


_INPLACE_FUNCS: set[Callable[..., Any]] = {
    torch.relu_, F.relu_, operator.iadd, operator.isub, operator.imul, operator.itruediv,
}


def is_inplace(node: Node, gm: torch.nn.Module | None = None) -> bool:
    """True if ``node`` writes into one of its inputs (``relu_``, ``+=``, ``inplace=True``)."""
    if node.op == "call_module":
        owner = gm if gm is not None else getattr(node.graph, "owning_module", None)
        mod = get_module(owner, node) if owner is not None else None
        return bool(getattr(mod, "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).startswith("_")
    if node.op == "call_function":
        if node.kwargs.get("inplace", False):
            return True
        if node.target in _INPLACE_FUNCS:
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False
