"""``Capture``: keep the activation (and gradient) of chosen nodes from the last call.

The graph-level form of the forward-hook + backward-hook pair every Grad-CAM tutorial writes::

    cap = Capture(["layer2"], grads=True)
    dbg = fxdebug.instrument(model, [cap], example_inputs=(x,))
    dbg(x)[0, cls].backward()
    a, g = cap["layer2"], cap.grad("layer2")

A name selects a node by its name, or a module by its path — then the module's *output*: the
last node inside it, in graph order (for a leaf module, its call). Globs select every matching
node. Captured tensors are detached references (no copy), unless an in-place op later writes
into the node's output; then they are cloned so they keep what the node produced.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping, Sequence

from torch import Tensor
from torch.fx import GraphModule, Node

from fxdebug import UsageError
from fxdebug.authoring import (
    ObservationContext, Observer, Options, Pass, PassContext, PassResult, Probe, Reductions, Where, is_inplace,
    is_instrumentation, module_path, node_meta,
)

__all__ = ["Capture"]


class CaptureProbe(Probe):
    """Keeps the last value seen (forward) and, with ``grads``, the last gradient."""

    key = "capture"

    def __init__(self, *, grads: bool, clone: bool) -> None:
        self.grads = grads
        self.clone = clone

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        state["value"] = r.x.clone() if self.clone and ctx.phase == "forward" else r.x

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        value = state.get("value")
        return {"captured": tuple(value.shape)} if isinstance(value, Tensor) else {}


class Capture(Pass):
    """Keep the last activation (and with ``grads=True`` gradient) of the chosen nodes.

    Args:
        nodes: node names, module paths (their output node) or globs over node names; ``None``
            keeps every tensor-valued node ``where=`` selects.
        grads: also keep the gradient w.r.t. each chosen node's output.
        where: as for every pass: ``nodes`` are looked up only among the nodes it selects.
        clone: ``None`` clones only where an in-place op follows the node; True / False force it.
    """

    name = "capture"
    observe_only = True
    requires = ("shapes",)

    def __init__(self, nodes: str | Sequence[str] | None = None, grads: bool = False, *, where: Where = None,
                 clone: bool | None = None) -> None:
        super().__init__(where=where)
        if nodes is None and where is None:
            raise UsageError("Capture needs the nodes to keep: Capture(['layer4']) (names, module paths or globs), "
                             "or Capture(where='layer4.*') for every node that where= selects.")
        opts = Options(self)
        if nodes is not None and not isinstance(nodes, str):
            opts.iterable("nodes", nodes, str, what="node names, module paths or globs", example="['layer4', 'fc']")
        self.nodes = ["*"] if nodes is None else [nodes] if isinstance(nodes, str) else list(nodes)
        self.grads = opts.flag("grads", grads)
        self.clone = None if clone is None else opts.flag("clone", clone)
        self._observers: dict[str, tuple[str, Observer]] = {}
        self._graphs: dict[str, Any] = {}  # the graph each was found in (a live capture: one of several)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        own = ctx.nodes(gm, tensor_outputs=True, ops=_OPS)
        added: list[Node | None] = []
        if not ctx.partial:
            self._observers, self._graphs = {}, {}
        for request in self.nodes:
            hits = _select(own, request)
            if not hits:
                if ctx.partial:
                    continue  # one of a live capture's graphs: the request may be in another (check_capture)
                known = ", ".join(n.name for n in own[:12])
                raise UsageError(f"Capture: {request!r} matches no tensor-valued node or module; nodes include {known}.")
            for node in hits:
                clone = self.clone if self.clone is not None else _written_later(gm, node)
                added.append(ctx.observe(node, CaptureProbe(grads=self.grads, clone=clone)))
                key = node.name if any(c in request for c in "*?[") else request
                self._observers[key] = (node.name, _observer_of(gm, node))
                self._graphs[key] = gm.graph
        return PassResult(gm, added=added)

    def check_capture(self, parts: Mapping[str, GraphModule]) -> None:
        """Every request matched a node of some graph of the live capture; what the others held is forgotten."""
        graphs = {id(part.graph) for part in parts.values()}
        held = {name: found for name, found in self._observers.items() if id(self._graphs.get(name)) in graphs}
        self._observers = held  # (a capture taken again: the graphs it replaced are gone)
        self._graphs = {k: v for k, v in self._graphs.items() if k in held}
        missing = [r for r in self.nodes if r != "*" and not any(_matches(r, key) for key in held)]
        if missing:
            names = [n.name for part in parts.values() for n in part.graph.nodes
                     if n.op in _OPS and not is_instrumentation(n)]
            raise UsageError(f"Capture: {missing[0]!r} matches no tensor-valued node or module in any of the capture's "
                             f"{len(parts)} graph(s); nodes include {', '.join(names[:12])}.")

    # -- reading --------------------------------------------------------------------------------
    def _get(self, name: str, phase: str) -> Tensor | None:
        if name not in self._observers:
            raise KeyError(f"Capture holds no node {name!r}; it holds {sorted(self._observers)}.")
        _, observer = self._observers[name]
        return observer.states.get(("capture", phase), {}).get("value")

    def __getitem__(self, name: str) -> Tensor | None:
        """The last activation of ``name`` (``None`` before the first call)."""
        return self._get(name, "forward")

    def grad(self, name: str) -> Tensor | None:
        """The last gradient w.r.t. ``name``'s output (needs ``grads=True`` and a backward)."""
        if not self.grads:
            raise UsageError(f"Capture.grad({name!r}): this Capture records activations only; build it with "
                             "Capture([...], grads=True) to keep gradients, then run a backward.")
        return self._get(name, "grad")

    @property
    def activations(self) -> dict[str, Tensor | None]:
        return {k: self[k] for k in self._observers}

    @property
    def gradients(self) -> dict[str, Tensor | None]:
        if not self.grads:
            raise UsageError("Capture.gradients: this Capture records activations only; build it with "
                             "Capture([...], grads=True) to keep gradients, then run a backward.")
        return {k: self.grad(k) for k in self._observers}


