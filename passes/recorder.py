"""``Recorder(history=N)``: a flight recorder of the last N calls' per-node statistics.

The fused runtime's state table (every watched node's sums and NaN/Inf counts) is copied into a
ring of N + 1 snapshots on the device at the end of every call — one copy per call, no host sync;
``report().history`` returns per-call ``mean``, ``std``, ``norm``, ``nan``/``inf`` counts,
``nonfinite`` and the running ``min_so_far``/``max_so_far`` of every watched node (``History``: ``.calls``, ``.at(call)``, ``.node(name)``, ``.first_nonfinite``).
``on_nonfinite=`` (a callable taking the report, or a path to write it to as JSON) fires at the
end of the first call in which a watched node saw NaN/Inf, at the cost of reading one device flag
per call — the one sync this option adds. ``NaNCheck(history=N, on_nonfinite=...)`` is the same
recorder on the nodes NaNCheck watches. See ``docs/numerics.md``.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.fx import GraphModule

from fxdebug import numerics
from fxdebug.authoring import Options, Pass, PassContext, PassResult, Where, is_view

__all__ = ["Recorder"]


def on_nonfinite_option(opts: Options, value: Any) -> Any:
    """``on_nonfinite=``, checked by the rule of ``opts`` (shared by ``Recorder`` and ``NaNCheck``)."""
    if value is None or callable(value) or isinstance(value, str) or hasattr(value, "__fspath__"):
        return value
    raise opts.error("on_nonfinite", value, "a callable taking the report, or a path to write the report to as JSON")


class Recorder(Pass):
    """Keep the last ``history`` calls' statistics of every selected node on the device.

    Args:
        history: how many calls to keep (the ring's length).
        on_nonfinite: a callable ``f(report)`` or a path; fires once, at the end of the first call
            with a NaN/Inf (one device flag read per call).
        views: also record reshapes, permutes and slices.
        where: limit the recorded nodes.
    """

    name = "recorder"
    observe_only = True

    def __init__(self, history: int = 64, *, on_nonfinite: Callable[[Any], Any] | str | None = None,
                 views: bool = False, where: Where = None) -> None:
        super().__init__(where=where)
        opts = Options(self)
        self.history = opts.number("history", history, low=1, integer=True, doc="how many calls to keep, an int >= 1")
        self.on_nonfinite = on_nonfinite_option(opts, on_nonfinite)
        self.views = opts.flag("views", views)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        skip_views = None if self.views else (lambda n: not is_view(n, gm))
        nodes = ctx.nodes(gm, self.where, ops=("placeholder", "call_module", "call_function", "call_method"),
                          float_outputs=ctx.inputs is not None, predicate=skip_views)
        return PassResult(gm, added=numerics.add_recorder(gm, ctx, nodes, self.history, self.on_nonfinite))
