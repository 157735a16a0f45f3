"""The one pass runner: every captured graph goes through ``run_part``, whichever frontend produced it and
whenever it arrives (a snapshot part at ``instrument()``, a live (Dynamo) graph at the call that captured it, a
recompile). Nothing else runs passes.

``run_part`` learns the part's shapes on the inputs it is called with (which also checks them against
the graph, naming the failing node), runs the passes (``PassManager``), learns the shapes of the nodes a
transform made, drops the cached specs before lowering (peak memory), lowers the fused observers to
direct op calls (``runtime.lower``) and records what each pass did; all with the cyclic garbage collector
paused (``paused_gc``).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator, Sequence

from torch.fx import GraphModule

from fxdebug.authoring.context import PassContext
from fxdebug.authoring.pipeline import Pass, PassManager
from fxdebug.graph.meta import graph_record
from fxdebug.report.report import Report
from fxdebug.runtime.lower import lower_observers

__all__ = ["PROMOTE_AT", "paused_gc", "run_part"]


def run_part(part: GraphModule, passes: Sequence[Pass], inputs: Any, prior: Report | None = None, *,
             relearn: bool | None = None) -> Any:
    """``passes`` over one captured graph ``part``, on ``inputs`` (what that part is called with; ``None``: no
    shapes are learnt). ``relearn``: learn the shapes again after the passes (default: when a pass transforms).
    Returns the new part (what the last pass returned), observers lowered."""
    pass_list = list(passes)
    if relearn is None:
        relearn = any(not p.observe_only for p in pass_list)
    with paused_gc():
        ctx = PassContext(inputs, prior_report=prior)
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


# Objects allocated (net) while paused above which they are promoted, not scanned, on resuming:
# ~10 per node, so graphs of a few thousand nodes and up.
PROMOTE_AT = 20_000


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused while a graph is built (then restored as it was).

    Capture, passes and lowering allocate several objects per node and free almost none; the
    collector's full sweeps over them grow with the graph (~1 s of a 10k-node ``instrument()``).
    Reference counting frees as usual.

    On resuming, what was allocated meanwhile (the graph: nodes, metadata, observers; it lives as
    long as the module) joins the oldest generation at once (``gc.freeze()`` + ``gc.unfreeze()``,
    which moves the young generations there without scanning them) when it is more than
    ``PROMOTE_AT`` objects: otherwise the first young collection after resuming walks all of it
    (~0.08 s of a 10k-node ``instrument()``, ~0.7 s at 100k) and the middle one walks it again
    later, only to move it to where it ends anyway. Cycles that became garbage in the young
    generations are then freed by the next full collection instead of a young one (capture and
    passes leave few: the tracer's tables are cleared by the capture). Not done when the process
    froze objects itself (``gc.get_freeze_count()``): ``unfreeze`` would release those too."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            if gc.get_count()[0] > PROMOTE_AT and not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
