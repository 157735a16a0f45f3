"""The pass protocol: ``Pass``, the ``graph_pass`` / ``node_pass`` decorators, ``PassResult``,
``PassManager``.

A pass is one small class (or one decorated function) over a ``GraphModule``. It says its name,
and reports what it changed as node names (``added``, ``removed``, ``replaced``) — the manager
turns that into provenance in ``node.meta["fxdebug"]``, into counters, and into highlights in the
picture. Linting, recompiling, timing and error wrapping live in the manager, never in the pass.
"""

from __future__ import annotations

import gc
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from torch.fx import GraphModule, Node

from fxdebug.authoring.context import PassContext
from fxdebug.authoring.options import Options
from fxdebug.errors import FxDebugError, PassError
from fxdebug.graph.meta import describe, is_instrumentation, node_meta
from fxdebug.graph.select import Where

__all__ = ["Pass", "PassManager", "PassResult", "graph_pass", "node_pass"]


def _names(nodes: Iterable[Node | str | None]) -> list[str]:
    return [n.name if isinstance(n, Node) else str(n) for n in nodes if n is not None]


@dataclass
class PassResult:
    """What one pass did. Nodes may be given as ``Node`` objects or names; names are kept."""

    gm: GraphModule
    added: list[Any] = field(default_factory=list)
    removed: list[Any] = field(default_factory=list)
    replaced: dict[Any, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    pass_name: str = ""
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.added = _names(self.added)
        self.removed = _names(self.removed)
        self.replaced = {(k.name if isinstance(k, Node) else str(k)): (v.name if isinstance(v, Node) else str(v))
                         for k, v in self.replaced.items()}

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed or self.replaced)

    def __str__(self) -> str:
        parts = [f"{len(self.added)} added", f"{len(self.removed)} removed", f"{len(self.replaced)} replaced"]
        return f"{self.pass_name}: {', '.join(parts)} ({self.seconds * 1e3:.1f} ms)"


def _kebab(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()


class Pass:
    """Base class of every pass. Subclasses set ``name`` and implement ``run(gm, ctx)``.

    Attributes:
        name: shown in errors, provenance and the picture (defaults to the class name, kebab-case).
        observe_only: True for passes that only watch; the model's outputs stay bitwise equal.
        requires: what the pass needs from the context, checked before it runs: ``"shapes"`` or
            ``"example_inputs"`` (a ``MissingInputsError`` naming the pass if none were given),
            ``"prior_report"``; see ``fxdebug.authoring.context.KNOWN_REQUIREMENTS``.
        where: the nodes the pass may touch (glob(s) over module paths / node names, or a predicate).
        shares_instances: True for a pass whose work on one instance of a repeated block is the same, renamed, on
            every other: it reads the graph (nodes, metadata, shapes), never which module path it is on, and keeps
            what it derives from a node's identity as that identity (the node, its name, its module path; prose is
            built when shown). Under regional capture the instrumented graph of a block's first instance is then
            copied to the others with their names (``instrumented/live_copies.py``) instead of running the passes
            on each; a ``where=`` selection makes every pass run per instance again.
    """

    name: str = ""
    observe_only: bool = False
    requires: tuple[str, ...] = ()
    shares_instances: bool = False

    def __init__(self, *, where: Where = None) -> None:
        self.where = Options(self).where(where)  # one rule for every pass's options (authoring.options)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = _kebab(cls.__name__)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult | None:
        """What the pass does to ``gm``; every pass defines it (``validate_passes`` refuses one that does not)."""
        raise PassError(_NO_RUN.format(cls=type(self).__name__), pass_name=self.name)

    def on_instance_copy(self, source: GraphModule, copy: GraphModule, renamed: dict[str, str]) -> None:
        """``copy`` was made from ``source`` for another instance of a block (``shares_instances``): a pass that
        keeps state of its own about the graphs it ran on (expectations by node name) records the copy's here;
        ``renamed`` maps each of ``source``'s identities (node names, module and parameter paths) to the copy's."""

    def check_capture(self, parts: Mapping[str, GraphModule]) -> None:
        """Called once the graphs a live capture took at ``instrument()`` have all run the pass (they arrive one at
        a time: ``PassContext.partial``). A pass that asks for nodes by name raises its ``UsageError`` here for a
        request no graph matched; ``parts`` are the capture's graphs (``Instrumented.parts()``)."""

    def rewrite(self, gm: GraphModule, ctx: PassContext, rule: Callable[[Node, PassContext], Node | None], *,
                predicate: Callable[[Node], bool] | None = None) -> dict[str, str]:
        """Apply the local rewrite ``rule(node, ctx)`` once to each node the pass selects (and
        ``predicate`` accepts): it returns the replacement node, or ``None`` for "no match".
        Returns ``{old name: new name}`` for ``PassResult(replaced=...)``."""
        replaced: dict[str, str] = {}
        for node in ctx.nodes(gm, self.where, predicate=predicate):
            if node.graph is not gm.graph or getattr(node, "_erased", False):
                continue  # an earlier rewrite took it away
            new = rule(node, ctx)
            if new is not None and new is not node:
                replaced[node.name] = new.name if isinstance(new, Node) else str(new)
        return replaced

    def __repr__(self) -> str:
        opts = {k: v for k, v in vars(self).items() if not k.startswith("_") and v is not None}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in opts.items())})"


