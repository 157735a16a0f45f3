"""One instrumented graph per repeated block: a region's later instances get a renamed copy of the first one's.

Under regional capture (``live_regions``) Dynamo traces a block's region once and hands the same graph over
for every instance of the group; the call-site look-up (``capture/dynamo_sites``) gives each instance its
own part, named for its module path (``layers.17.mlp.down_proj``), so each keeps its own rows. Running the
passes, learning shapes and lowering again for each of 2,500 instances was most of a deep model's start-up.

Here the first instance's part is the group's *template*; a later instance at the same graph, with the same
input signature, gets a copy of it in which every identity of the template's instance (its node names, module
paths, parameter paths, get_attr targets, the model's own submodules and parameters) is replaced by the new
instance's, and whose observers and clock are fresh: its own row table. The identities come from the copy's
own ``prepare`` (Dynamo's graph named for the new site), matched to the template's node by node, so nothing is
guessed from text; a name the passes derived from a node's (``obs_<node>``) is renamed by the node's. The copy is
that prepared graph itself with the passes' nodes inserted where the template has them (its own nodes keep what
``prepare`` gave them; the template's fxdebug metadata, renamed, replaces theirs), checked against the template
before it is touched.

A copy is made only when every pass says its work is the same, renamed, on every instance
(``Pass.shares_instances``, and no ``where=`` selection, which names paths); a pass that keeps state of its own
about the graphs it ran on hears of each copy (``Pass.on_instance_copy``). Anything the copy cannot vouch for (an
fxdebug module it does not know in the part, a name that would collide, another graph shape) leaves that
instance to the passes, as before. ``FXDEBUG_REGION_COPIES=0`` turns copies off.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn
from torch.fx import Graph, Node

from fxdebug.authoring.context import NAMESPACE
from fxdebug.capture.dynamo_backends import compiled
from fxdebug.authoring.pipeline import Pass
from fxdebug.capture.dynamo import Prepared
from fxdebug.capture.dynamo_regions import REGION_NAME
from fxdebug.graph.meta import KEY, graph_record
from fxdebug.graph.module_sharing import submodule
from fxdebug.instrumented.copy_walk import Renamer
from fxdebug.instrumented.live_parts import _Part, _part_over, _runner
from fxdebug.instrumented.module import InstrumentedGraphModule
from fxdebug.runtime.observer import Clock, Observer

__all__ = ["Template", "copied_part", "copies_enabled", "copy_part", "guard_order", "identities", "passes_share",
           "shared_runner", "signature", "template_for"]

_SLOT = "_fxdebug_slot"


def copies_enabled() -> bool:
    """Whether a region's later instances are copies of its first (``FXDEBUG_REGION_COPIES=0``: each runs the passes)."""
    return os.environ.get("FXDEBUG_REGION_COPIES", "1") not in ("0", "off", "false", "no")


def passes_share(passes: Sequence[Pass]) -> bool:
    """Whether every pass's work on one instance of a block is the same, renamed, on the others."""
    return bool(passes) and all(p.shares_instances and p.where is None and "prior_report" not in p.requires
                                for p in passes)


def template_for(graph: Any) -> Any:
    """The key a region graph's instances share (the graph Dynamo handed over), or ``None`` for any other graph."""
    base = getattr(graph, "base", None)
    site = getattr(graph, "site", None)
    if base is None or site is None or not site.module or REGION_NAME not in (graph.code or ""):
        return None
    return base


Identity = tuple[str, str, Any, Any, Any]  # (op, name, target if a string, module path, parameter path)


def identities(graph: Graph) -> list[Identity]:
    """What names a prepared graph's nodes for their instance, in order (taken before the passes run)."""
    out = []
    for n in graph.nodes:
        meta = n.meta.get(KEY) or {}
        out.append((n.op, n.name, n.target if isinstance(n.target, str) else None, meta.get("module"), meta.get("param")))
    return out


def signature(values: Sequence[Any]) -> tuple[Any, ...]:
    """The input signature a copy must share with its template: each tensor's shape, dtype, device and grad flag."""
    return tuple((tuple(v.shape), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else (type(v), v)
                 for v in values)


@dataclass(eq=False)
class Template:
    """A region's first instrumented instance: what its later instances are copied from."""

    graph: Any  # the template's own (sited) graph: its part must still be the live module's
    found: Any  # its ``live_parts._Part``
    names: list[Identity]
    signature: tuple[Any, ...]
    module: str  # the instance's module path
    pattern: "re.Pattern[str] | None" = None  # its node names, longest first (names the passes derived from them)
    inert: set[str] = dataclasses.field(default_factory=set)  # its strings that hold none of its identities
    same: dict[int, Any] = dataclasses.field(default_factory=dict)  # its immutable objects that hold none (by id)
    plans: dict[int, Any] = dataclasses.field(default_factory=dict)  # the copies' recipes (``copy_walk``)
    runner_shared: bool | None = None  # whether its runner reaches nothing of the instance but its slots
    originals: frozenset[str] = dataclasses.field(init=False)  # its instance's own node names (the rest: the passes')

    def __post_init__(self) -> None:
        self.originals = frozenset(n[1] for n in self.names)


class _Uncopyable(Exception):
    """Something in the template the copy cannot vouch for: the instance runs the passes instead."""


def _name_table(old: list[Identity], new: list[Identity], module_old: str, module_new: str) -> dict[str, str] | None:
    """Every identity string of the template mapped to the copy's, node by node; ``None`` if the graphs differ."""
    if len(old) != len(new):
        return None
    table: dict[str, str] = {module_old: module_new}
    for a, b in zip(old, new):
        if a[0] != b[0]:
            return None
        for x, y in zip(a[1:], b[1:]):
            if x is None and y is None:
                continue
            if not isinstance(x, str) or not isinstance(y, str):
                return None
            if table.setdefault(x, y) != y:
                return None  # one identity of the template, two of the copy: not the same graph
    return table


def _pattern(names: list[Identity]) -> "re.Pattern[str] | None":
    words = sorted({n[1] for n in names if n[1]}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, words))) if words else None


