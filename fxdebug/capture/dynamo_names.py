"""Stable names for the graphs Dynamo hands over, so that rows of every capture merge into one report.

``NodeNamer`` / ``prepare`` make a copy of a graph whose nodes carry a stable identity: module
path + op + occurrence (``fc1``, ``layer1_0_conv1``, ``relu_1``), the same name in every
recompile of a frame; placeholders that are the model's parameters and buffers are named and
attributed to their module (read live through ``get_attr``). Split out of ``capture/dynamo.py``
(the backend and dispatch stay there), which re-exports these names.
"""

from __future__ import annotations

import builtins
import inspect
import keyword
import os
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from fxdebug.graph.meta import _clean_export_path, fx_meta
from fxdebug.graph.module_sharing import submodule

__all__ = ["NodeNamer", "Prepared", "clean_path", "prepare", "state_name"]


class _Graph(Protocol):
    """What ``prepare`` reads of a ``capture.dynamo.DynamoGraph``."""

    gm: GraphModule
    frame: int
    code: str
    sources: list[str]


# -- stable names ----------------------------------------------------------------------------------
# the frame's self is ``L['self']`` (any name), or ``L['args'][0]`` when forward is wrapped by a ``def wrapper(*args,
# **kwargs)`` decorator (Hugging Face's ``check_model_inputs`` / ``can_return_tuple`` on Llama and others)
_STATE = re.compile(r"^L\['(\w+)'\](?:\[0\])?((?:\._modules\['[^']+'\])*)\.(_parameters|_buffers)\['([^']+)'\]$")
_CHILD = re.compile(r"\._modules\['([^']+)'\]")
_LOCAL_NAME = re.compile(r"^L\['(\w+)'\]$")


def _source_name(node: Node) -> str:
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    if callable(name):
        name = name()
    return str(name) if name else ""


def state_name(source: str) -> tuple[str, str, str] | None:
    """``(module path, attribute, "parameter"|"buffer")`` for a placeholder source that is model state."""
    m = _STATE.match(source)
    if m is None:
        return None
    path = ".".join(_CHILD.findall(m.group(2)))
    return path, m.group(4), "parameter" if m.group(3) == "_parameters" else "buffer"


_SELF_IN_ARGS = re.compile(r"^L\['args'\]\[0\]\._(modules|parameters|buffers)\[")
_ITEM = re.compile(r"^L\['(\w+)'\]\[(?:(\d+)|'(\w+)')\]$")


def _input_name(source: str, model: Any = None, shift: int = 0) -> str | None:
    """The user's name for an input placeholder: the forward's parameter name.

    ``L['x']`` is ``x``. A module whose ``forward`` Dynamo enters through torch's wrapper (an
    ``nn.Sequential``, for one) hands its inputs over as ``L['args'][i]`` / ``L['kwargs']['k']``:
    the i-th positional parameter of the model's ``forward``, or ``k``. Items of ``*rest`` are
    ``rest_0``, ``rest_1``, ... ``shift``: 1 when ``L['args'][0]`` is the module itself (a wrapped forward).
    """
    m = _LOCAL_NAME.match(source)
    if m:
        return m.group(1)
    m = _ITEM.match(source)
    if m is None:
        return None
    container, index, key = m.group(1), m.group(2), m.group(3)
    if key is not None:
        return key if container == "kwargs" else f"{container}_{key}"
    if container == "args" and model is not None:
        positional, var = _positional(model.forward)
        at = int(index) - shift
        if 0 <= at < len(positional):
            return positional[at]
        if var and at >= 0:
            return f"{var[0]}_{at - len(positional)}"
    return f"{container}_{index}"


_SIGNATURES: "weakref.WeakKeyDictionary[Any, tuple[list[str], list[str]]]" = weakref.WeakKeyDictionary()


