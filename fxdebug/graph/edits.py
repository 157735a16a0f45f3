"""Graph edits with provenance: insert before/after a node, replace a node by a module.

Each edit records, under ``node.meta["fxdebug"]``, which pass made the node (``added_by``) or
changed it (``changed_by``), the module path it belongs to, and the user's source frame of the
node it stands beside (fxdebug's ``source`` key: torch's own keys are only read). Modules fxdebug
adds are registered under one root attribute (``NAMESPACE``), never inside the user's model.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.fx import GraphModule, Node

from fxdebug.errors import UsageError
from fxdebug.graph.meta import KEY, module_path, node_meta, op_label

__all__ = ["NAMESPACE", "Target", "add_module", "copy_meta", "follow_observations", "insert_after", "insert_before", "replace",
           "replace_with_module"]

NAMESPACE = "fxdebug"  # root attribute under which fxdebug registers the modules it adds

Target = Callable[..., Any] | nn.Module  # what an inserted node calls


def _owner(node: Node) -> GraphModule:
    gm = node.graph.owning_module
    if not isinstance(gm, GraphModule):
        raise UsageError(f"node '{node.name}' belongs to no GraphModule; edit nodes of the module the pass received.",
                         node=node.name)
    return gm


def add_module(gm: GraphModule, hint: str, module: nn.Module) -> str:
    """Register ``module`` on ``gm`` under ``NAMESPACE``; returns its dotted target, made unique."""
    space = getattr(gm, NAMESPACE, None)
    if space is None:
        space = nn.Module()
        space.training = gm.training
        gm.add_module(NAMESPACE, space)
    base = "".join(c if c.isalnum() or c == "_" else "_" for c in hint) or "m"
    name, i = base, 1
    taken = space.__dict__
    while name in space._modules or name in taken or name in space._parameters or name in space._buffers \
            or hasattr(type(space), name):  # hasattr(space, name) without nn.Module's failing __getattr__
        i += 1
        name = f"{base}_{i}"
    space.add_module(name, module)
    return f"{NAMESPACE}.{name}"


def _mark(new: Node, beside: Node, pass_name: str | None) -> None:
    meta = node_meta(new)
    meta.module = module_path(beside)
    if pass_name:
        meta.added_by = pass_name
    source = node_meta(beside).source or beside.meta.get("stack_trace")
    if source:
        meta.source = source


def _call(gm: GraphModule, node: Node, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
          hint: str | None) -> Node:
    if isinstance(target, nn.Module):
        name = add_module(gm, hint or f"{type(target).__name__.lower()}_{node.name}", target)
        new = node.graph.call_module(name, args, kwargs or {})
        node_meta(new).module_type = type(target).__name__
        return new
    return node.graph.call_function(target, args, kwargs or {})


def insert_after(node: Node, target: Target, args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None,
                 *, rewire: bool = False, hint: str | None = None, after: Node | None = None,
                 pass_name: str | None = None) -> Node:
    """Insert ``target(node, *...)`` (``args`` default ``(node,)``) right after ``node`` (or ``after``).

    With ``rewire=True`` every user of ``node`` reads the new node instead, so the call can
    replace the value it sees.
    """
    gm = _owner(node)
    args = (node,) if args is None else args
    new = _call(gm, node, target, args, kwargs, hint)
    (after if after is not None else node).append(new)  # moved in place: no insert-point context per node
    _mark(new, node, pass_name)
    if rewire:
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    return new


def insert_before(node: Node, target: Target | str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                  *, hint: str | None = None, pass_name: str | None = None) -> Node:
    """Insert ``target(*args)`` right before ``node``: a check on its inputs, or the value it reads.

    ``target`` is a function, a module, or a string naming an attribute of the graph module
    (``get_attr``, e.g. the parameters of the module ``node`` calls).
    """
    gm = _owner(node)
    with node.graph.inserting_before(node):
        if isinstance(target, str):
            new = node.graph.get_attr(target)
        else:
            new = _call(gm, node, target, args, kwargs, hint)
    _mark(new, node, pass_name)
    return new


def copy_meta(old: Node, new: Node, pass_name: str | None = None) -> None:
    """Carry fxdebug's metadata (and where ``old`` came from) to ``new``, marking the change."""
    meta = node_meta(new)
    for key, value in old.meta.get(KEY, {}).items():
        meta.raw.setdefault(key, value)
    if meta.module is None:
        meta.module = module_path(old)
    source = node_meta(old).source or old.meta.get("stack_trace")
    if source and meta.source is None:
        meta.source = source
    if pass_name:
        meta.add_changed_by(pass_name)


def follow_observations(old: str, new: Node) -> None:
    """The observations of the replaced node ``old`` now watch ``new`` (they read it since its users
    were rewired): their ``observes`` name follows, so the report keeps their row, under ``new``."""
    for user in new.users:
        meta = user.meta.get(KEY)
        if not meta or meta.get("role") != "instrumentation":
            continue
        if meta.get("observes") == old:
            meta["observes"] = new.name
        if "batch" in meta:  # a batched call: (observed name, observer) per member
            meta["batch"] = [(new.name if o == old else o, t) for o, t in meta["batch"]]


def replace(node: Node, new: Node, *, pass_name: str | None = None) -> Node:
    """``new`` takes ``node``'s place: users rewired (``new`` itself may read ``node``), metadata
    carried over with ``replaced`` set, ``node`` erased."""
    copy_meta(node, new, pass_name)
    node_meta(new).replaced = f"{op_label(node)} ({node.name})"
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    follow_observations(node.name, new)
    if not node.users:
        node.graph.erase_node(node)
    return new


def replace_with_module(node: Node, module: nn.Module, args: tuple[Any, ...] | None = None, *,
                        pass_name: str | None = None) -> Node:
    """Replace ``node`` by a call of ``module`` on ``args`` (default: the node's first input).

    Users are rewired, metadata (module path, source line) carried over, the node erased.
    """
    graph = node.graph
    gm = _owner(node)
    if args is None:
        args = (node.args[0],) if node.args else (next(iter(node.kwargs.values())),)
    name = add_module(gm, f"{node.name}", module)
    with graph.inserting_after(node):
        new = graph.call_module(name, args, {})
    copy_meta(node, new, pass_name)
    meta = node_meta(new)
    meta.module_type = type(module).__name__
    meta.replaced = f"{op_label(node)} ({node.name})"
    if not node.users:  # the model computed a value nobody reads; its replacement keeps that shape
        meta.keep_unused = True
    node.replace_all_uses_with(new)
    follow_observations(node.name, new)
    graph.erase_node(node)
    return new