class _FunctionPass(Pass):
    def __init__(self, fn: Callable[..., Any], name: str, observe_only: bool, requires: tuple[str, ...],
                 per_node: bool, where: Where = None) -> None:
        self.name = name  # before the options are read: their messages name the pass
        super().__init__(where=where)
        self._fn = fn
        self.observe_only = observe_only
        self.requires = requires
        self._per_node = per_node
        self.__doc__ = fn.__doc__

    def __call__(self, *, where: Where = None) -> "_FunctionPass":
        """``my_pass(where="layer1.*")`` returns the same pass limited to those nodes."""
        return _FunctionPass(self._fn, self.name, self.observe_only, self.requires, self._per_node, where)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult | None:
        if not self._per_node:
            result: PassResult | None = self._fn(gm, ctx)
            return result
        return PassResult(gm, replaced=self.rewrite(gm, ctx, self._fn))

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


def graph_pass(name: str | None = None, *, observe_only: bool = False, requires: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Pass]:
    """Make ``fn(gm, ctx) -> PassResult | None`` a pass. Call the result with ``where=`` to limit it."""

    def wrap(fn: Callable[..., Any]) -> Pass:
        return _FunctionPass(fn, name or fn.__name__.replace("_", "-"), observe_only, tuple(requires), False)

    return wrap


def node_pass(name: str | None = None, *, requires: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Pass]:
    """Make a local rewrite ``fn(node, ctx) -> Node | None`` a pass.

    The function sees every selected node once; it returns the replacement node, or ``None``
    for "no match". The manager records the replacements.
    """

    def wrap(fn: Callable[..., Any]) -> Pass:
        return _FunctionPass(fn, name or fn.__name__.replace("_", "-"), False, tuple(requires), True)

    return wrap


