"""The one door to fxdebug's metadata: ``node.meta["fxdebug"]`` and ``gm.meta["fxdebug"]``.

fxdebug writes only under that key; torch's own keys (``tensor_meta``, ``val``,
``nn_module_stack``, ``stack_trace``) are read, never written. ``node_meta(node)`` is the typed
view passes and the core use (``node_meta(n).role = INSTRUMENTATION``); ``fx_meta(node)`` is the
raw dict underneath, for keys a pass of one's own adds. Keys fxdebug itself uses:

=================  ==========================================================================
``module``         dotted path of the module that owns the node (``""`` for the root)
``module_type``    class name of that module (``"Conv2d"``), where known
``added_by``       name of the pass that inserted the node
``changed_by``     list of passes that rewrote the node
``replaced``       ``"op (old node)"`` the node stands in for (``replace_with_module``)
``rewritten_from`` names of the nodes a pattern rewrite replaced (``replace_pattern``)
``observes``       for an instrumentation node: name of the node it watches
``role``           ``INSTRUMENTATION`` (watches), ``CLOCK`` (counts calls), ``GUARD`` (checks inputs)
``probes``         for an observer node: the keys of the probes attached to it
``shape``          ``dtype``, ``device``: what the example run saw (strings for dtype/device)
``source``         the user's source frame, for nodes fxdebug inserted (torch's ``stack_trace``
                   of the node they stand beside, copied here rather than into torch's key)
``auto_leaf``      why the module became a leaf during tracing
``keep_unused``    a node nothing reads on purpose (the manager does not flag it)
``failed``         a message: this node failed a check (drawn red)
``notes``          free-form sentences passes attach for the report and the picture
``stands_for``     for a module fxdebug made (a fused conv, a frozen call): the model's module
                   path it takes the place of; ``to_module`` names it so
``transforms``     what each transform pass recorded about the node, by pass name
                   (``{"fuse": {"layer": ..., "max_abs_diff": ...}}``): ``PassContext.record``
=================  ==========================================================================

A pass keeps its own facts about a node in ``transforms[<its name>]`` (through
``PassContext.record``), never under a key of its own: the core and other passes read only the
keys above.

The graph-level record, ``gm.meta["fxdebug"]``, is a ``GraphRecord``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Generic, Iterator, Mapping, Protocol, TypeVar, cast, overload

from torch.fx import GraphModule, Node

__all__ = [
    "CLOCK",
    "GUARD",
    "INSTRUMENTATION",
    "KEY",
    "GraphRecord",
    "NodeMeta",
    "describe",
    "fx_meta",
    "graph_record",
    "is_instrumentation",
    "module_path",
    "module_type",
    "node_meta",
    "op_label",
    "source_line",
]

KEY = "fxdebug"

# Roles of nodes fxdebug inserts that compute nothing the model computes.
INSTRUMENTATION = "instrumentation"  # watches another node (``observes`` names it)
CLOCK = "clock"  # counts forward calls, once per graph
GUARD = "guard"  # checks the inputs (export graphs' shape guard)
_WATCHING_ROLES = frozenset((INSTRUMENTATION, CLOCK, GUARD))

T = TypeVar("T")


def fx_meta(node: Node) -> dict[str, Any]:
    """Return (creating if needed) the fxdebug metadata dict of ``node``."""
    return cast(dict[str, Any], node.meta.setdefault(KEY, {}))


class _Key(Generic[T]):
    """One typed key of ``node.meta["fxdebug"]``: reads give ``default`` when absent."""

    def __init__(self, default: T) -> None:
        self.default = default
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> "_Key[T]": ...
    @overload
    def __get__(self, obj: "NodeMeta", owner: type) -> T: ...
    def __get__(self, obj: "NodeMeta | None", owner: type) -> "T | _Key[T]":
        if obj is None:
            return self
        raw = obj.node.meta.get(KEY, {})
        if self.name in raw:
            return cast(T, raw[self.name])
        if isinstance(self.default, (list, dict)):
            return cast(T, type(self.default)(self.default))
        return self.default

    def __set__(self, obj: "NodeMeta", value: T) -> None:
        obj.raw[self.name] = value


class NodeMeta:
    """Typed view of one node's ``node.meta["fxdebug"]`` (created on first write).

    ``node_meta(n).added_by = "my-pass"``; reading an absent key gives its default (``None``,
    ``False`` or an empty list: ``changed_by`` and ``probes`` are returned as stored, so append
    through ``add_changed_by`` / ``add_probe``).
    """

    __slots__ = ("node",)

    module: _Key[str | None] = _Key(None)
    module_type: _Key[str | None] = _Key(None)
    added_by: _Key[str | None] = _Key(None)
    changed_by: _Key[list[str]] = _Key([])
    replaced: _Key[str | None] = _Key(None)
    rewritten_from: _Key[list[str]] = _Key([])
    observes: _Key[str | None] = _Key(None)
    role: _Key[str | None] = _Key(None)
    probes: _Key[list[str]] = _Key([])
    shape: _Key[tuple[int, ...] | None] = _Key(None)
    dtype: _Key[str | None] = _Key(None)
    device: _Key[str | None] = _Key(None)
    source: _Key[str | None] = _Key(None)
    auto_leaf: _Key[str | None] = _Key(None)
    keep_unused: _Key[bool] = _Key(False)
    failed: _Key[str | None] = _Key(None)
    notes: _Key[list[str]] = _Key([])
    stands_for: _Key[str | None] = _Key(None)
    transforms: _Key[dict[str, dict[str, Any]]] = _Key({})

    def __init__(self, node: Node) -> None:
        self.node = node

    @property
    def raw(self) -> dict[str, Any]:
        """The dict underneath (``fx_meta(node)``)."""
        return fx_meta(self.node)

    def add_changed_by(self, pass_name: str) -> None:
        changed = self.raw.setdefault("changed_by", [])
        if pass_name not in changed:
            changed.append(pass_name)

    def record(self, pass_name: str, info: dict[str, Any]) -> None:
        """Keep what transform ``pass_name`` did to the node (``transforms[pass_name]``)."""
        self.raw.setdefault("transforms", {})[pass_name] = dict(info)

    def add_probe(self, key: str) -> None:
        self.raw.setdefault("probes", []).append(key)

    def watch(self, role: str, observes: Node | None = None) -> None:
        """Mark the node as fxdebug's own (``INSTRUMENTATION``, ``CLOCK``, ``GUARD``)."""
        if role not in _WATCHING_ROLES:
            raise ValueError(f"role {role!r} is not one of {sorted(_WATCHING_ROLES)}.")
        self.role = role
        if observes is not None:
            self.observes = observes.name

    def __repr__(self) -> str:
        return f"NodeMeta({self.node.name!r}, {self.node.meta.get(KEY, {})!r})"


