"""``ExpertLoad``: how many tokens each expert of a mixture-of-experts layer received, and which got none.

A Mixtral-style layer routes each token to its top-k experts: ``probs = softmax(gate(h))``,
``weights, experts = torch.topk(probs, k)``. ``ExpertLoad`` watches the expert indices that every
``topk`` of the graph returns (or those ``where=`` selects) and adds, on the device and without a
sync, one count per chosen expert into a fixed-size vector (``scatter_add_``; ``bincount`` would
have to read the largest index back to size its output). The report row of that index node gets

* ``expert_tokens`` — tokens routed to each expert, over every call since the last reset;
* ``dead_experts`` — how many experts received no token at all, and ``dead_expert_ids`` which;
* ``expert_imbalance`` — the busiest expert's tokens over the mean (1.0 is perfectly even).

``Report.findings()`` gives ``kind="dead_experts"`` for a layer with at least one dead expert.
The number of experts is the routed tensor's last dim (from the example inputs), or ``experts=``.
Routing code that itself calls ``.item()`` keeps its own syncs; this pass adds none.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

import fxdebug
from fxdebug import UsageError
from fxdebug.authoring import (
    HIDDEN, Column, FindingRule, ObservationContext, Options, Pass, PassContext, PassResult, Probe, Reductions, Where,
    describe,
)

__all__ = ["ExpertLoad"]


def _columns() -> tuple[Column, ...]:
    dead = FindingRule(
        kind="dead_experts", option="dead_experts",
        message="{where}: {value} of {experts} experts received no token (experts {dead_expert_ids}); tokens per expert: "
                "{expert_tokens}.",
        fix=("add or raise the router's load-balancing loss (router_aux_loss_coef), add router noise or jitter, or "
             "check the gate's initialisation; a dead expert's weights get no gradient."))
    return (
        Column("expert_tokens", doc="tokens routed to each expert (summed over calls)"),
        Column("dead_experts", format="d", doc="experts that received no token", threshold=1.0, finding=dead),
        Column("expert_imbalance", format=".2f", doc="busiest expert's tokens / mean tokens per expert"),
        Column("dead_expert_ids", roles=HIDDEN, doc="indices of the experts that received no token"),
        Column("experts", roles=HIDDEN, doc="number of experts of the layer"),
    )


class ExpertLoadProbe(Probe):
    """Counts, per expert, the routing choices in the watched index tensor (no sync)."""

    key = "expert_load"

    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.columns = _columns()

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        return {"counts": torch.zeros(self.experts, dtype=torch.int64, device=x.device)}

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        idx = r.x.reshape(-1)
        if idx.numel() == 0 or idx.is_floating_point() or idx.device.type == "meta":
            return
        # out-of-range indices (a bug in the router) are clamped into the last expert rather than crashing
        state["counts"].scatter_add_(0, idx.long().clamp(0, self.experts - 1), torch.ones_like(idx, dtype=torch.int64))

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        counts = state["counts"]
        if counts.device.type == "meta":
            return {}
        tokens = counts.tolist()
        total = sum(tokens)
        if not total:
            return {"expert_tokens": tokens, "experts": self.experts}
        dead = [i for i, n in enumerate(tokens) if n == 0]
        return {"expert_tokens": tokens, "dead_experts": len(dead), "dead_expert_ids": dead,
                "expert_imbalance": max(tokens) / (total / len(tokens)), "experts": self.experts}


def _is_topk(node: Node) -> bool:
    return (node.op == "call_function" and node.target in (torch.topk, torch.ops.aten.topk.default)) or (
        node.op == "call_method" and node.target == "topk")


class ExpertLoad(Pass):
    """Per-expert token counts and dead experts of every routing ``topk`` (see the module docstring).

    Args:
        experts: the number of experts (default: the last dim of the routed tensor, which needs
            ``example_inputs``).
        where: limit the routing ``topk`` nodes (globs over module paths / node names, or a predicate).
    """

    name = "expert-load"
    observe_only = True

    def __init__(self, experts: int | None = None, *, where: Where = None) -> None:
        super().__init__(where=where)
        self.experts = Options(self).number("experts", experts, low=1, integer=True, none=True,
                                            doc="the number of experts, an int >= 1, or None (read from the router)")

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        added = []
        for node in ctx.nodes(gm, predicate=_is_topk):
            indices = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 1]
            if not indices:
                continue
            experts = self.experts or self._experts(node, ctx)
            added.append(ctx.observe(indices[0], ExpertLoadProbe(experts)))
        return PassResult(gm, added=[a for a in added if a is not None])

    def _experts(self, node: Node, ctx: PassContext) -> int:
        src = node.args[0] if node.args else node.kwargs.get("input")
        spec = ctx.tensor_spec(src) if isinstance(src, Node) and ctx.inputs is not None else None
        shape = getattr(spec, "shape", None)
        if not shape:
            raise UsageError(f"ExpertLoad: cannot tell how many experts {describe(node)} routes to: give "
                             "example_inputs to instrument(), or ExpertLoad(experts=N).", pass_name=self.name)
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else -1)
        return int(shape[dim])
