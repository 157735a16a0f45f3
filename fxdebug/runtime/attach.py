"""Attaching probes: one observer node per watched node, and the graph's forward-call clock.

``attach(node, probe)`` finds or creates the ``Observer`` that watches ``node`` (one per node,
shared by every probe, so passes compose instead of doubling the reads) and adds the probe to it.
The clock is inserted once per graph, after the placeholders, so every observation in a call
sees that call's tick. The observers themselves (what a probe computes, on which device, without
host syncs) live in ``observe.py``.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from fxdebug.graph.edits import add_module, insert_after
from fxdebug.graph.meta import CLOCK, INSTRUMENTATION, KEY, is_instrumentation, module_path, node_meta, op_label
from fxdebug.runtime.observer import Clock, Observer, Probe
from fxdebug.runtime.lower import find_lowered, unlower

__all__ = ["Observation"]

_NONE: dict[str, object] = {}


class Observation:
    """Per-run helper that attaches probes; caches each graph's clock node."""

    def __init__(self) -> None:
        self._clock_nodes: dict[int, Node] = {}

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
            observer = Observer(node.name, module_path(node), op_label(node), self.clock(gm, pass_name))
            # An input's observer runs after the clock, so every observation sees this call's tick.
            after = self.clock_node(gm, pass_name) if node.op == "placeholder" else node
            obs_node = insert_after(node, observer, (node,), hint=f"obs_{node.name}", after=after, pass_name=pass_name)
            node_meta(obs_node).watch(INSTRUMENTATION, observes=node)
        else:
            found = gm.get_submodule(str(obs_node.target))
            assert isinstance(found, Observer)
            observer = found
        if not observer.add_probe(probe):
            return None
        if probe.wants_inputs and len(obs_node.args) == 1:
            tensor_inputs = [a for a in node.all_input_nodes if not is_instrumentation(a)]
            obs_node.args = (node, *tensor_inputs)
        node_meta(obs_node).add_probe(probe.key)
        return obs_node

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
