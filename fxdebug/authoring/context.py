"""``PassContext``: everything a pass may know or do besides the graph itself.

It is a thin front over four single-purpose modules, so a pass needs one object:

* example inputs and the shape run — ``inputs.py`` (normalise, bind, clone, preserve state) and
  ``shapes.py`` (``TensorSpec``, one cached run per graph, invalidated by the manager whenever a
  pass changed the graph);
* selection — ``nodes()``, limited by the running pass's ``where=`` (``select.py``);
* graph edits with provenance — ``insert_after``, ``insert_before``, ``replace_with_module``,
  ``replace``, ``add_module``, ``copy_meta``, ``record`` (``graph/edits.py``, ``NodeMeta``);
* observation — ``observe()`` attaches a probe, ``clock()`` (``observation.py``).

The running pass reaches the context one way: the manager enters ``running(name, where)`` around
``Pass.run`` after checking the pass's ``requires`` (``check_requires``). Its ``where`` limits
every ``nodes()`` call; an explicit ``where`` given to ``nodes()`` narrows it further.

Running the example inputs never changes the model: buffers (batch-norm running statistics) and
the RNG state are restored afterwards, inputs are cloned, and instrumentation nodes are skipped.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

from torch import nn
from torch.fx import GraphModule, Node

from fxdebug.graph import edits
from fxdebug.graph.edits import NAMESPACE
from fxdebug.errors import MissingInputsError, UsageError
from fxdebug.graph.inputs import bind_inputs, normalize_inputs, preserved_state
from fxdebug.graph.meta import is_instrumentation, node_meta
from fxdebug.runtime.attach import Observation
from fxdebug.runtime.observer import Clock, Probe
from fxdebug.graph.select import Where, matches
from fxdebug.graph.shapes import TensorSpec, learn_specs, spec_of

__all__ = ["KNOWN_REQUIREMENTS", "NAMESPACE", "PassContext", "TensorSpec", "bind_inputs", "preserved_state", "spec_of"]

KNOWN_REQUIREMENTS = {
    "shapes": "example inputs, to learn every node's shape, dtype and device",
    "example_inputs": "example inputs, to run the model",
    "prior_report": "a report from an earlier run (instrument an instrumented model, or pass prior_report=)",
}

_UNSET: Any = object()


class PassContext:
    """What a pass knows besides the graph: example inputs, node specs, selection, edits.

    Args:
        example_inputs: a tensor, a tuple of positional inputs, a dict of keyword inputs, or
            ``fxdebug.Inputs``.
        prior_report: statistics from an earlier run (``Report``), for passes such as
            ``SwapActivation(only_dead=...)`` that act on what was observed.
        instruments: objects with optional ``before_pass(pass_, gm)`` / ``after_pass(pass_, gm,
            result)`` methods — the place for dumping, timing and printing, not pass bodies.
        partial: the graph is one of several a capture hands over one at a time (a live capture: one per
            frame, graph break and block region), so a request by name that matches nothing in it may match in
            another; such a pass says so once every graph ran it (``Pass.check_capture``), not per graph.
    """

    def __init__(
        self,
        example_inputs: Any = None,
        *,
        prior_report: Any = None,
        instruments: Iterable[Any] = (),
        partial: bool = False,
    ) -> None:
        self.example_inputs = example_inputs
        self.partial = partial
        self.inputs = normalize_inputs(example_inputs)
        self.prior_report = prior_report
        self.instruments = list(instruments)
        self._pass_name: str | None = None
        self._where: Where = None
        self._specs: dict[str, Any] | None = None
        self._spec_graph: int | None = None
        self._observation = Observation()

    # -- the running pass -------------------------------------------------------------------------
    @property
    def current_pass(self) -> str | None:
        """Name of the pass now running (``None`` outside a pass)."""
        return self._pass_name

    @property
    def where(self) -> Where:
        """The running pass's ``where=``: every ``nodes()`` call is limited by it."""
        return self._where

    @contextlib.contextmanager
    def running(self, pass_name: str, where: Where = None) -> Iterator["PassContext"]:
        """Scope the context to one pass (the manager does this around ``Pass.run``)."""
        saved = self._pass_name, self._where
        self._pass_name, self._where = pass_name, where
        try:
            yield self
        finally:
            self._pass_name, self._where = saved

    def check_requires(self, pass_name: str, requires: Iterable[str]) -> None:
        """Raise before a pass runs if the context lacks what it ``requires``."""
        for need in requires:
            if need not in KNOWN_REQUIREMENTS:
                raise UsageError(f"pass '{pass_name}' requires {need!r}, which fxdebug does not provide; "
                                 f"requirements are {', '.join(sorted(KNOWN_REQUIREMENTS))}.", pass_name=pass_name)
            missing = self.prior_report is None if need == "prior_report" else self.inputs is None
            if missing:
                if need == "prior_report":
                    raise UsageError(f"pass '{pass_name}' requires {KNOWN_REQUIREMENTS[need]}.", pass_name=pass_name)
                raise MissingInputsError(
                    f"pass '{pass_name}' requires {KNOWN_REQUIREMENTS[need]}, and none were given: "
                    "call instrument(model, passes, example_inputs=(x,)).", pass_name=pass_name)

    # -- shapes ---------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget cached specs; the manager calls this whenever a pass changed the graph."""
        self._specs = None

    def specs(self, gm: GraphModule) -> dict[str, Any]:
        """``{node name: spec}`` for every node, from one run on the example inputs (cached)."""
        if self.inputs is None:
            raise MissingInputsError(
                f"pass '{self.current_pass or '?'}' needs shapes, so example_inputs are required: "
                "call instrument(model, passes, example_inputs=(x,)).",
                pass_name=self.current_pass,
            )
        if self._specs is None or self._spec_graph != id(gm.graph):
            self._specs, self._spec_graph = learn_specs(gm, self.inputs), id(gm.graph)
        return self._specs

    def spec(self, node: Node) -> Any:
        gm = node.graph.owning_module
        assert isinstance(gm, GraphModule), "node must belong to a GraphModule"
        return self.specs(gm).get(node.name)

    def tensor_spec(self, node: Node) -> TensorSpec | None:
        spec = self.spec(node)
        return spec if isinstance(spec, TensorSpec) else None

    # -- selection ------------------------------------------------------------------------------
    def nodes(
        self,
        gm: GraphModule,
        where: Where | str = _UNSET,
        *,
        ops: tuple[str, ...] = ("call_module", "call_function", "call_method"),
        float_outputs: bool = False,
        tensor_outputs: bool = False,
        predicate: Callable[[Node], bool] | None = None,
    ) -> list[Node]:
        """The graph's own (non-instrumentation) nodes selected by the running pass's ``where=``.

        ``where``, if given, narrows the selection further (it never widens the pass's own);
        ``ops``, ``float_outputs`` / ``tensor_outputs`` (needs shapes) and ``predicate`` filter it.
        """
        narrower = None if where is _UNSET or where is self._where else where
        own = self._where
        specs = self.specs(gm) if (float_outputs or tensor_outputs) else None  # one lookup, not one per node
        picked = []
        for node in list(gm.graph.nodes):
            if node.op not in ops or is_instrumentation(node) or (own is not None and not matches(own, node)):
                continue
            if narrower is not None and not matches(narrower, node):
                continue
            if predicate is not None and not predicate(node):
                continue
            if specs is not None:
                spec = specs.get(node.name)
                if not isinstance(spec, TensorSpec) or (float_outputs and not spec.dtype.is_floating_point):
                    continue
            picked.append(node)
        return picked

    # -- edits (provenance: the running pass) ---------------------------------------------------
    def add_module(self, gm: GraphModule, hint: str, module: nn.Module) -> str:
        """Register ``module`` on the instrumented module (never inside the user's model).

        Returns the dotted target for a ``call_module`` node: ``fxdebug.<hint>`` made unique.
        """
        return edits.add_module(gm, hint, module)

    def insert_after(
        self,
        node: Node,
        target: edits.Target,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        *,
        rewire: bool = False,
        hint: str | None = None,
        after: Node | None = None,
    ) -> Node:
        """Insert ``target(node, *args)`` right after ``node`` (or after ``after``).

        ``target`` is a function (``call_function``) or a module (registered with
        ``add_module``, then ``call_module``). With ``rewire=True`` every user of ``node`` is
        redirected to the new node, so the call can replace the value it sees.
        """
        return edits.insert_after(node, target, args, kwargs, rewire=rewire, hint=hint, after=after,
                                  pass_name=self.current_pass)

    def insert_before(
        self,
        node: Node,
        target: edits.Target | str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        hint: str | None = None,
    ) -> Node:
        """Insert ``target(*args)`` right before ``node`` — a check on its inputs, say.

        ``target`` is a function, a module, or an attribute path of the graph module (a
        ``get_attr`` node, e.g. the module ``node`` calls, to check its parameters).
        """
        return edits.insert_before(node, target, args, kwargs, hint=hint, pass_name=self.current_pass)

    def replace_with_module(self, node: Node, module: nn.Module, args: tuple[Any, ...] | None = None) -> Node:
        """Replace ``node`` by a call of ``module`` on ``args`` (default: the node's first input).

        Users are rewired, metadata (module path, source line) carried over, the node erased.
        """
        return edits.replace_with_module(node, module, args, pass_name=self.current_pass)

    def replace(self, node: Node, new: Node) -> Node:
        """Put ``new`` (already inserted) in ``node``'s place: users rewired, metadata carried over
        (``replaced`` names the old node), ``node`` erased once nothing reads it."""
        return edits.replace(node, new, pass_name=self.current_pass)

    def copy_meta(self, old: Node, new: Node) -> None:
        """Carry fxdebug's metadata from ``old`` to ``new``, marking the change."""
        edits.copy_meta(old, new, self.current_pass)

    def record(self, node: Node, info: dict[str, Any] | None = None, *, stands_for: str | None = None) -> None:
        """Keep what the running pass did to ``node``: ``info`` under ``node_meta(node).transforms[<pass>]``,
        and for a module fxdebug made, the model's module path it ``stands_for`` (``to_module`` names
        it so; a fused conv stands for ``layer1.0.conv1``)."""
        meta = node_meta(node)
        meta.record(self.current_pass or "?", info or {})
        if stands_for is not None:
            meta.stands_for = stands_for

    # -- observation ----------------------------------------------------------------------------
    def observe(self, node: Node, probe: Probe) -> Node | None:
        """Attach ``probe`` to ``node``'s observer, creating the observer node if needed.

        Returns the observer node when something was added, ``None`` if the node already held a
        probe with the same key (passes and instrumentation compose instead of doubling up).
        """
        return self._observation.attach(node, probe, self.current_pass)

    def unobserve(self, node: Node) -> list[str]:
        """Take fxdebug's own observation off ``node`` so that a transform can replace it (fusing an
        already instrumented conv + batch-norm): every observer watching ``node`` — a module call,
        a lowered op call, a member of a batched call, a gradient tap — is erased, and observers of
        other nodes stop reading it as an input. Nodes of other roles (guards, shadows) change what
        the model computes and stay. Returns the observers' node names that were erased."""
        return self._observation.detach(node)

    def clock(self, gm: GraphModule) -> Clock:
        """The graph's forward-call clock, inserted once at the start of the graph."""
        return self._observation.clock(gm, self.current_pass)

    def clock_node(self, gm: GraphModule) -> Node:
        """The clock's node: right after the placeholders, before anything that observes them."""
        return self._observation.clock_node(gm, self.current_pass)
