"""``where=``: which nodes a pass touches, by glob over module paths / node names, or a predicate."""

from __future__ import annotations

import fnmatch
from typing import Callable, Sequence, Union

from torch.fx import GraphModule, Node

from fxdebug.graph.meta import KEY, module_path

__all__ = ["Where", "matches"]

Where = Union[None, str, Sequence[str], Callable[[Node], bool]]


def _match_one(pattern: str, node: Node) -> bool:
    path = module_path(node)
    if fnmatch.fnmatchcase(node.name, pattern) or fnmatch.fnmatchcase(path, pattern):
        return True
    # A plain module path selects everything inside that module too: "layer1" ⊇ "layer1.0.conv1".
    if path and path.startswith(pattern + "."):
        return True
    # A part captured per subtree knows its path in the model: "backbone.body.*" selects its nodes too.
    owner = node.graph.owning_module
    record = owner.meta.get(KEY) if isinstance(owner, GraphModule) else None
    root = record.get("root_path") if record is not None and hasattr(record, "get") else None
    if not root:
        return False
    full = f"{root}.{path}" if path else root
    return fnmatch.fnmatchcase(full, pattern) or full.startswith(pattern + ".") or full == pattern


def matches(where: Where, node: Node) -> bool:
    """True if ``node`` is selected by ``where``.

    ``None`` selects everything; a string is a glob matched against the node name and its module
    path (``"layer1.*"``, ``"*conv*"``; a plain path also selects everything under it); a sequence
    of strings selects the union; a callable receives the node and returns a bool.
    """
    if where is None:
        return True
    if callable(where):
        return bool(where(node))
    if isinstance(where, str):
        return _match_one(where, node)
    return any(_match_one(p, node) for p in where)
