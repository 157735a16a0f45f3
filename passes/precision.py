"""``Precision(plan)``: keep the nodes of a precision plan in float32 while the rest runs in bf16/fp16.

A plan comes from ``fxdebug.precision_plan(model, example_inputs, dtype, tol)`` (or is a list of
node names). Each planned node keeps its name and place; its reduced-precision inputs and
parameters are upcast to float32, it runs with autocast off, its output stays float32 for the
other planned nodes and is cast back to the node's own dtype for everything else. See
``docs/numerics.md``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.fx import GraphModule

import fxdebug
from fxdebug import numerics
from fxdebug.authoring import Options, Pass, PassContext, PassResult

__all__ = ["Precision"]


class Precision(Pass):
    """Run the nodes of ``plan`` (a ``PrecisionPlan`` or node names) in ``dtype`` (float32).

    Raises ``UsageError`` naming the planned nodes the graph does not have (a plan made for a
    different model, or a graph traced with another frontend).
    """

    name = "precision"

    def __init__(self, plan: Any, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        opts = Options(self)
        nodes = getattr(plan, "nodes", plan)
        if isinstance(nodes, str) or not isinstance(nodes, Iterable):
            raise opts.error("plan", plan, "a PrecisionPlan (fxdebug.precision_plan) or a list of node names")
        self.nodes: list[str] = [str(n) for n in nodes]
        self.dtype = opts.instance("dtype", dtype, torch.dtype, "a floating torch.dtype, e.g. torch.float32",
                                   check=lambda d: d.is_floating_point)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        by_name = {n.name: n for n in gm.graph.nodes}
        missing = [n for n in self.nodes if n not in by_name]
        if missing:
            known = [n.name for n in ctx.nodes(gm, None)][:12]
            raise fxdebug.UsageError(
                f"Precision: the plan names node(s) {missing} that this graph does not have (nodes here include "
                f"{known}). Make the plan with precision_plan() on the same model and frontend.")
        kept = numerics.keep_float(gm, ctx, [by_name[n] for n in self.nodes], dtype=self.dtype)
        return PassResult(gm, replaced={k: k for k in kept})