def _positional(forward: Any) -> tuple[list[str], list[str]]:
    """``(positional parameter names, the *rest name if any)`` of a bound ``forward``, read once per function
    (``inspect.signature`` cost ~40 us, once per graph of each of 25,000 region instances)."""
    fn = getattr(forward, "__func__", None)
    found = _SIGNATURES.get(fn) if fn is not None else None
    if found is None:
        try:
            params = list(inspect.signature(forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        found = ([p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)],
                 [p.name for p in params if p.kind == p.VAR_POSITIONAL])
        if fn is not None:
            try:
                _SIGNATURES[fn] = found
            except TypeError:  # not weakly referable: looked up each time
                pass
    return found


_ROOT = re.compile(r"^L\['args'\]\[0\]\.?|^L\['\w+'\]\.?|^L__\w+?___?")


def clean_path(path: str) -> str:
    """``L['self'].layer1[0].conv1`` (any name for the frame's ``self``) → ``layer1.0.conv1``."""
    return _clean_export_path(_ROOT.sub("", path))


def _scope(node: Node, aliases: dict[str, str] | None = None) -> tuple[str, str | None, tuple[str, ...]]:
    """(module path, module type, stack keys) of the innermost module ``node`` ran in.

    ``aliases``: locals of the frame that hold one of the model's modules (``L['___stack0']``: a resume
    function after a graph break gets ``self.out``, loaded before the break, as a stack value) -> its path."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", None, ()
    path, typ = list(stack.values())[-1]
    type_name = typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1].rstrip("'>")
    raw = str(path)
    for local, where in (aliases or {}).items():
        if raw == local or raw.startswith(local + ".") or raw.startswith(local + "["):
            return _join(where, clean_path(raw[len(local):])), type_name, tuple(stack)
    return clean_path(raw), type_name, tuple(stack)


def _owned(model: Any, owners: dict[int, tuple[str, str, str]], source: str, value: Any,
           aliases: dict[str, str]) -> tuple[str, str, str] | None:
    """``(path, attr, kind)`` of the model's parameter or buffer ``value`` is, read through a local other than the
    frame's ``self`` (``L['___stack0']._parameters['weight']``); the local is noted as an alias of its module."""
    m = _STATE.match(source)
    if m is None or m.group(1) == "self" or not hasattr(model, "named_parameters"):
        return None
    if not owners:
        for name, p in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), (*_split(name), "parameter"))
        for name, b in model.named_buffers(remove_duplicate=False):
            owners.setdefault(id(b), (*_split(name), "buffer"))
    found = owners.get(id(value))
    if found is None:
        return None
    chain = _CHILD.findall(m.group(2))
    parts = found[0].split(".") if found[0] else []
    if len(parts) >= len(chain) and parts[len(parts) - len(chain):] == chain:
        aliases.setdefault(f"L['{m.group(1)}']", ".".join(parts[:len(parts) - len(chain)]))
    return found


def _split(name: str) -> tuple[str, str]:
    path, _, attr = name.rpartition(".")
    return path, attr


def _op_name(node: Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None) or type(target).__name__
    return str(name).lstrip("_") or "op"


_RESERVED = frozenset(keyword.kwlist) | frozenset(dir(builtins)) | {"inf", "nan", "NoneType", "torch", "device",
                                                                   "fx_pytree", "pytree"}


@dataclass
class NodeNamer:
    """Stable node identities over every capture of one live module.

    ``(frame, base, occurrence)`` maps to one name, so every recompile of a frame names its nodes
    alike and their rows merge. The frame is the model's forward (``ROOT``, whichever frame Dynamo
    ran it in), a resume function or helper by its code, or (code, call site) for a graph that runs
    at a call site of its own (``capture.dynamo_sites``); a module called in two frames (before and
    after a graph break) is two places, two names (``a``, ``a_1``).
    """

    names: dict[tuple[Any, str, int], str] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    def name(self, frame: Any, base: str, occurrence: int) -> str:
        key = (frame, base, occurrence)
        found = self.names.get(key)
        if found is not None:
            return found
        n, candidate = occurrence, base if occurrence == 0 else f"{base}_{occurrence}"
        while candidate in self.used or candidate in _RESERVED:  # FX renames a builtin's name (``sum`` -> ``sum_1``)
            n += 1
            candidate = f"{base}_{n}"
        self.used.add(candidate)
        self.names[key] = candidate
        return candidate


