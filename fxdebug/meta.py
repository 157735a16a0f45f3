"""The one door to fxdebug's node metadata, ``node.meta["fxdebug"]``.

fxdebug writes only under that key; torch's own keys (``tensor_meta``, ``val``,
``nn_module_stack``, ``stack_trace``) are read, never written. Keys in use:

=================  ==========================================================================
``module``         dotted path of the module that owns the node (``""`` for the root)
``module_type``    class name of that module (``"Conv2d"``), where known
``added_by``       name of the pass that inserted the node
``changed_by``     list of passes that rewrote the node
``observes``       for an instrumentation node: name of the node it watches
``role``           ``"instrumentation"`` for nodes that only watch
``auto_leaf``      why the module became a leaf during tracing
``notes``          free-form sentences passes attach for the report and the picture
=================  ==========================================================================
"""

from __future__ import annotations

import re
from typing import Any

from torch.fx import Node

__all__ = ["describe", "fx_meta", "is_instrumentation", "module_path", "module_type", "op_label", "source_line"]

KEY = "fxdebug"


def fx_meta(node: Node) -> dict[str, Any]:
    """Return (creating if needed) the fxdebug metadata dict of ``node``."""
    return node.meta.setdefault(KEY, {})


def module_path(node: Node) -> str:
    """Dotted path of the module that owns ``node``; ``""`` for the root module."""
    meta = node.meta.get(KEY, {})
    if "module" in meta:
        return meta["module"]
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return _clean_export_path(path)
    return ""


def module_type(node: Node) -> str | None:
    """Class name of the module that owns ``node`` (``"Conv2d"``), when known."""
    meta = node.meta.get(KEY, {})
    if "module_type" in meta:
        return meta["module_type"]
    stack = node.meta.get("nn_module_stack")
    if stack:
        typ = list(stack.values())[-1][1]
        return typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1].rstrip("'>")
    return None


def is_instrumentation(node: Node) -> bool:
    """True for nodes that fxdebug inserted only to watch another node."""
    return node.meta.get(KEY, {}).get("role") in ("instrumentation", "clock", "guard", "shadow")


_EXPORT_PATH = re.compile(r"L\['self'\]\.?|L__self__\.?|\._modules\['([^']+)'\]|\[(\d+)\]")


def _clean_export_path(path: str) -> str:
    """``L['self'].layer1[0].conv1`` / ``L__self___layer1`` → ``layer1.0.conv1``."""
    if "L[" not in path and "L__self__" not in path and "[" not in path:
        return path

    def repl(m: re.Match[str]) -> str:
        group = m.group(1) or m.group(2)
        return f".{group}" if group else ""

    return _EXPORT_PATH.sub(repl, path).strip(".")


_INTERNAL = re.compile(r"[/\\\\](torch|fxdebug|transformers[/\\\\]utils)[/\\\\]|^<")


def source_line(node: Node) -> str | None:
    """``file.py:41 `out = self.conv1(x)``` for the user's line that created ``node``, if FX kept it."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    # The innermost user frame is the last 'File "...", line N' entry, followed by its code line.
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r'File "([^"]+)", line (\d+)', lines[i])
        if m and not _INTERNAL.search(m.group(1)):
            filename = m.group(1).rsplit("/", 1)[-1]
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"{filename}:{m.group(2)} `{code}`" if code else f"{filename}:{m.group(2)}"
    return None


def describe(node: Node) -> str:
    """``node 'conv1' (module layer1.0.conv1, Conv2d)``: how every message names a node."""
    path = module_path(node)
    typ = module_type(node)
    op = op_label(node)
    where = path or "<root>"
    what = typ if node.op == "call_module" and typ else op
    return f"node '{node.name}' (module {where}, {what})"


def op_label(node: Node) -> str:
    """A short, human name for what the node computes: ``Conv2d``, ``torch.relu``, ``.view``."""
    if node.op == "call_module":
        typ = node.meta.get(KEY, {}).get("module_type")
        return typ or str(node.target)
    if node.op == "call_function":
        target = node.target
        name = getattr(target, "__name__", None) or str(target)
        mod = getattr(target, "__module__", None) or ""
        if "_ops" in type(target).__module__ or mod.startswith("torch._ops"):
            return str(target)  # aten.relu.default
        if mod in ("_operator", "operator"):
            return f"operator.{name}"
        if mod.startswith("torch.nn.functional"):
            return f"F.{name}"
        if mod.startswith("torch"):
            return f"torch.{name}"
        return name
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "get_attr":
        return f"get_attr {node.target}"
    return node.op