def node_meta(node: Node) -> NodeMeta:
    """The typed view of ``node.meta["fxdebug"]``."""
    return NodeMeta(node)


@dataclass
class GraphRecord(Mapping[str, Any]):
    """What fxdebug knows about a whole captured graph: ``gm.meta["fxdebug"]``.

    Attributes:
        trace: how the model was captured (a ``TraceInfo``).
        passes: every pass run on it, in order (``PassResult``s).
        model_type: the class name of the user's model.
        instrument_seconds: wall time of ``instrument()``, when it made this module.

        extras: what other modules record about the graph, by their own key.

    It also reads as a mapping of those names (``record["trace"]``), for code that predates it.
    """

    trace: Any = None
    passes: list[Any] = field(default_factory=list)
    model_type: str = "GraphModule"
    instrument_seconds: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key in self._names():
            return getattr(self, key)
        return self.extras[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self._names():
            setattr(self, key, value)
        else:
            self.extras[key] = value

    def __iter__(self) -> Iterator[str]:
        return iter((*self._names(), *self.extras))

    def __len__(self) -> int:
        return len(self._names()) + len(self.extras)

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "extras")

    def copy(self) -> "GraphRecord":
        """A record sharing the trace info, with its own list of pass results."""
        return GraphRecord(self.trace, list(self.passes), self.model_type, self.instrument_seconds, dict(self.extras))