def _safe(name: str) -> str:
    out = re.sub(r"\W", "_", name)
    return out if out and not out[0].isdigit() else f"_{out}"


@dataclass
class Prepared:
    """A graph ready for the passes: stable names, module paths, model state read by ``get_attr``.

    ``keep``: which of Dynamo's arguments the graph still takes (the others are the model's own
    parameters and buffers, read live from the model); ``constants``: ``{target: value}`` for
    tensors and modules Dynamo's graph held itself, to be registered under ``fxdebug.*``.
    """

    graph: Graph
    keep: list[int]
    constants: dict[str, Any]


def _resolve(model: Any, path: str, attr: str, kind: str, owners: dict[str, Any] | None = None) -> Any:
    """The model's parameter or buffer ``attr`` of the module at ``path`` (``None`` if there is none); ``owners``
    caches the modules looked up (a block's parameters share a few owners; each look-up walks the path)."""
    owner = None if owners is None else owners.get(path)
    if owner is None:
        try:
            owner = submodule(model, path)
        except AttributeError:
            return None
        if owners is not None:
            owners[path] = owner
    table = owner._parameters if kind == "parameter" else owner._buffers
    return table.get(attr)


ENTRY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")  # fxdebug/ (its trampoline)
ROOT = "<root>"  # the namer's frame key of the model's forward, whichever frame Dynamo ran it in


def root_codes(model: Any) -> set[str]:
    """The code keys (``file:function:first line``) of ``model``'s forward, and of what a decorator wraps."""
    out = set()
    forward = getattr(type(model), "forward", None)
    while forward is not None:  # a decorated forward (``functools.wraps``): the wrapper and what it wraps
        code = getattr(forward, "__code__", None)
        if code is not None:
            out.add(f"{code.co_filename}:{code.co_name}:{code.co_firstlineno}")
        forward = getattr(forward, "__wrapped__", None)
        if len(out) > 8:
            break
    return out


def frame_key(graph: Any, model: Any) -> Any:
    """The namer's key for ``graph``'s frame: one for the model's forward (Dynamo runs it inside fxdebug's entry
    trampoline when nothing in it breaks the graph, and as a frame of its own after a break inside it), else the
    frame's code."""
    code = graph.code
    if code and (code.startswith(ENTRY_DIR) or code in root_codes(model)):
        return ROOT
    return code or graph.frame


def _join(scope: str, path: str) -> str:
    return ".".join(p for p in (scope, path) if p)


def _site_prefix(site: Any) -> str:
    """What the names of a graph at a call site other than the root's start with (``capture.dynamo_sites.Site``):
    the calling module's path, the helper's function (not a module's ``forward``), the occurrence."""
    if site is None:
        return ""
    parts = [site.module.replace(".", "_")] if site.module else []
    if site.function and site.function != "forward":
        parts.append(site.function)
    if site.occurrence:
        parts.append(str(site.occurrence))
    return "_".join(parts)


