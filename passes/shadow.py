"""``Shadow``: which op loses the precision? Every node also runs in float64, from float64 inputs.

Per observed node the report gets ``local_err`` (the op alone, fed the real inputs upcast,
against its real output), ``acc_err`` (the real output against the all-float64 shadow: the error
accumulated so far) and ``err_growth`` (the factor by which it grew at this node); both errors are
relative (‖real − reference‖₂ / ‖reference‖₂), maxima over the calls since ``reset()``.
``Report.precision_origin`` names the node where the accumulated error jumps most. The model's
outputs stay bitwise unchanged; fp32, bf16 and fp16 models and ``torch.autocast`` regions all
work (the shadow runs with autocast off). See ``docs/numerics.md`` and ``fxdebug.numerics.shadow``.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from fxdebug import numerics
from fxdebug.authoring import Options, Pass, PassContext, PassResult, Where, is_view

__all__ = ["Shadow"]


class Shadow(Pass):
    """Run every selected node a second time in ``dtype`` and report its precision loss.

    Args:
        dtype: the shadow dtype (``torch.float64``; ``torch.float32`` is enough to study a
            bf16/fp16 model at half the cost).
        views: also report reshapes, permutes and slices (they are always shadowed, since the
            shadow path runs through them, but they add no error of their own).
        where: limit the shadowed nodes; inputs from outside the selection enter the shadow as
            exact copies of their real values (their accumulated error is reset to 0).

    Cost: each shadowed node runs twice more, in ``dtype``; parameters are copied to ``dtype``
    once and re-copied only when they change. Nothing is read back before the report.
    """

    name = "shadow"
    observe_only = True

    def __init__(self, dtype: torch.dtype = torch.float64, *, views: bool = False, where: Where = None) -> None:
        super().__init__(where=where)
        opts = Options(self)
        self.dtype = opts.instance("dtype", dtype, torch.dtype, "a floating torch.dtype, e.g. torch.float64",
                                   check=lambda d: d.is_floating_point)
        self.views = opts.flag("views", views)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        nodes = ctx.nodes(gm, self.where)
        if ctx.inputs is not None:
            keep_views = self.views
            report = [n for n in nodes if (s := ctx.tensor_spec(n)) is not None and s.dtype.is_floating_point
                      and (keep_views or not is_view(n, gm))]
        else:
            report = [n for n in nodes if self.views or not is_view(n, gm)]
        added = numerics.add_shadow(gm, ctx, nodes, self.dtype, report_nodes=report)
        return PassResult(gm, added=added)
