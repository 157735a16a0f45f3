"""Attaching probes: one observer node per watched node, and the graph's forward-call clock.

``attach(node, probe)`` finds or creates the ``Observer`` that watches ``node`` (one per node,
shared by every probe, so passes compose instead of doubling the reads) and adds the probe to it.
The clock is inserted once per graph, after the placeholders, so every observation in a call
sees that call's tick. The observers themselves (what a probe computes, on which device, without
host syncs) live in ``observe.py``.
"""

from __future__ import annotations

import re

from torch import nn
from torch.fx import GraphModule, Node

from fxdebug.graph.edits import NAMESPACE, add_module
from fxdebug.graph.meta import CLOCK, INSTRUMENTATION, KEY, is_instrumentation, module_path, node_meta, op_label
from fxdebug.runtime.observer import Clock, Observer, Probe
from fxdebug.runtime.lower import find_lowered, unlower

__all__ = ["Observation"]

_NONE: dict[str, object] = {}
_PLAIN = re.compile(r"\w+", re.ASCII)  # a name add_module keeps as it is


class Observation:
    """Per-run helper that attaches probes; caches each graph's clock node."""

    def __init__(self) -> None:
        self._clock_nodes: dict[int, Node] = {}
        self._clocks: dict[int, tuple[Node, Clock]] = {}

    def attach(self, node: Node, probe: Probe, pass_name: str | None = None) -> Node | None:
        """Attach ``probe`` to ``node``'s observer, creating the observer node if needed.

        Returns the observer node when something was added, ``None`` if the node already held a
        probe with the same key (passes and instrumentation compose instead of doubling up).
        """
        gm = node.graph.owning_module
        assert isinstance(gm, GraphModule), "node must belong to a GraphModule"
        # the cheap test first: building a node's typed meta costs more than comparing its op
        # (the raw dict read, not the typed NodeMeta view: this runs once per probe per node)
        name = node.name
        obs_node = next((u for u in node.users
                         if u.op == "call_module" and u.meta.get(KEY, _NONE).get("observes") == name), None)
        lowered = find_lowered(node) if obs_node is None else None
        if obs_node is None and lowered is not None:
            obs_node = unlower(gm, lowered)  # already lowered (re-instrumenting): back to its observer
        if obs_node is None:
            clock_node, clock = self._clock_pair(gm, pass_name)
            observer = Observer(name, module_path(node), op_label(node), clock)
            # An input's observer runs after the clock, so every observation sees this call's tick.
            obs_node = _observer_node(gm, node, observer, clock_node if node.op == "placeholder" else node, pass_name)
        else:
            observer = _observer_at(gm, str(obs_node.target))
        if not observer.add_probe(probe):
            return None
        if probe.wants_inputs and len(obs_node.args) == 1:
            tensor_inputs = [a for a in node.all_input_nodes if not is_instrumentation(a)]
            obs_node.args = (node, *tensor_inputs)
        obs_node.meta[KEY].setdefault("probes", []).append(probe.key)  # NodeMeta.add_probe, without the view
        return obs_node

    def detach(self, node: Node) -> list[str]:
        """Erase the observation of ``node`` (``PassContext.unobserve``): its observers, lowered calls
        and gradient taps (batches holding it split first); other observers stop reading it."""
        gm = node.graph.owning_module
        assert isinstance(gm, GraphModule), "node must belong to a GraphModule"
        find_lowered(node)  # splits the batched calls (forward and gradient) that hold it
        erased = []
        for user in list(node.users):
            meta = user.meta.get(KEY, _NONE)
            if meta.get("role") != INSTRUMENTATION:
                continue
            if meta.get("observes") == node.name and user.args and user.args[0] is node and not user.users:
                erased.append(user.name)
                gm.graph.erase_node(user)
            else:  # an input-wanting probe of another node reads it beside that node's output
                user.args = tuple(a for a in user.args if a is not node)
        return erased

    def _clock_pair(self, gm: GraphModule, pass_name: str | None) -> tuple[Node, Clock]:
        """The clock's node and module (the module looked up once per graph, not per observer)."""
        node = self.clock_node(gm, pass_name)
        cached = self._clocks.get(id(node))
        if cached is None or cached[0] is not node:
            clock = gm.get_submodule(str(node.target))
            assert isinstance(clock, Clock)
            cached = self._clocks[id(node)] = (node, clock)
        return cached

    def clock(self, gm: GraphModule, pass_name: str | None = None) -> Clock:
        """The graph's forward-call clock, inserted once at the start of the graph."""
        clock = gm.get_submodule(str(self.clock_node(gm, pass_name).target))
        assert isinstance(clock, Clock)
        return clock

    def clock_node(self, gm: GraphModule, pass_name: str | None = None) -> Node:
        """The clock's node: right after the placeholders, before anything that observes them."""
        cached = self._clock_nodes.get(id(gm.graph))
        if cached is not None and cached.graph is gm.graph and not getattr(cached, "_erased", False):
            return cached
        node: Node
        for node in gm.graph.nodes:
            if node.op == "call_module" and node_meta(node).role == CLOCK:
                self._clock_nodes[id(gm.graph)] = node
                return node
        name = add_module(gm, "clock", Clock())
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        anchor = placeholders[-1] if placeholders else None
        ctx = gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before(next(iter(gm.graph.nodes)))
        with ctx:
            node = gm.graph.call_module(name, (), {})
        meta = node_meta(node)
        meta.watch(CLOCK)
        meta.module = ""
        meta.added_by = pass_name or "fxdebug"
        self._clock_nodes[id(gm.graph)] = node
        return node