def prepare(graph: _Graph, namer: NodeNamer, args: tuple[Any, ...], model: Any, space: str) -> Prepared:
    """A copy of ``graph`` with stable node names; placeholders that are ``model``'s state become ``get_attr``.

    A placeholder becomes ``get_attr`` only when the model's attribute at its source path is the
    very tensor Dynamo passed (a frame whose ``self`` is not the model keeps its placeholders).
    A graph at a call site (``graph.site``, see ``capture.dynamo_sites``) is named for that site:
    its module paths are under the calling module (a submodule's own frame reads ``L['self']`` as
    that submodule), its names start with the site's prefix, and the namer keys them by site.
    """
    site = getattr(graph, "site", None)
    scope = site.module if site is not None else ""
    prefix = _site_prefix(site)
    key: Any = frame_key(graph, model) if site is None else (graph.code or graph.frame, site)
    src = graph.gm
    new = Graph()
    env: dict[Node, Node] = {}
    keep: list[int] = []
    constants: dict[str, Any] = {}
    counts: dict[str, int] = {}
    sources = list(graph.sources)
    # a wrapped forward: args[0] is self (its state is read through it; not a size of an input, L['args'][0].size())
    shift = 1 if any(_SELF_IN_ARGS.match(src) for src in sources) else 0
    index = -1
    owners: dict[int, tuple[str, str, str]] = {}  # id(tensor) -> the model's (path, attr, kind), built when needed
    found: dict[str, Any] = {}  # module path -> the module there, looked up once per graph
    aliases: dict[str, str] = {}  # a local that holds one of the model's modules (``L['___stack0']``) -> its path

    def arg(a: Any) -> Any:
        return map_arg(a, lambda n: env[n])

    for node in src.graph.nodes:
        meta = {k: v for k, v in node.meta.items() if k not in ("grapharg", "fxdebug")}
        if node.op == "placeholder":
            index += 1
            source = sources[index] if index < len(sources) else ""
            state = state_name(source)
            if state is not None and scope:  # a submodule's frame: its self is the module at the site
                nested = (_join(scope, state[0]), state[1], state[2])
                if index < len(args) and _resolve(model, *nested, found) is args[index]:
                    state = nested
            value = _resolve(model, *state, found) if state is not None else None
            if state is not None and index < len(args) and value is not args[index]:
                state = _owned(model, owners, source, args[index], aliases)  # read through another local
                value = args[index] if state is not None else None
            if state is not None and index < len(args) and value is args[index]:
                path, attr, kind = state
                out = new.get_attr(f"{path}.{attr}".lstrip("."))
                out.meta.update(meta)
                fx_meta(out).update(module=path, param=f"{path}.{attr}".lstrip("."), state=kind, dynamo_arg=index)
            else:
                keep.append(index)
                name = _input_name(source, model, shift) or node.name
                full = _safe(f"{prefix}_{name}" if prefix else name)
                # one name per frame, as every recompile of it names it: a resume function's ``x`` is the local's value
                # at the break (``x_1``), not the model's input ``x``; Dynamo's own ``___stack0`` is a value the eager
                # code before the frame made
                full = namer.name(key, full, 0)
                out = new.placeholder(full)
                out.meta.update(meta)
                fx_meta(out)["module"] = scope
            env[node] = out
            continue
        if node.op == "output":
            out = new.output(arg(node.args[0]))
            out.meta.update(meta)
            env[node] = out
            continue
        if node.op == "get_attr" or node.op == "call_module":  # Dynamo's own constants and modules
            name = _safe(str(node.target).replace(".", "_"))
            constants[name] = _fetch(src, str(node.target))
            out = new.create_node(node.op, f"{space}.constants.{name}", arg(node.args), arg(node.kwargs), name=name)
            out.meta.update(meta)
            env[node] = out
            continue
        inner, typ, keys = _scope(node, aliases)
        path = _join(scope, inner)
        if inner and _is_scope_output(node, keys):
            base = path.replace(".", "_")
        else:
            op = _op_name(node)
            base = f"{path.replace('.', '_')}_{op}" if inner else (f"{prefix}_{op}" if prefix else op)
        base = _safe(base)
        k = counts.get(base, 0)
        counts[base] = k + 1
        out = new.create_node(node.op, node.target, arg(node.args), arg(node.kwargs),
                              name=namer.name(key, base, k))
        out.meta.update(meta)
        fx_meta(out)["module"] = path
        if typ is not None:
            fx_meta(out)["module_type"] = typ
        env[node] = out
    return Prepared(new, keep, constants)


def _fetch(gm: Any, target: str) -> Any:
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _is_scope_output(node: Node, keys: tuple[str, ...]) -> bool:
    """Whether ``node``'s value leaves its innermost module (a user outside it, or the graph output)."""
    if not keys:
        return False
    inner = keys[-1]
    for user in node.users:
        if user.op == "output":
            return True
        stack = user.meta.get("nn_module_stack") or {}
        if inner not in stack:
            return True
    return False