class PassManager:
    """Runs passes in order; after each one lints, checks and recompiles the graph.

    A pass that raises, returns something odd, or leaves an invalid graph or a dangling node
    becomes a ``PassError`` naming the pass and the offending node. Provenance is recorded on the
    nodes each pass added or replaced (``added_by`` / ``changed_by``).
    """

    def __init__(self, passes: Sequence[Pass]) -> None:
        self.passes = list(validate_passes(passes))
        self.results: list[PassResult] = []
        self._stale = False  # the graph changed since the module's code was last generated
        self._unlinted: list[str] = []  # watching passes whose graph is linted once, after them

    def run(self, gm: GraphModule, ctx: PassContext) -> GraphModule:
        # The code is generated once at the end, not after every pass (a recompile costs ~0.1 ms
        # per node); a transform pass, which may call the module, and instruments watching each
        # pass still see it compiled.
        self._stale = False
        # Passes allocate a few objects per node (nodes, observers, metadata) and free almost
        # nothing: the cyclic collector's full sweeps over a big graph's objects were ~30% of
        # instrument() at 10k nodes. Reference counting still frees as usual; the collector runs
        # again (as it was) when the passes are done.
        collecting = gc.isenabled()
        gc.disable()
        try:
            for p in self.passes:
                if self._stale and not p.observe_only:
                    self._lint_unlinted(gm)
                    gm.recompile()
                    self._stale = False
                gm = self._run_one(p, gm, ctx)
            self._lint_unlinted(gm)
            if self._stale:
                gm.recompile()
                self._stale = False
        finally:
            if collecting:
                gc.enable()
        return gm

    def _run_one(self, p: Pass, gm: GraphModule, ctx: PassContext) -> GraphModule:
        before = dict.fromkeys(gm.graph.nodes)  # in graph order; one copy (on a big graph copies count toward the peak)
        unused_before = {n.name for n in gm.graph.nodes if not n.users}  # the model's own dead values
        ctx.check_requires(p.name, p.requires)
        for inst in ctx.instruments:
            getattr(inst, "before_pass", lambda *_: None)(p, gm)
        start = time.perf_counter()
        try:
            with ctx.running(p.name, p.where):
                result = p.run(gm, ctx)
        except FxDebugError as exc:
            if exc.pass_name is None:
                exc.pass_name = p.name
            raise
        except Exception as exc:
            raise PassError(
                f"pass '{p.name}' raised {type(exc).__name__}: {exc}. The graph was left as it was before "
                "the pass where possible; fix the pass or exclude the node with where=.",
                pass_name=p.name,
            ) from exc
        if result is None:
            result = PassResult(gm)
        if not isinstance(result, PassResult):
            raise PassError(f"pass '{p.name}' returned {type(result).__name__}; a pass returns a PassResult or None.",
                            pass_name=p.name)
        gm = result.gm
        result.pass_name, result.seconds = p.name, time.perf_counter() - start
        graph = gm.graph
        added = [n for n in graph.nodes if n not in before]
        removed = [n.name for n in before if n._erased or n.graph is not graph]
        del before
        only_watching = (p.observe_only and not removed and not result.removed and not result.replaced
                         and all(is_instrumentation(n) for n in added))
        if only_watching and not ctx.instruments:
            # The pass only added instrumentation: check those nodes here and lint the whole graph
            # once when the passes are done (a full lint per pass was ~8 µs per node each time).
            self._check_added(p, gm, added)
            self._unlinted.append(p.name)
        else:
            dead_replacements = {new for old, new in result.replaced.items() if old in unused_before}
            self._check(p, gm, [n for n in added if n.name not in dead_replacements])
            self._unlinted.clear()  # the whole graph was linted: earlier passes' additions too
        for n in added:
            meta = n.meta.get("fxdebug")
            if meta is None or meta.get("added_by") is None:
                node_meta(n).added_by = p.name
        if not result.added:
            result.added = [n.name for n in added if not is_instrumentation(n)] or [n.name for n in added]
        if result.replaced:
            by_name = {n.name: n for n in graph.nodes}
            for new_name in result.replaced.values():
                node = by_name.get(new_name)
                if node is not None:
                    node_meta(node).add_changed_by(p.name)
        if not result.removed:
            result.removed = removed
        if ctx.instruments:
            gm.recompile()
        else:
            self._stale = True
        if (added or removed or result.changed) and not only_watching:
            ctx.invalidate()  # (an observe-only pass that only added instrumentation keeps the model's shapes)
        self.results.append(result)
        for inst in ctx.instruments:
            getattr(inst, "after_pass", lambda *_: None)(p, gm, result)
        return gm

    @staticmethod
    def _check_added(p: Pass, gm: GraphModule, added: list[Node]) -> None:
        """What ``Graph.lint`` would check of the nodes a watching pass added: each reads only
        nodes of this graph defined before it. An observer sits right after what it reads (or
        after the clock, for an input), so a short walk back finds it; a farther one is found
        through a table of positions made once."""
        graph = gm.graph
        position: dict[Node, int] | None = None
        for n in added:
            for arg in n.all_input_nodes:
                if not arg._erased and arg.graph is graph:
                    prev, steps = n._prev, 0
                    while prev is not arg and steps < 64 and prev.op != "root":
                        prev, steps = prev._prev, steps + 1
                    if prev is arg:
                        continue
                    if position is None:
                        position = {node: i for i, node in enumerate(graph.nodes)}
                    if position.get(arg, len(position)) < position.get(n, -1):
                        continue
                raise PassError(f"pass '{p.name}' left an invalid graph: node '{n.name}' reads '{arg.name}', "
                                "which is not defined before it in this graph.", pass_name=p.name, node=n.name)

    def _lint_unlinted(self, gm: GraphModule) -> None:
        """The one full lint owed by the watching passes that ran since the last one."""
        if not self._unlinted:
            return
        names = ", ".join(f"'{n}'" for n in self._unlinted)
        last = self._unlinted[-1]
        self._unlinted.clear()
        try:
            gm.graph.lint()
        except Exception as exc:
            match = re.search(r"[Nn]ode[^']*'?([A-Za-z_][\w]*)", str(exc))
            raise PassError(f"pass {names} left an invalid graph: {exc}", pass_name=last,
                            node=match.group(1) if match else None) from exc

    @staticmethod
    def _check(p: Pass, gm: GraphModule, added: list[Node]) -> None:
        try:
            gm.graph.lint()
        except Exception as exc:
            match = re.search(r"[Nn]ode[^']*'?([A-Za-z_][\w]*)", str(exc))
            raise PassError(f"pass '{p.name}' left an invalid graph: {exc}", pass_name=p.name,
                            node=match.group(1) if match else None) from exc
        for n in added:
            if not n.users and n.op not in ("output", "placeholder") and not is_instrumentation(n) \
                    and not node_meta(n).keep_unused and not n.is_impure():
                raise PassError(
                    f"pass '{p.name}' added {describe(n)} but nothing uses it: rewire its users "
                    "(ctx.insert_after(..., rewire=True)), erase it, or mark it with "
                    "node.meta['fxdebug']['keep_unused'] = True.",
                    pass_name=p.name, node=n.name,
                )