_OPS = ("placeholder", "call_module", "call_function", "call_method")


def _matches(request: str, key: str) -> bool:
    """Whether the observer kept under ``key`` (the request itself, or a node name for a glob) answers ``request``."""
    return key == request or (any(c in request for c in "*?[") and fnmatch.fnmatchcase(key, request))


def _select(nodes: list[Node], request: str) -> list[Node]:
    exact = [n for n in nodes if n.name == request]
    if exact:
        return exact
    inside = [n for n in nodes if n.op != "placeholder" and
              (module_path(n) == request or module_path(n).startswith(request + "."))]
    if inside:
        return inside[-1:]
    return [n for n in nodes if fnmatch.fnmatchcase(n.name, request)]


def _written_later(gm: GraphModule, node: Node) -> bool:
    """True if an in-place op after ``node`` writes into the tensor ``node`` produced.

    In-place ops return (and FX keeps reading) their first input, so ``h.relu_()`` followed by
    ``fc2(h)`` mutates ``h`` behind the graph's back: follow such chains to the tensor's origin.
    """
    root: dict[Node, Node] = {}
    for n in gm.graph.nodes:
        first = n.args[0] if n.args and isinstance(n.args[0], Node) else None
        root[n] = root.get(first, first) if first is not None and is_inplace(n, gm) else n
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mine = root[node]
    return any(is_inplace(m, gm) and root[m] is mine and order[m] > order[node] for m in gm.graph.nodes)


def _observer_of(gm: GraphModule, node: Node) -> Observer:
    for user in node.users:
        if node_meta(user).observes == node.name and user.op == "call_module":
            module = gm.get_submodule(str(user.target))
            if isinstance(module, Observer):
                return module
    raise UsageError(f"Capture: no observer found on node '{node.name}'.")  # pragma: no cover - ctx.observe made one
