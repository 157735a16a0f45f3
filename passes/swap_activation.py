"""``SwapActivation``: replace ReLU — in every form FX meets — by LeakyReLU or another activation.

Forms caught (through ``fxdebug.authoring.is_relu``): ``nn.ReLU`` (``inplace`` or not), ``F.relu``
(``inplace`` or not), ``torch.relu``, ``torch.relu_``, ``Tensor.relu``, ``Tensor.relu_``.

In-place semantics are kept where they matter: when a ReLU writes into its input and someone
still reads that input afterwards (``h.relu_(); g = fc(h)``), or its result is unused, or the
input is the caller's own tensor, the replacement also writes into the input — LeakyReLU in
place, or ``input.copy_(activation(input))`` for activations that cannot work in place.

``only_dead=0.5`` swaps only the ReLUs where an earlier ``StatCollector`` run saw at least half
of the channels dead (row key ``dead_frac``); the report comes from the context
(``instrument`` passes the report of an already-instrumented model) or from ``report=``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.fx import GraphModule, Node

from fxdebug import PassError, UsageError
from fxdebug.authoring import (
    Options, Pass, PassContext, PassResult, Where, is_inplace, is_relu, module_path, node_meta, op_label,
)

__all__ = ["SwapActivation"]


def _dead_frac(report: Any, node: Node) -> float | None:
    """The dead fraction an earlier run saw at ``node`` (by node name, else by module path)."""
    rows = getattr(report, "rows", None) or []
    by_name = [r for r in rows if r.get("node") == node.name]
    if not by_name and node.op == "call_module":
        by_name = [r for r in rows if r.get("module") == module_path(node) and r.get("dead_frac") is not None]
    for row in by_name:
        if row.get("dead_frac") is not None:
            return float(row["dead_frac"])
    return None


def _inplace_matters(node: Node) -> bool:
    """True if replacing this in-place ReLU by an out-of-place op would change what others see."""
    if not node.args or not isinstance(node.args[0], Node):
        return False
    src = node.args[0]
    if src.op in ("placeholder", "get_attr") or not node.users:
        return True
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return any(order[u] > order[node] for u in src.users if u is not node)


class SwapActivation(Pass):
    """Replace ReLUs by ``LeakyReLU(negative_slope)`` or by ``to()``.

    Args:
        negative_slope: slope of the LeakyReLU for negative inputs.
        to: a factory returning the new activation module (``nn.GELU``, ``lambda: nn.ELU(0.5)``);
            overrides ``negative_slope``.
        only_dead: swap only ReLUs whose observed dead-channel fraction is at least this.
        report: the ``fxdebug.Report`` to read dead fractions from (default: the context's
            ``prior_report``).
        where: limit the pass to some nodes / modules.
    """

    name = "swap-activation"
    # works on the live (Dynamo) capture: its functional relu calls are replaced as module calls are
    live_capture = True

    def __init__(self, negative_slope: float = 0.01, to: Callable[[], nn.Module] | None = None,
                 only_dead: float | None = None, *, report: Any = None, where: Where = None) -> None:
        super().__init__(where=where)
        opts = Options(self)
        self.negative_slope = opts.number("negative_slope", negative_slope)
        self.to = opts.function("to", to, "a factory of the new activation, such as nn.GELU or lambda: nn.ELU(0.5)")
        self.only_dead = opts.number("only_dead", only_dead, low=0, high=1, none=True,
                                     doc="the dead fraction above which a ReLU is swapped, a number in [0, 1], or None")
        self.report = report

    def _make(self, inplace: bool) -> nn.Module:
        if self.to is None:
            return nn.LeakyReLU(self.negative_slope, inplace=inplace)
        module = self.to()
        if not isinstance(module, nn.Module):
            raise UsageError(f"SwapActivation(to=...) must return an nn.Module; it returned {type(module).__name__}.")
        if inplace and hasattr(module, "inplace"):
            module.inplace = True
        return module

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        report = self.report if self.report is not None else ctx.prior_report
        if self.only_dead is not None and report is None:
            raise PassError(
                f"SwapActivation(only_dead={self.only_dead}) needs dead fractions from an earlier StatCollector run: "
                "instrument with StatCollector(), run data through it, then instrument that module again "
                "(its report becomes the prior report) or pass report=dbg.report().", pass_name=self.name)
        notes: list[str] = []

        def swap(node: Node, ctx: PassContext) -> Node | None:
            dead = _dead_frac(report, node) if report is not None else None
            if self.only_dead is not None and (dead is None or dead < self.only_dead):
                notes.append(f"kept {node.name}: " + ("the report has no dead fraction for it." if dead is None else
                                                      f"dead fraction {dead:.2f} < {self.only_dead}."))
                return None
            new = self._replacement(gm, ctx, node)
            info: dict[str, Any] = {"from": op_label(node), "to": op_label(new) if new.op == "call_module" else "copy_"}
            if dead is not None:
                info["dead_frac"] = dead
            ctx.record(new, info)
            return new

        replaced = self.rewrite(gm, ctx, swap, predicate=lambda n: is_relu(n, gm))
        if self.only_dead is not None:
            notes.insert(0, f"swapped {len(replaced)} ReLU(s) with dead fraction >= {self.only_dead}.")
        return PassResult(gm, replaced=replaced, notes=notes)

    def _replacement(self, gm: GraphModule, ctx: PassContext, node: Node) -> Node:
        """The new activation in ``node``'s place; in place where the ReLU's write into its input matters."""
        x = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
        keep_inplace = is_inplace(node, gm) and _inplace_matters(node)
        module = self._make(inplace=is_inplace(node, gm))
        if not keep_inplace or getattr(module, "inplace", False):
            new = ctx.replace_with_module(node, module, (x,))
            if keep_inplace and not new.users:
                node_meta(new).keep_unused = True
            return new
        # The activation cannot write in place: compute it, then copy the result into the input.
        act = ctx.insert_after(node, module, (x,), hint=f"{node.name}")
        ctx.copy_meta(node, act)
        write = ctx.replace(node, ctx.insert_after(act, torch.Tensor.copy_, (x, act)))
        node_meta(write).keep_unused = True
        return write