def copy_part(template: Template, prepared: Prepared, model: nn.Module,
              passes: Sequence[Pass]) -> tuple[InstrumentedGraphModule, dict[int, Any]] | None:
    """The copy of ``template``'s part for the instance ``prepared`` names; ``None`` when it cannot be one.

    Returns ``(part, memo)``: ``memo`` maps the template's objects (observers, clock, constants) to the copy's, for
    its runner."""
    new_path = _site_module(prepared)
    table = None if new_path is None else _name_table(template.names, identities(prepared.graph), template.module,
                                                      new_path)
    if table is None or new_path is None:
        return None
    if template.pattern is None:
        template.pattern = _pattern(template.names)
    # the classes whose objects are copied: fxdebug's own, and the modules the passes come from (their probes' helpers)
    modules = ("fxdebug.",) + tuple(sorted({type(p).__module__ for p in passes}))
    renamer = Renamer(table, template, modules)
    source: InstrumentedGraphModule = template.found.part
    try:
        part = _copy(source, prepared, model, renamer, template.module, new_path)
    except _Uncopyable:
        return None
    for p in passes:
        hook = getattr(p, "on_instance_copy", None)
        if hook is not None:
            hook(source, part, table)
    return part, renamer.memo


def _site_module(prepared: Prepared) -> str | None:
    """The copy's instance path: its graph's inputs belong to it (``prepare`` puts them at the site)."""
    for n in prepared.graph.nodes:
        if n.op == "placeholder":
            return (n.meta.get(KEY) or {}).get("module") or None
    return None


def _copy(source: InstrumentedGraphModule, prepared: Prepared, model: nn.Module, renamer: Renamer, old_path: str,
          new_path: str) -> InstrumentedGraphModule:
    part = _part_over(model, prepared)  # the instance's own prepared graph, its nodes
    renamer.seed(source, part)  # named and read as the passes would have seen them
    _pair_modules(model, old_path, new_path, renamer)
    graph = prepared.graph
    mine = _matched(source, graph, renamer)  # checked before the graph is touched: a failure leaves it as prepared
    old_space, new_space = source.__dict__.get(NAMESPACE), part.__dict__.get(NAMESPACE)
    if old_space is None or new_space is None:
        raise _Uncopyable("no namespace")
    for name, child in old_space._modules.items():
        if name != "constants" and (not isinstance(child, (Observer, Clock)) or child.__dict__.get("_modules")):
            raise _Uncopyable(f"fxdebug.{name}")  # a module a pass registered that the copy does not know
    nodes = renamer.memo
    made = []
    cursor: Node | None = None
    for node in source.graph.nodes:  # the template's nodes: its instance's own ones matched, the passes' inserted
        new = mine.get(node)
        if new is None:
            name = renamer.text(node.name)
            target = renamer.text(node.target) if isinstance(node.target, str) else node.target
            args, kwargs = renamer.planned(node.args), renamer.planned(node.kwargs)
            where = graph.inserting_before(next(iter(graph.nodes))) if cursor is None else graph.inserting_after(cursor)
            with where:
                new = graph.create_node(node.op, target, args, kwargs, name, node.type)
            new.meta.update({k: v for k, v in node.meta.items() if k != KEY})
        cursor = new
        nodes[id(node)] = new
        renamer.keep.append(node)
        made.append((node, new))
    for node, new in made:  # every node made first: metadata and probes may name any of them
        meta = node.meta.get(KEY)
        if meta is not None:
            new.meta[KEY] = renamer.planned(meta)
    renamer.seed(old_space, new_space)
    for name, child in old_space._modules.items():
        if name == "constants":
            renamer.seed(child, new_space._modules["constants"])
        else:
            new_space._modules[renamer.text(name)] = renamer.planned(child)
    part.meta.update({k: renamer.planned(v) for k, v in source.meta.items()})
    return part


