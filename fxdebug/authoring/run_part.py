"""The one pass runner: every captured graph goes through ``run_part``, whichever frontend produced it and
whenever it arrives (a snapshot part at ``instrument()``, a live (Dynamo) graph at the call that captured it, a
recompile). Nothing else runs passes.

``run_part`` learns the part's shapes on the inputs it is called with (which also checks them against
the graph, naming the failing node), runs the passes (``PassManager``), learns the shapes of the nodes a
transform made, drops the cached specs before lowering (peak memory), lowers the fused observers to
direct op calls (``runtime.lower``) and records what each pass did; all with the cyclic garbage collector
paused (``graph/gc_pause.py``'s ``paused_gc``, imported here by the snapshot pipeline too).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch.fx import GraphModule

from fxdebug.authoring.context import PassContext
from fxdebug.authoring.pipeline import Pass, PassManager
from fxdebug.graph.gc_pause import paused_gc
from fxdebug.graph.meta import graph_record
from fxdebug.report.report import Report
from fxdebug.runtime.lower import lower_observers

__all__ = ["run_part"]


def run_part(part: GraphModule, passes: Sequence[Pass], inputs: Any, prior: Report | None = None, *,
             relearn: bool | None = None, partial: bool = False) -> Any:
    """``passes`` over one captured graph ``part``, on ``inputs`` (what that part is called with; ``None``: no
    shapes are learnt). ``relearn``: learn the shapes again after the passes (default: when a pass transforms);
    ``partial``: the part is one of a live capture's graphs (``PassContext.partial``).
    Returns the new part (what the last pass returned), observers lowered."""
    pass_list = list(passes)
    if relearn is None:
        relearn = any(not p.observe_only for p in pass_list)
    with paused_gc():
        ctx = PassContext(inputs, prior_report=prior, partial=partial)
        if ctx.inputs is not None:
            ctx.specs(part)
        manager = PassManager(pass_list)
        new = manager.run(part, ctx)
        if ctx.inputs is not None and relearn:
            ctx.specs(new)  # a transform made new nodes: learn their shapes for the report and picture
        ctx.invalidate()  # the shapes are in the nodes' metadata now: the cached specs go before lowering (peak memory)
        lower_observers(new)  # fused observers become direct op calls (runtime/lower.py)
        graph_record(new).passes.extend(manager.results)
    return new
