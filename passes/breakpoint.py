"""``Breakpoint``: stop at a node — with its inputs and outputs in scope — only when a condition holds.

The debugging guides put ``pdb.set_trace()`` inside ``forward`` and then wrap it in ``if`` by hand
to stop "when the NaN appears". At the graph level that is one pass::

    dbg = fxdebug.instrument(model, [Breakpoint("layer2.*", when=fxdebug.when.nonfinite)], example_inputs=(x,))

After each selected node a small module evaluates ``when(outputs)`` (see ``fxdebug.when``) on the
output's device; only when it is true does it call ``action(hit)`` with a ``BreakpointHit`` (node
name, module path, op, inputs, outputs, source line, call index). The default action is Python's
``breakpoint()`` — pdb unless ``PYTHONBREAKPOINT`` / ``sys.breakpointhook`` say otherwise — with
``node``, ``module``, ``inputs``, ``outputs``, ``source_line`` and ``hit`` as local variables.

Cost: one condition (typically one reduction over the output) and one ``bool()`` — a host sync —
per selected node and call. Nodes that are not selected run exactly as before, and the module
returns nothing, so outputs stay bitwise equal. ``when=None`` stops at every call. Inputs are seen
after the node ran: an in-place node's input *is* its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.fx import GraphModule

import fxdebug
from fxdebug import UsageError
from fxdebug.authoring import (
    GUARD, Options, Pass, PassContext, PassResult, Where, is_instrumentation, module_path, node_meta, op_label,
    source_line,
)

__all__ = ["Breakpoint", "BreakpointHit"]


@dataclass
class BreakpointHit:
    """What an action sees when a breakpoint fires."""

    node: str
    module: str
    op: str
    inputs: tuple[Any, ...]
    input_names: tuple[str, ...]
    outputs: Any
    source_line: str | None
    call: int  # how many times this node had run before, counting this call from 0


def debugger(hit: BreakpointHit) -> None:
    """The default action: ``breakpoint()`` with the node's tensors as locals."""
    node, module, inputs, outputs, source_line = hit.node, hit.module, hit.inputs, hit.outputs, hit.source_line  # noqa: F841
    print(f"fxdebug breakpoint at node '{node}' (module {module or '<root>'}, {hit.op})"
          + (f", {source_line}" if source_line else "") + ": inspect node, module, inputs, outputs, hit.")
    breakpoint()


class _BreakpointCall(nn.Module):
    """Inserted after a selected node: evaluates the condition, calls the action when it holds."""

    def __init__(self, owner: "Breakpoint", node: str, module: str, op: str, source: str | None,
                 input_names: tuple[str, ...]) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # shared, not a child module
        self.node_name, self.module_path, self.op, self.source = node, module, op, source
        self.input_names = input_names
        self.calls = 0

    def forward(self, out: Any, *inputs: Any) -> None:
        owner = self._owner
        call, self.calls = self.calls, self.calls + 1
        if owner.once and owner.hits:
            return None
        if owner.when is not None and not fxdebug.when.evaluate(owner.when, out, inputs):
            return None
        hit = BreakpointHit(self.node_name, self.module_path, self.op, inputs, self.input_names, out, self.source, call)
        owner.hits.append(hit)
        owner.action(hit)
        return None

    def extra_repr(self) -> str:
        return f"node={self.node_name!r}"


class Breakpoint(Pass):
    """Call ``action`` (default: the debugger) after the selected nodes when ``when`` holds.

    Args:
        where: the nodes to stop at (globs over node names / module paths, or a predicate).
        when: condition on the outputs (``fxdebug.when.nonfinite``, ``lambda y: y.abs().max() > 1e4``);
            ``None`` stops on every call.
        action: ``action(hit)`` with a ``BreakpointHit``; default ``breakpoint()`` with locals.
        once: stop at most once (over all selected nodes and calls) — the first time it holds.

    ``hits`` lists every ``BreakpointHit`` so far.
    """

    name = "breakpoint"
    observe_only = True

    def __init__(self, where: Where, when: Callable[..., Any] | None = None,
                 action: Callable[[BreakpointHit], Any] | None = None, *, once: bool = False) -> None:
        super().__init__(where=where)
        opts = Options(self)
        self.when = opts.function("when", when, "a function of the outputs (see fxdebug.when)")
        self.action = opts.function("action", action, "a function taking a BreakpointHit") or debugger
        self.once = opts.flag("once", once)
        self.hits: list[BreakpointHit] = []

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        picked = ctx.nodes(gm, ops=("call_module", "call_function", "call_method"))
        if not picked:
            raise UsageError(f"Breakpoint: where={self.where!r} selects no node.")
        added = []
        for node in picked:
            inputs = tuple(a for a in node.all_input_nodes if not is_instrumentation(a))
            call = _BreakpointCall(self, node.name, module_path(node), op_label(node),
                                   source_line(node), tuple(a.name for a in inputs))
            new = ctx.insert_after(node, call, (node, *inputs), hint=f"breakpoint_{node.name}")
            node_meta(new).watch(GUARD)
            ctx.record(new, {"breaks_at": node.name})
            added.append(new)
        return PassResult(gm, added=added)

    def __repr__(self) -> str:
        return f"Breakpoint(where={self.where!r}, when={getattr(self.when, '__name__', self.when)!r}, once={self.once})"