def validate_passes(passes: Any) -> list[Pass]:
    """Check a user's pass list, with a plain sentence for each way it can be wrong."""
    if isinstance(passes, Pass):
        return [passes]
    if passes is None:
        return []
    try:
        items = list(passes)
    except TypeError:
        raise PassError(f"passes must be a list of fxdebug passes, got {type(passes).__name__}.") from None
    for i, p in enumerate(items):
        if isinstance(p, type) and issubclass(p, Pass):
            raise PassError(f"passes[{i}] is the class {p.__name__}, not an instance: write {p.__name__}().",
                            pass_name=getattr(p, "name", None))
        if not isinstance(p, Pass):
            raise PassError(
                f"passes[{i}] is {type(p).__name__} ({p!r:.60}), not a pass: use an fxdebug.passes instance, "
                "a Pass subclass instance, or a function decorated with @fxdebug.graph_pass.")
        if type(p).run is Pass.run:  # refused before any capture, not at the first graph
            raise PassError(f"passes[{i}]: " + _NO_RUN.format(cls=type(p).__name__), pass_name=p.name)
    return items


_NO_RUN = ("{cls} subclasses Pass but defines no run(self, gm, ctx): add it (it edits gm through ctx and may return "
           "a PassResult), or write the pass as a function decorated with @fxdebug.graph_pass or @fxdebug.node_pass.")