class HasMeta(Protocol):
    """A module carrying fxdebug's record in ``meta``: a ``GraphModule``, or a live capture (not a graph itself)."""

    meta: dict[str, Any]


def graph_record(gm: HasMeta | GraphModule) -> GraphRecord:
    """The ``GraphRecord`` of ``gm`` (created on first use; a plain dict is converted)."""
    meta = gm.meta
    record = meta.get(KEY)
    if isinstance(record, GraphRecord):
        return record
    raw: Mapping[str, Any] = record if isinstance(record, Mapping) else {}
    names = GraphRecord._names()
    new = GraphRecord(**{k: v for k, v in raw.items() if k in names},
                      extras={k: v for k, v in raw.items() if k not in names})
    meta[KEY] = new
    return new


def module_path(node: Node) -> str:
    """Dotted path of the module that owns ``node``; ``""`` for the root module."""
    meta = node.meta.get(KEY, {})
    if "module" in meta:
        return str(meta["module"])
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
        return cast("str | None", meta["module_type"])
    stack = node.meta.get("nn_module_stack")
    if stack:
        typ = list(stack.values())[-1][1]
        return typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1].rstrip("'>")
    return None


_NO_META: dict[str, Any] = {}
_SKIPPED_ROLES = frozenset(("instrumentation", "clock", "guard", "shadow"))


def is_instrumentation(node: Node) -> bool:
    """True for nodes that fxdebug inserted only to watch another node."""
    return node.meta.get(KEY, _NO_META).get("role") in _SKIPPED_ROLES  # no dict made per call (several per node)


_EXPORT_PATH = re.compile(r"L\['self'\]\.?|L__self__\.?|\._modules\['([^']+)'\]|\[(\d+)\]")


def _clean_export_path(path: str) -> str:
    """``L['self'].layer1[0].conv1`` / ``L__self___layer1`` → ``layer1.0.conv1``."""
    if "L[" not in path and "L__self__" not in path and "[" not in path:
        return path

    def repl(m: re.Match[str]) -> str:
        group = m.group(1) or m.group(2)
        return f".{group}" if group else ""

    return _EXPORT_PATH.sub(repl, path).strip(".")


_FXDEBUG_FRAME = re.compile(r"[/\\\\]fxdebug[/\\\\](?!.*[/\\\\]tests[/\\\\])")
_INTERNAL = re.compile(r"[/\\\\](torch|fxdebug|transformers[/\\\\]utils)[/\\\\]|^<")


def source_line(node: Node) -> str | None:
    """``file.py:41 `out = self.conv1(x)``` for the user's line that created ``node``, if FX kept it."""
    trace = node.meta.get(KEY, {}).get("source") or node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    # The innermost user frame is the last 'File "...", line N' entry, followed by its code line.
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r'File "([^"]+)", line (\d+)', lines[i])
        if m and _FXDEBUG_FRAME.search(m.group(1)):
            return None  # fxdebug's own capture call: the op has no user line (inside nn.Sequential)
        if m and not _INTERNAL.search(m.group(1)):
            filename = m.group(1).rsplit("/", 1)[-1]
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"{filename}:{m.group(2)} `{code}`" if code else f"{filename}:{m.group(2)}"
    return None


def node_identity(node: Node) -> tuple[str, str, str]:
    """``(name, module path, what it computes)``: what ``describe`` says of a node, as the identities themselves. A
    probe keeps this (not the sentence) when its pass's work is copied to the other instances of a block
    (``Pass.shares_instances``: the copy renames identities, never prose) and words it when shown."""
    typ = module_type(node)
    return node.name, module_path(node), typ if node.op == "call_module" and typ else op_label(node)


def describe(node: "Node | tuple[str, str, str]") -> str:
    """``node 'conv1' (module layer1.0.conv1, Conv2d)``: how every message names a node (a ``Node``, or its
    ``node_identity``)."""
    name, path, what = node_identity(node) if isinstance(node, Node) else node
    return f"node '{name}' (module {path or '<root>'}, {what})"


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
