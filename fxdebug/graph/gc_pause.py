"""``paused_gc``: the cyclic garbage collector paused while a large structure is built, then resumed.

Building a graph (capture, passes, lowering, code generation) or a viewer's data allocates several
objects per node and frees almost none; the collector's full sweeps over them grow with the graph.
One helper here, below every folder that builds graphs (``authoring``, ``instrumented``) or pictures
(``render``), so each pauses the collector the same way.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["PROMOTE_AT", "paused_gc"]


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