def _observer_at(gm: GraphModule, target: str) -> Observer:
    """The observer a ``call_module`` target names: through the namespace's ``_modules`` (``get_submodule``
    walks the instrumented module's attribute fallbacks: ~10 µs a call, once per probe per node)."""
    space = gm._modules.get(NAMESPACE)
    prefix = NAMESPACE + "."
    found = space._modules.get(target[len(prefix):]) if space is not None and target.startswith(prefix) else None
    if not isinstance(found, Observer):
        found = gm.get_submodule(target)
    assert isinstance(found, Observer)
    return found


def _observer_node(gm: GraphModule, node: Node, observer: Observer, after: Node, pass_name: str | None) -> Node:
    """``observer(node)`` as a ``call_module`` node right after ``after``, with the metadata
    ``graph.edits.insert_after`` and ``NodeMeta.watch`` give it, made directly: the module was
    registered a line before, so ``Graph.call_module``'s lookup of it is skipped (one per node)."""
    target = _register(gm, f"obs_{node.name}", observer)
    # name=: what FX derives from the target anyway (its snake-casing is a no-op on a lower-case one)
    name = target if target == target.lower() else None
    if getattr(gm, "_create_node_hooks", None):  # someone watches node creation: it sees the node whole, as FX makes it
        new = gm.graph.create_node("call_module", target, (node,), {}, name=name)
    else:  # made bare, then given its argument: FX skips its scan of the arguments for raw SymInts (a Node
        new = gm.graph.create_node("call_module", target, (), {}, name=name)  # holds none), ~3 µs a node
        new.args = (node,)
    after.append(new)  # moved in place: no insert-point context per node
    beside = node.meta.get(KEY, _NONE)
    meta: dict[str, object] = {"module_type": "Observer", "module": module_path(node)}
    if pass_name:
        meta["added_by"] = pass_name
    source = beside.get("source") or node.meta.get("stack_trace")
    if source:
        meta["source"] = source
    meta["role"] = INSTRUMENTATION
    meta["observes"] = node.name
    new.meta[KEY] = meta
    return new


def _register(gm: GraphModule, hint: str, observer: Observer) -> str:
    """``graph.edits.add_module`` for an observer: the same unique name under the namespace, written
    into its ``_modules`` directly (``nn.Module.add_module`` probes the name with a failing getattr)."""
    space = gm._modules.get(NAMESPACE)
    if space is None or type(space) is not nn.Module:
        return add_module(gm, hint, observer)
    base = hint if _PLAIN.fullmatch(hint) else ("".join(c if c.isalnum() or c == "_" else "_" for c in hint) or "m")
    name, i = base, 1
    modules, taken = space._modules, space.__dict__
    while name in modules or name in taken or name in space._parameters or name in space._buffers \
            or hasattr(nn.Module, name):
        i += 1
        name = f"{base}_{i}"
    modules[name] = observer
    return f"{NAMESPACE}.{name}"
