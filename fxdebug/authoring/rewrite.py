"""Pattern rewriting for pass authors: find a small subgraph, replace it, keep the provenance.

A *pattern* is a tiny model written as ordinary PyTorch — a function (``lambda x: torch.relu(x)``)
or a module (``nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1))``). It is traced once and
matched against the graph from its output backwards:

* ``call_function`` / ``call_method`` nodes match the same function or method name;
* ``call_module`` nodes match any module of the same *type* (sizes and weights do not matter), so
  one pattern covers every Conv2d followed by a BatchNorm2d;
* placeholders match any value, but the same placeholder must always meet the same value;
* constant arguments must be equal.

A match is *blocked* (and says why) when a node inside it — anything but its output — is also
used outside it, or is watched by instrumentation: replacing it would take a value away from
someone. ``find_pattern`` returns blocked matches too, so a pass can tell the user why it left a
pair alone; ``replace_pattern`` only rewrites the others.

The replacement is a module (one ``call_module`` node, registered under fxdebug's namespace —
never inside the user's model) or a function (traced and inlined), fixed or built per match with
``build=``. New nodes inherit the output node's fxdebug metadata (module path, source line) and
record what they replaced (``node_meta(n).replaced``, ``.rewritten_from``); torch's keys are only read.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.fx import GraphModule, Interpreter, Node

from fxdebug.authoring.context import PassContext
from fxdebug.graph.inputs import bind_inputs, normalize_inputs, preserved_state
from fxdebug.errors import ArgumentTypeError, MissingInputsError, UsageError
from fxdebug.graph.meta import describe, is_instrumentation, node_meta, op_label
from fxdebug.graph.classify import get_module
from fxdebug.graph.edits import follow_observations
from fxdebug.graph.select import Where, matches

__all__ = ["Match", "Replacement", "find_pattern", "keep_state", "node_values", "replace_pattern"]

Pattern = Any  # a function, an nn.Module, or an already traced GraphModule


@dataclass
class Match:
    """One place where a pattern occurs.

    Attributes:
        anchor: the graph node matched by the pattern's output; its users see the replacement.
        nodes: every matched graph node (placeholders excluded), in graph order.
        inputs: the graph values bound to the pattern's placeholders, in placeholder order.
        roles: pattern node name -> graph node (``{"_0": conv, "_1": bn}`` for a Sequential).
        blocked: why this match cannot be replaced, as a sentence; ``None`` when it can.
    """

    gm: GraphModule
    anchor: Node
    nodes: list[Node]
    inputs: list[Any]
    roles: dict[str, Node] = field(default_factory=dict)
    blocked: str | None = None

    def modules(self) -> list[nn.Module]:
        """The modules the matched ``call_module`` nodes call, in graph order."""
        mods = [get_module(self.gm, n) for n in self.nodes if n.op == "call_module"]
        return [m for m in mods if m is not None]

    def describe(self) -> str:
        """``Conv2d (conv1) + BatchNorm2d (bn1)``."""
        return " + ".join(f"{op_label(n)} ({n.name})" for n in self.nodes)


@dataclass
class Replacement:
    """A rewritten match: the nodes that replaced it and the one its users now read."""

    match: Match
    output: Node
    added: list[Node]


def _trace_pattern(pattern: Pattern) -> GraphModule:
    if isinstance(pattern, GraphModule):
        return pattern
    if isinstance(pattern, nn.Module) or callable(pattern):
        try:
            return torch.fx.symbolic_trace(pattern)
        except Exception as exc:
            raise UsageError(f"the pattern {pattern!r:.80} could not be traced ({type(exc).__name__}: {exc}); "
                             "write it as a plain function or module without data-dependent Python.") from exc
    raise ArgumentTypeError(f"a pattern is a function or an nn.Module; got {type(pattern).__name__}.")


def _pattern_output(pgm: GraphModule) -> Node:
    out = next(n for n in pgm.graph.nodes if n.op == "output")
    value = out.args[0]
    if not isinstance(value, Node) or value.op == "placeholder":
        raise UsageError("a pattern must return exactly one computed value (a single tensor, not a tuple or an input).")
    return value


class _Matcher:
    def __init__(self, pgm: GraphModule, gm: GraphModule) -> None:
        self.pgm, self.gm = pgm, gm
        self.bind: dict[Node, Any] = {}
        self.pairs: dict[Node, Node] = {}

    def node(self, pn: Node, gn: Any) -> bool:
        if pn.op == "placeholder":
            if pn in self.bind:
                return self.bind[pn] is gn
            self.bind[pn] = gn
            return True
        if not isinstance(gn, Node) or is_instrumentation(gn):
            return False
        if pn in self.pairs:
            return self.pairs[pn] is gn
        if gn in self.pairs.values() or pn.op != gn.op:
            return False
        if pn.op == "call_module":
            pmod, gmod = get_module(self.pgm, pn), get_module(self.gm, gn)
            if pmod is None or gmod is None or not isinstance(gmod, type(pmod)):
                return False
        elif pn.op == "get_attr":
            return False
        elif pn.target != gn.target:
            return False
        if len(pn.args) != len(gn.args) or set(pn.kwargs) != set(gn.kwargs):
            return False
        self.pairs[pn] = gn
        return all(self.arg(a, b) for a, b in zip(pn.args, gn.args)) and \
            all(self.arg(pn.kwargs[k], gn.kwargs[k]) for k in pn.kwargs)

    def arg(self, pa: Any, ga: Any) -> bool:
        if isinstance(pa, Node):
            return self.node(pa, ga)
        if isinstance(pa, (tuple, list)):
            return isinstance(ga, (tuple, list)) and len(pa) == len(ga) and all(self.arg(a, b) for a, b in zip(pa, ga))
        try:
            return bool(pa == ga) and type(pa) is type(ga)
        except Exception:
            return False


def _blocked(nodes: list[Node], anchor: Node) -> str | None:
    inside = set(nodes)
    for n in nodes:
        if n is anchor:
            continue
        watchers = [u.name for u in n.users if is_instrumentation(u)]
        if watchers:
            return (f"{describe(n)} is watched by instrumentation ({', '.join(watchers)}); run transform passes "
                    "before observe passes.")
        outside = [u.name for u in n.users if u not in inside]
        if outside:
            users = ", ".join(u.name for u in n.users)
            return (f"{describe(n)} feeds {len(n.users)} users ({users}); rewriting needs it to feed only "
                    f"{anchor.name}, else {', '.join(outside)} would lose its value.")
    return None


def find_pattern(gm: GraphModule, pattern: Pattern, *, where: Where = None) -> list[Match]:
    """Every occurrence of ``pattern`` in ``gm`` whose nodes all satisfy ``where``, in graph order.

    Matches do not overlap (the first in graph order wins). Blocked matches are included, with
    ``blocked`` set to the reason; ``replace_pattern`` skips them.
    """
    pgm = _trace_pattern(pattern)
    pout = _pattern_output(pgm)
    placeholders = [n for n in pgm.graph.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    used: set[Node] = set()
    found: list[Match] = []
    for gn in gm.graph.nodes:
        m = _Matcher(pgm, gm)
        if not m.node(pout, gn):
            continue
        nodes = sorted(m.pairs.values(), key=order.__getitem__)
        if used.intersection(nodes) or not all(matches(where, n) for n in nodes):
            continue
        used.update(nodes)
        inputs = [m.bind.get(p) for p in placeholders]
        roles = {pn.name: g for pn, g in m.pairs.items()}
        found.append(Match(gm, gn, nodes, inputs, roles, _blocked(nodes, gn)))
    return found


def _inline(ctx: PassContext, gm: GraphModule, fn: Callable[..., Any], inputs: list[Any]) -> tuple[Node, list[Node]]:
    rgm = _trace_pattern(fn)
    env: dict[Node, Any] = {}
    added: list[Node] = []
    placeholders = [n for n in rgm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise UsageError(f"the replacement takes {len(placeholders)} inputs but the pattern binds {len(inputs)}; "
                         "give both the same parameters.")
    for p, value in zip(placeholders, inputs):
        env[p] = value
    result: Any = None
    for n in rgm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            result = torch.fx.node.map_arg(n.args[0], lambda a: env[a])
            continue
        if n.op == "get_attr":
            raise UsageError("a replacement function may not hold tensors (it uses "
                             f"'{n.target}'); pass a module as the replacement instead.")
        new = gm.graph.node_copy(n, lambda a: env[a])
        if n.op == "call_module":
            new.target = ctx.add_module(gm, str(n.target), copy.deepcopy(rgm.get_submodule(str(n.target))))
        env[n] = new
        added.append(new)
    if not isinstance(result, Node):
        raise UsageError("a replacement must return exactly one tensor computed from its inputs.")
    return result, added


def _record(ctx: PassContext, match: Match, node: Node, module: nn.Module | None) -> None:
    meta = node_meta(node)
    if module is not None:
        meta.module_type = type(module).__name__
    ctx.copy_meta(match.anchor, node)
    meta.replaced = match.describe()
    meta.rewritten_from = [n.name for n in match.nodes]


def replace_pattern(
    gm: GraphModule,
    pattern: Pattern,
    replacement: nn.Module | Callable[..., Any] | None = None,
    *,
    build: Callable[[Match], nn.Module | Callable[..., Any] | None] | None = None,
    ctx: PassContext | None = None,
    where: Where = None,
    matches: Sequence[Match] | None = None,
) -> list[Replacement]:
    """Replace every unblocked occurrence of ``pattern`` and return what was rewritten.

    ``matches``: the occurrences a pass already found with ``find_pattern`` (to read values or
    report blocked pairs first), so the graph is matched once; by default it is matched here.

    Give either ``replacement`` (a module — copied for each match — or a function, traced and
    inlined; it receives the pattern's inputs in order) or ``build(match)``, which returns the
    replacement for one match, or ``None`` to leave that match alone. New modules are registered
    with ``ctx.add_module``; metadata and provenance go through ``ctx.copy_meta``. The caller
    (normally a pass run by the ``PassManager``) reports the returned replacements in its
    ``PassResult``; the manager lints and recompiles. Without ``where``, a given ``ctx`` limits
    the matches to the running pass's ``where=`` option.
    """
    if (replacement is None) == (build is None):
        raise UsageError("replace_pattern needs exactly one of replacement= or build=.")
    if where is None and ctx is not None:
        where = getattr(ctx, "where", None)
    ctx = ctx if ctx is not None else PassContext()
    done: list[Replacement] = []
    moved: dict[Node, Node] = {}  # anchor of an earlier replacement -> the node that replaced it
    for match in find_pattern(gm, pattern, where=where) if matches is None else matches:
        if match.blocked or any(n in moved for n in match.nodes):
            continue
        # a chain (linear -> bn -> linear -> bn): this match may read an anchor replaced just before
        inputs = [moved.get(i, i) if isinstance(i, Node) else i for i in match.inputs]
        repl = build(match) if build is not None else replacement
        if repl is None:
            continue
        with gm.graph.inserting_before(match.anchor):
            if isinstance(repl, nn.Module) and not isinstance(repl, GraphModule):
                module = repl if build is not None else copy.deepcopy(repl)
                target = ctx.add_module(gm, f"{type(module).__name__.lower()}_{match.anchor.name}", module)
                out = gm.graph.call_module(target, tuple(inputs), {})
                added = [out]
                _record(ctx, match, out, module)
            else:
                out, added = _inline(ctx, gm, repl, inputs)
                for n in added:
                    _record(ctx, match, n, get_module(gm, n))
        match.anchor.replace_all_uses_with(out)
        follow_observations(match.anchor.name, out)  # an instrumented graph: the anchor's row follows
        moved[match.anchor] = out
        for n in reversed(match.nodes):
            gm.graph.erase_node(n)
        done.append(Replacement(match, out, added))
    return done


@contextlib.contextmanager
def keep_state(module: nn.Module) -> Iterator[None]:
    """Run code against ``module`` and restore its buffers (batch-norm statistics) and the RNG.

    For passes that run the model to measure something (importance, a numerical check) without
    leaving a trace on it.
    """
    with preserved_state(module):
        yield


class _Capture(Interpreter):
    def __init__(self, gm: GraphModule, wanted: set[str]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.wanted = wanted
        self.values: dict[str, Any] = {}

    def run_node(self, n: Node) -> Any:
        if is_instrumentation(n):
            return None
        value = super().run_node(n)
        if n.name in self.wanted:  # copied: a later in-place op (relu_, +=) may overwrite it
            self.values[n.name] = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, value)
        return value


def node_values(
    gm: GraphModule,
    ctx: PassContext,
    names: Sequence[str | Node],
    *,
    inputs: Any = None,
    grad: bool = False,
) -> dict[str, Any]:
    """Run ``gm`` once on ``inputs`` (default: the context's example inputs) and return the values
    of the nodes ``names`` (``"output"`` is the graph's result), skipping instrumentation.

    Without ``grad`` the run is under ``torch.no_grad()`` and buffers and the RNG are restored
    afterwards. With ``grad=True`` autograd records the run; wrap the run and the backward in
    ``keep_state(gm)`` yourself, since batch-norm may need its buffers for the backward.
    """
    bound = normalize_inputs(inputs) if inputs is not None else ctx.inputs
    if bound is None:
        raise MissingInputsError(f"pass '{ctx.current_pass or '?'}' needs example inputs to run the model: "
                         "call instrument(model, passes, example_inputs=(x,)).")
    wanted = {n.name if isinstance(n, Node) else str(n) for n in names}
    runner = _Capture(gm, wanted)
    values = bind_inputs(gm, *bound)
    if grad:
        result = runner.run(*values)
    else:
        with preserved_state(gm), torch.no_grad():
            result = runner.run(*values)
    if "output" in wanted:
        runner.values["output"] = result
    return runner.values
