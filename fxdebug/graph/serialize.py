"""Pickling a graph node by node, so fxdebug's metadata survives ``torch.save``.

``GraphModule`` pickles its generated code and re-traces it on load, which loses every node's
``meta`` (module paths, provenance, what an observer watches). Here the graph itself is written
as rows — name, op, target, args with node references, kept metadata — and rebuilt exactly.
Targets that do not pickle (aten overloads, higher-order ops) travel by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.fx.node import map_aggregate, map_arg
from torch.utils import _pytree as pytree

__all__ = ["deserialize_graph", "encode_pytree_info", "picklable_target", "resolved_target", "serialize_graph"]

class _Ref:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> Any:
        return (_Ref, (self.name,))


class _OpRef:
    """A picklable stand-in for an aten ``OpOverload`` / higher-order op target (those do not pickle)."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (_OpRef, (self.path,))

    def resolve(self) -> Any:
        obj: Any = torch.ops
        for part in self.path.split("."):
            obj = getattr(obj, part)
        return obj


class _FuncRef:
    """A function pickle cannot name (``F.max_pool2d`` is ``boolean_dispatch.<locals>.fn``), by module attribute."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __reduce__(self) -> Any:
        return (_FuncRef, (self.module, self.name))

    def resolve(self) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)


def _func_ref(target: Any) -> Any:
    """``target`` itself if pickle finds it by qualified name; else a ``_FuncRef`` if its module holds it."""
    qualname = getattr(target, "__qualname__", "")
    module, name = getattr(target, "__module__", None), getattr(target, "__name__", None)
    if "<locals>" not in qualname or not module or not name:
        return target
    import sys

    return _FuncRef(module, name) if getattr(sys.modules.get(module), name, None) is target else target


def picklable_target(target: Any) -> Any:
    """``target`` (a node's function or op, held by a module) in a form pickle can write: ``F.max_pool2d``
    (``boolean_dispatch.<locals>.fn``) by module attribute; ``resolved_target`` turns it back."""
    return _op_ref(target)


def resolved_target(target: Any) -> Any:
    """The function or op ``picklable_target`` wrote (anything else as it is)."""
    return target.resolve() if isinstance(target, (_OpRef, _FuncRef)) else target


def _op_ref(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        return _OpRef(f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _OpRef(target._qualified_op_name.replace("::", "."))
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _OpRef(f"higher_order.{getattr(target, 'name')()}")
    if callable(target) and not isinstance(target, type):
        return _func_ref(target)
    return target


_KEEP_META = ("fxdebug", "stack_trace", "nn_module_stack")


def serialize_graph(graph: Graph) -> list[tuple[Any, ...]]:
    rows = []
    for n in graph.nodes:
        args = map_arg(n.args, lambda a: _Ref(a.name))  # type: ignore[arg-type, return-value]
        kwargs = map_arg(n.kwargs, lambda a: _Ref(a.name))  # type: ignore[arg-type, return-value]
        meta = {k: n.meta[k] for k in _KEEP_META if k in n.meta}
        rows.append((n.name, n.op, _op_ref(n.target), map_aggregate(args, _op_ref), map_aggregate(kwargs, _op_ref), meta))
    return rows


def deserialize_graph(rows: list[tuple[Any, ...]], pytree_info: Any = None) -> Graph:
    """Rebuild a graph from ``serialize_graph`` rows (and ``encode_pytree_info`` for export graphs)."""
    graph = Graph()
    if pytree_info is not None:  # export graphs flatten (args, kwargs) and rebuild the output structure
        orig_args, in_spec, out_spec = pytree_info
        graph._codegen = _PyTreeCodeGen(_PyTreeInfo(orig_args, _decode_spec(in_spec), _decode_spec(out_spec)))
    env: dict[str, Node] = {}

    def resolve(x: Any) -> Any:
        if isinstance(x, _Ref):
            return env[x.name]
        if isinstance(x, (_OpRef, _FuncRef)):
            return x.resolve()
        if isinstance(x, tuple):
            return tuple(resolve(v) for v in x)
        if isinstance(x, list):
            return [resolve(v) for v in x]
        if isinstance(x, dict):
            return {k: resolve(v) for k, v in x.items()}
        if isinstance(x, slice):
            return slice(resolve(x.start), resolve(x.stop), resolve(x.step))
        return x

    for name, op, target, args, kwargs, meta in rows:
        node = graph.create_node(op, resolve(target), resolve(args), resolve(kwargs), name=name)
        node.meta.update(meta)
        env[name] = node
    return graph


def _encode_spec(spec: Any) -> Any:
    """A TreeSpec as nested tuples: pickling TreeSpecs directly trips a torch deprecation warning."""
    if spec is None:
        return None
    if spec.is_leaf():
        return "*"
    return (spec.type, spec.context, [_encode_spec(c) for c in spec.children()])


def _decode_spec(x: Any) -> Any:
    if x is None:
        return None
    if x == "*":
        return pytree.treespec_leaf()
    return pytree.TreeSpec(x[0], x[1], [_decode_spec(c) for c in x[2]])


def encode_pytree_info(graph: Graph) -> Any:
    info = getattr(graph._codegen, "pytree_info", None)
    if info is None:
        return None
    return (list(info.orig_args), _encode_spec(info.in_spec), _encode_spec(info.out_spec))


