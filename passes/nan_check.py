"""``NaNCheck``: where did the NaN (or Inf) come from — forward and, optionally, backward.

``mode="record"`` (the default) never synchronises with the host. Per call and node it reads the
node's fused statistics (``torch.ops.fxdebug.observe``: one pass over the tensor, shared with
``StatCollector``, with exact NaN and Inf counts) and updates, in place on the device, "how many
calls saw non-finite values" and "the earliest call that did" (the graph clock's device counter). The report turns those per-node facts into the
origin: the first node, in execution order, among those that went non-finite in the earliest
such call — its inputs were finite.

``mode="raise"`` stops at the first node whose output holds NaN/Inf and names it, with exact
counts and its inputs' ranges. It syncs once per node and call: the one documented exception to
"no host sync".

``counts=True`` adds the NaN and Inf element counts to the report (the fused pass computes them
anyway); raise mode always gives them in its message.

``samples=True`` also keeps, per watched node and on the device, which batch rows (dim 0) — and,
for ``(batch, sequence, ...)`` outputs, which ``(batch, position)`` tokens — were non-finite the
first time the node went non-finite: ``report().origin_samples`` / ``origin_tokens`` read them at
the origin. It costs one more reduction per node and call (and a Python probe per node).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

import fxdebug
from fxdebug import NonFiniteError
from fxdebug.authoring import (
    HIDDEN, NONFINITE, ORIGIN, Column, FusedProbe, FusedStats, ObservationContext, Options, Pass, PassContext,
    PassResult, Probe, Reductions, Where, describe, get_module, is_instrumentation, is_view, module_path, node_identity,
    op_label,
    source_line,
)

__all__ = ["NaNCheck"]

_OPS = ("placeholder", "call_module", "call_function", "call_method")


def read(t: Any) -> Any:
    """A Python number for a 0-d tensor; ``None`` on the meta device (nothing to read there)."""
    if isinstance(t, Tensor):
        return None if t.device.type == "meta" else t.item()
    return t


def has_nonfinite(r: Reductions) -> Tensor:
    """0-d bool tensor: does the watched tensor hold any NaN or Inf? Exact (no sum that could
    overflow on large finite values); used by raise mode, which syncs on it."""
    return ~torch.isfinite(r.x).all()


@functools.cache  # frozen declarations, shared by every probe (~1 KB per node when built per probe)
def nonfinite_columns(counts: bool) -> tuple[Column, ...]:
    """What ``NaNCheck`` reports: calls that saw NaN/Inf (forward and grad) and the earliest one."""
    cols = (Column("nonfinite_calls", roles=NONFINITE, phase="both", format="d",
                   doc="calls in which the output held NaN or Inf"),
            Column("nonfinite_first_call", roles=(ORIGIN, HIDDEN), phase="both",
                   doc="index of the earliest call that saw NaN/Inf (the origin is derived from it)"))
    if counts:
        cols += (Column("nan", phase="both", format="d", doc="NaN elements seen, over all calls"),
                 Column("inf", phase="both", format="d", doc="Inf elements seen, over all calls"))
    return cols


class NonFiniteProbe(FusedProbe):
    """Record-mode probe: counts the calls that saw NaN/Inf and remembers the earliest one.

    It reads the node's fused statistics (one pass over the tensor shared with ``StatCollector``;
    exact NaN and Inf counts, so large finite values are never mistaken for an overflow), kept
    on the device in the graph's fixed-size state table: record mode neither syncs nor grows.
    """

    key = "nan-check"

    def __init__(self, *, grads: bool = False, counts: bool = False) -> None:
        self.grads = grads
        self.counts = counts
        self.columns = nonfinite_columns(counts)

    def summary_from(self, stats: FusedStats, phase: str) -> dict[str, Any]:
        out: dict[str, Any] = {"nonfinite_calls": stats.bad_calls, "nonfinite_first_call": stats.first_bad}
        if self.counts:
            out["nan"], out["inf"] = stats.nan, stats.inf
        return out


def _at_origin(key: str) -> Any:
    """A reading of the report rows: ``key`` at the forward origin — the first row, in execution
    order, among those that went non-finite in the earliest call that saw any (what
    ``first_nonfinite`` names)."""

    def reading(rows: Any) -> Any:
        seen = [(r["nonfinite_first_call"], i) for i, r in enumerate(rows)
                if isinstance(r.get("nonfinite_first_call"), (int, float)) and not isinstance(r.get("nonfinite_first_call"), bool)]
        return rows[min(seen)[1]].get(key) if seen else None

    return reading


@functools.cache  # frozen declarations, shared by every probe (was ~1.7 KB per node)
def samples_columns() -> tuple[Column, ...]:
    """``nonfinite_samples`` / ``nonfinite_tokens``, answering ``Report.origin_samples`` / ``origin_tokens``."""
    def col(name: str, answers: str, doc: str) -> Column:
        try:
            return Column(name, roles=HIDDEN, doc=doc, answers=answers, reading=_at_origin(name))  # type: ignore[call-arg]
        except TypeError:  # a Column without declared readings
            return Column(name, roles=HIDDEN, doc=doc)

    return (col("nonfinite_samples", "origin_samples", "batch indices (dim 0) non-finite in the first bad call"),
            col("nonfinite_tokens", "origin_tokens", "(batch, position) pairs non-finite in the first bad call"))


class SamplesProbe(Probe):
    """Which rows (dim 0), and for 3-d outputs which ``(row, position)`` tokens, held NaN/Inf in the
    first call that saw any — kept on the device, captured once (no sync)."""

    key = "nan-check-samples"

    def __init__(self) -> None:
        self.columns = samples_columns()

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        return {"seen": torch.zeros((), dtype=torch.bool, device=x.device),
                "mask": torch.zeros(0, 0, dtype=torch.bool, device=x.device), "tokens": x.dim() >= 3}

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        x = r.x
        if x.dim() == 0 or x.numel() == 0 or x.device.type == "meta" or not x.is_floating_point():
            return
        acc = torch.float64  # a sum of finite float32/16 values cannot overflow float64: exact detection
        if x.dim() >= 3:
            bad = ~torch.isfinite(x.reshape(x.shape[0], x.shape[1], -1).sum(-1, dtype=acc))  # (B, T)
        else:
            bad = ~torch.isfinite(x.reshape(x.shape[0], -1).sum(-1, dtype=acc)).unsqueeze(1)  # (B, 1)
            state["tokens"] = False
        mask = state["mask"]
        rows, cols = max(mask.shape[0], bad.shape[0]), max(mask.shape[1], bad.shape[1])
        if mask.shape != (rows, cols):  # a larger batch or sequence than before: grow (never shrinks)
            mask = torch.nn.functional.pad(mask, (0, cols - mask.shape[1], 0, rows - mask.shape[0]))
        if bad.shape != (rows, cols):
            bad = torch.nn.functional.pad(bad, (0, cols - bad.shape[1], 0, rows - bad.shape[0]))
        any_bad = bad.any()
        state["mask"] = torch.where(any_bad & ~state["seen"], bad, mask)
        state["seen"] = state["seen"] | any_bad

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        mask = state["mask"]
        if mask.device.type == "meta" or not bool(state["seen"]):
            return {"nonfinite_samples": None, "nonfinite_tokens": None}
        mask = mask.cpu()
        samples = sorted(int(i) for i in mask.any(1).nonzero().flatten())
        tokens = [(int(b), int(t)) for b, t in mask.nonzero().tolist()] if state["tokens"] else None
        return {"nonfinite_samples": samples, "nonfinite_tokens": tokens}


class RaisingProbe(Probe):
    """Raise-mode probe: checks every call on the host and raises ``NonFiniteError`` at once."""

    key = "nan-check"
    wants_inputs = True

    def __init__(self, *, grads: bool, counts: bool, node: Node, inputs: list[str], module: Any) -> None:
        self.grads = grads
        self.counts = counts
        self.columns = nonfinite_columns(counts)
        self.named = node_identity(node)  # identities, worded when shown: a copy for another instance renames them
        self.node_name, self.module, self.op = node.name, module_path(node), op_label(node)
        self.where = source_line(node)
        self.users = [u.name for u in node.users if not is_instrumentation(u) and u.op != "output"]
        self.input_names = inputs
        self.is_input = node.op == "placeholder"  # a graph input: the value came in already non-finite
        self.owner = module  # the node's module (not registered as a child): its weights may be the culprit
        # parameters read as inputs (a Dynamo or export graph calls torch.linear with the weights as get_attr
        # nodes, not a Linear module): {input name: parameter path}, blamed like the owner's parameters
        self.param_inputs = {a.name: str(a.target) for a in node.all_input_nodes if a.op == "get_attr"}

    @property
    def describe(self) -> str:
        return describe(self.named)

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        return {"bad": 0, "first": None, "nan": 0, "inf": 0}

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        if r.x.numel() == 0 or r.x.device.type == "meta":
            return
        if self.counts:
            state["nan"] += int(torch.isnan(r.x).sum())
            state["inf"] += int(torch.isinf(r.x).sum())
        if not bool(has_nonfinite(r)):  # the documented sync
            return
        state["bad"] += 1
        if state["first"] is None:
            state["first"] = ctx.call
        raise NonFiniteError(self._message(r, ctx), node=self.node_name, module=self.module, op=self.op)

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        out = {"nonfinite_calls": state["bad"], "nonfinite_first_call": state["first"]}
        if self.counts:
            out["nan"], out["inf"] = state["nan"], state["inf"]
        return out

    def _message(self, r: Reductions, ctx: ObservationContext) -> str:
        x = r.x
        nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        counts = f"{nan} NaN and {inf} Inf of {x.numel()} values"
        at = f" Defined at {self.where}." if self.where else ""
        if ctx.phase == "grad":
            users = ", ".join(f"'{u}'" for u in self.users) or "the loss"
            return (f"NaNCheck: the gradient flowing back into the output of {self.describe} holds {counts} "
                    f"(forward call {ctx.call}). It was produced by the backward of its user(s) {users}: check their "
                    f"domain (sqrt/log/pow near 0, division by small values) or clip the gradient.{at}")
        parts, all_finite, bad_params = [], True, []
        param_inputs = getattr(self, "param_inputs", {})  # a probe pickled before it existed has none
        for name, t in zip(self.input_names, ctx.inputs):
            if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel():
                t = t.detach()
                finite = bool(torch.isfinite(t).all())
                if name in param_inputs:  # a weight: the cause below names it, as for a module's own
                    if not finite:
                        bad_params.append(param_inputs[name])
                    continue
                all_finite &= finite
                parts.append(f"'{name}' {tuple(t.shape)}: min {float(t.min()):.4g}, max {float(t.max()):.4g}"
                             + ("" if finite else " (already non-finite)"))
        params = self.owner.named_parameters() if self.owner is not None else ()
        bad_params += [f"{self.module}.{n}" for n, p in params if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all())]
        inputs = "; ".join(parts) if parts else "no floating-point tensor inputs"
        if getattr(self, "is_input", False):  # a probe pickled before it existed is not an input's
            return (f"NaNCheck: {self.describe}, an input of the model's graph, holds {counts} in forward call "
                    f"{ctx.call}: the value already carried NaN/Inf when it came in, so no op of the model made it. "
                    "Check the data, not the model: the batch and its preprocessing (a division by a zero std, log "
                    f"of 0, a corrupt sample); NaNCheck(samples=True) names the rows.{at}")
        if bad_params:
            cause = f"Its parameter(s) {', '.join(bad_params)} are not finite: the weights went bad (learning rate, a bad checkpoint)."
        elif all_finite:
            cause = ("Its inputs were finite, so this op made them: check its domain (log/sqrt of negatives, division "
                     "by zero, exp overflow, float16 range).")
        else:
            cause = "Its inputs were already non-finite; they come from a node NaNCheck does not watch (widen where=)."
        return (f"NaNCheck: {self.describe} produced {counts} in forward call {ctx.call}. Inputs: {inputs}. "
                f"{cause}{at}")


class NaNCheck(Pass):
    """Find the node where NaN/Inf first appear, forward (and backward with ``backward=True``).

    Args:
        mode: ``"record"`` (no host sync; read ``report().first_nonfinite``) or ``"raise"``
            (``NonFiniteError`` at the first non-finite node; syncs per node).
        backward: also watch the gradient flowing into every node's output
            (``report().first_nonfinite_grad``): a cheap, precise alternative to
            ``torch.autograd.detect_anomaly``.
        counts: also report the NaN and Inf element counts (``nan``, ``inf``; free: the fused pass counts them).
        views: also watch reshapes, permutes, slices and selections (``fxdebug.authoring.is_view``); off by
            default, since they only rearrange values their input already had.
        samples: also keep which batch rows / (batch, position) tokens were non-finite the first
            time each node went non-finite (``report().origin_samples``, ``origin_tokens``); one more
            reduction per node and call.
        where: limit the watched nodes (globs over module paths / node names, or a predicate).
        history: also keep the last ``history`` calls' statistics of every watched node in a ring
            buffer on the device (a flight recorder; ``report().history``; see ``Recorder``).
        on_nonfinite: a callable ``f(report)`` or a path: fires at the end of the first call with a
            NaN/Inf, reading one device flag per call (the one sync this option costs).
    """

    name = "nan-check"
    observe_only = True

    def __init__(self, mode: str = "record", backward: bool = False, *, counts: bool = False, views: bool = False,
                 where: Where = None, history: int | None = None, on_nonfinite: Any = None,
                 samples: bool = False) -> None:
        super().__init__(where=where)
        opts = Options(self)
        self.mode = opts.choice("mode", mode, ("record", "raise"),
                                doc="'record' (no host sync) or 'raise' (stop at the first NaN/Inf)")
        self.backward, self.counts = opts.flag("backward", backward), opts.flag("counts", counts)
        self.views, self.samples = opts.flag("views", views), opts.flag("samples", samples)
        self.history = opts.number("history", history, low=1, integer=True, none=True)
        from .recorder import on_nonfinite_option

        self.on_nonfinite = on_nonfinite_option(opts, on_nonfinite)

    @property
    def shares_instances(self) -> bool:  # type: ignore[override]
        """Its probes keep identities; the recorder behind ``history=`` / ``on_nonfinite=`` is a module of its own,
        per graph."""
        return self.history is None and self.on_nonfinite is None

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        added = []
        skip_views = None if self.views else (lambda n: not is_view(n, gm))
        nodes = ctx.nodes(gm, ops=_OPS, float_outputs=True, predicate=skip_views)
        for node in nodes:
            added.append(ctx.observe(node, self._probe(gm, node)))
            if self.samples:
                ctx.observe(node, SamplesProbe())
        if self.history is not None or self.on_nonfinite is not None:
            added += fxdebug.numerics.add_recorder(gm, ctx, nodes, self.history or 1, self.on_nonfinite)
        return PassResult(gm, added=added)

    def _probe(self, gm: GraphModule, node: Node) -> Probe:
        if self.mode == "record":
            return NonFiniteProbe(grads=self.backward, counts=self.counts)
        inputs = [a.name for a in node.all_input_nodes if not is_instrumentation(a)]
        return RaisingProbe(grads=self.backward, counts=self.counts, node=node, inputs=inputs,
                            module=get_module(gm, node))