def _matched(source: InstrumentedGraphModule, graph: Graph, renamer: Renamer) -> dict[Node, Node]:
    """The template's nodes of its own instance -> the copy's prepared ones, in order, each with the copy's name, op
    and inputs; and no name the passes added that the copy's graph already has (FX would rename it)."""
    originals = list(graph.nodes)
    taken = {n.name for n in originals}
    out: dict[Node, Node] = {}
    i = 0
    for node in source.graph.nodes:
        name = renamer.text(node.name)
        if node.name not in renamer.originals:
            if name in taken:
                raise _Uncopyable(name)
            taken.add(name)
            continue
        mine = originals[i] if i < len(originals) else None
        i += 1
        if mine is None or mine.name != name or mine.op != node.op:
            raise _Uncopyable(name)
        if [renamer.text(a.name) for a in node.all_input_nodes] != [a.name for a in mine.all_input_nodes]:
            raise _Uncopyable(name)  # a pass rewired it: not the graph the copy's instance has
        out[node] = mine
    if i != len(originals):
        raise _Uncopyable("nodes left")
    return out


def _pair_modules(model: nn.Module, old_path: str, new_path: str, renamer: Renamer) -> None:
    """The template instance's submodules, parameters and buffers mapped to the copy's, by position (a region's
    instances have one structure: the group key compares it)."""
    try:
        old, new = submodule(model, old_path), submodule(model, new_path)
    except AttributeError as exc:
        raise _Uncopyable(str(exc)) from None
    a, b = list(old.named_modules(remove_duplicate=False)), list(new.named_modules(remove_duplicate=False))
    if len(a) != len(b):
        raise _Uncopyable(new_path)
    for (na, ma), (nb, mb) in zip(a, b):
        if na != nb or type(ma) is not type(mb):
            raise _Uncopyable(new_path)
        renamer.seed(ma, mb)
        for table in ("_parameters", "_buffers"):
            ta, tb = ma.__dict__.get(table) or {}, mb.__dict__.get(table) or {}
            if ta.keys() != tb.keys():
                raise _Uncopyable(new_path)
            for key, value in ta.items():
                if value is not None and tb[key] is not None:
                    renamer.seed(value, tb[key])


def shared_runner(template: Template, memo: dict[int, Any], part: InstrumentedGraphModule) -> Any:
    """The copy's runner: the template's runner module over the copy's slots (same code, same structure), or
    ``None`` when the template's runner reaches anything else of its instance (then the copy gets its own)."""
    run = template.found.run
    runner = getattr(run, "__self__", None)
    if runner is None or getattr(run, "__func__", None) is not getattr(type(runner), "forward", None):
        return None  # compiled, or not a runner module
    if template.runner_shared is None:
        template.runner_shared = all(
            n.op not in ("get_attr", "call_module") or str(n.target).split(".", 1)[0].startswith(_SLOT)
            for n in runner.graph.nodes)
    if not template.runner_shared:
        return None
    new = object.__new__(type(runner))
    state = dict(runner.__dict__)
    for key, value in runner.__dict__.items():
        if key.startswith(_SLOT):
            mapped = memo.get(id(value))
            if mapped is None:
                return None
            state[key] = mapped
    state[NAMESPACE] = part.__dict__.get(NAMESPACE)
    state["_modules"] = part._modules
    new.__dict__.update(state)
    return new.forward


def copied_part(state: Any, model: nn.Module, graph: Any, shared: Any, prepared: Prepared, args: tuple[Any, ...],
                start: float) -> _Part | None:
    """The part of a region's later instance as a renamed copy of its group's first, entered in the live module's
    ``state``; ``None`` when there is no template for it yet or the copy cannot be made (the passes run instead)."""
    template = state.templates.get(shared)
    if template is None or state.parts.get(template.graph) is not template.found:
        state.templates.pop(shared, None)  # its part was dropped (a replaced part, a forgotten capture)
        return None
    if prepared.keep != template.found.keep or signature([args[i] for i in prepared.keep]) != template.signature:
        return None
    made = copy_part(template, prepared, model, state.passes)
    if made is None:
        return None
    part, memo = made
    graph_record(part).trace.seconds = time.perf_counter() - start
    run = shared_runner(template, memo, part) if graph.compiler is None else None
    if run is None:
        run = _runner(part, len(args), prepared.keep)
        if graph.compiler is not None:
            run = compiled(run, graph.compiler)
    state.region_copies += 1
    found = state.parts[graph] = _Part(part, prepared.keep, run)
    return found


def guard_order(parts: dict[Any, _Part]) -> list[_Part]:
    """The parts that may take the model's inputs, in the order a call reaches them (each frame and call site at its
    first capture), the newest recompile of each first. Of the block regions' parts only the first region's (a call's
    first module): a later region takes what the modules before it made (run on the model's arguments, a block that
    takes one tensor blamed its input for the model's shape; the head's is not where a mismatch shows first)."""
    groups: dict[tuple[Any, ...], list[_Part]] = {}
    first: Any = None
    for graph, found in parts.items():
        site = getattr(graph, "site", None)
        label = site.label if site is not None else ""
        if template_for(graph) is not None:
            first = label if first is None else first
            if label != first:
                continue
        groups.setdefault((graph.frame, label), []).append(found)
    return [found for group in groups.values() for found in reversed(group)]
