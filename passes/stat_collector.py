"""``StatCollector``: activation (and gradient) statistics of every node, over a whole data set.

Per node and call the graph calls the fused observation op (``torch.ops.fxdebug.observe``, a
C++ kernel on CPU), which reads the output once — shared with ``NaNCheck`` on the same node — and
adds its sum, sum of squares, sum of |x|, min, max, zero/NaN/Inf counts and per-channel max
into the node's fixed-size rows of the graph's float64 state table on the device; nothing is
read back to the host before the report.

Derived numbers: ``mean``, ``std`` (population, over every element seen), ``min``, ``max``,
``mean_abs``, ``zero_frac``, ``norm`` (mean per-call L2 norm), ``dead_frac`` (share of
channels never positive over everything seen: the dead-ReLU signal), and with ``counts=True``
the ``nan`` / ``inf`` element counts. With ``grads=True`` the same for the gradient flowing
into each node's output, as ``grad_*`` columns (``grad_norm``: vanishing/exploding gradients).

Every statistic reads every element (no sampling). Sums are taken in float32 lanes over blocks
of 512 elements and added in float64 (a block that overflows or holds NaN/Inf is redone in
float64), so large finite values (1e36, up to float32's limit) neither overflow the statistics
nor look non-finite. ``std`` comes from the running sums of x and x²: a variance below about
1e-6 of the mean square is reported as 0 — plenty unless |mean| dwarfs std.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from fxdebug.authoring import (
    COLOR, HIDDEN, Column, FindingRule, FusedProbe, FusedStats, Options, Pass, PassContext, PassResult, Where,
    activation_row, is_kind, is_linear, is_view,
)


__all__ = ["StatCollector", "channel_dim_of"]

_CHANNEL_FIRST = ("conv", "batchnorm")


def channel_dim_of(node: Node, ndim: int, gm: GraphModule) -> int | None:
    """Which dim holds channels: 1 for (N, C) and (N, C, H, W...); for 3-d outputs 1 after a
    conv/batch-norm (N, C, L), else -1 (the (N, T, D) of sequence models). ``None`` below 2-d."""
    if ndim < 2:
        return None
    if ndim != 3:
        return 1
    cur: Node | None = node
    for _ in range(8):
        if cur is None:
            break
        if any(is_kind(cur, k, gm) for k in _CHANNEL_FIRST):
            return 1
        if is_linear(cur, gm) or cur.op == "placeholder":
            return -1
        inputs = [a for a in cur.all_input_nodes if a.op != "get_attr"]
        cur = inputs[0] if inputs else None
    return -1


DEAD_UNITS = FindingRule(
    kind="dead_activations",
    message="dead channels: {where}: {pct} of its {channels} channels never positive over {calls} call(s) "
            "(threshold {threshold_pct}).",
    fix="swap it for LeakyReLU (SwapActivation(only_dead={threshold}, where='{node}')), lower the learning rate, "
        "or check the bias/initialisation of the layer before it.",
    option="dead")
"""An activation whose share of never-positive channels reaches the threshold (``findings(dead=...)``)."""


def dead_over_ranks(rows: list[dict[str, Any]]) -> float | None:
    """A channel is dead over all ranks only if its max is <= 0 on every rank: from each rank's
    per-channel maxima (``chan_max``); ``None`` (unknown) when a rank has none."""
    chans: list[Any] = [r.get("chan_max") for r in rows]
    if not all(isinstance(c, (list, tuple)) for c in chans) or len({len(c) for c in chans}) != 1:
        return None
    top = [max(vals) for vals in zip(*chans)]
    return sum(1 for v in top if v <= 0) / len(top) if top else None


@functools.cache  # frozen declarations, shared by every probe (was ~1.7 KB per node)
def stats_columns(counts: bool) -> tuple[Column, ...]:
    """What ``StatCollector`` reports, forward and (``grad_*``) backward."""
    cols = (
        Column("mean", phase="both", doc="mean over every element seen"),
        Column("std", phase="both", doc="population standard deviation over every element seen"),
        Column("min", phase="both", doc="smallest value seen"),
        Column("max", phase="both", doc="largest value seen"),
        Column("mean_abs", phase="forward", doc="mean of |x|"),
        Column("mean_abs", roles=HIDDEN, phase="grad", doc="mean of |grad|"),
        Column("zero_frac", phase="both", doc="share of elements exactly zero"),
        Column("dead_frac", roles=COLOR, threshold=0.5, doc="share of channels never positive (dead ReLU units)",
               label="dead", only=activation_row, merge=dead_over_ranks, finding=DEAD_UNITS),
        Column("norm", phase="both", doc="mean per-call L2 norm"),
        Column("count", roles=HIDDEN, phase="both", doc="elements seen over all calls"),
        Column("calls", roles=HIDDEN, phase="grad", doc="backward calls observed"),
        Column("channels", roles=HIDDEN, doc="channels of the output"),
        Column("sampled_frac", roles=HIDDEN, phase="both", doc="share of elements read by sampled statistics"),
    )
    if counts:
        cols += (Column("nan", phase="both", format="d", doc="NaN elements seen, over all calls"),
                 Column("inf", phase="both", format="d", doc="Inf elements seen, over all calls"))
    return cols


class StatsProbe(FusedProbe):
    """The statistics of one node's output (and gradient); see the module docstring.

    A fused probe: the graph calls ``torch.ops.fxdebug.observe`` once per node and call, which
    reads the tensor once and adds sum, sum of squares, sum of |x|, min, max, zero/NaN/Inf counts
    and the per-channel max into the node's fixed-size rows of the graph's state table, on the
    tensor's device. Nothing grows with the number of calls, nothing is read back before the
    report, and ``torch.compile`` sees the same state on every call.
    """

    key = "stats"

    def __init__(self, *, grads: bool = False, counts: bool = False, channel_dim: int | None = None) -> None:
        self.grads = grads
        self.counts = counts
        self.channel_dim = channel_dim
        self.columns = stats_columns(counts)

    def summary_from(self, s: FusedStats, phase: str) -> dict[str, Any]:
        n, calls = s.count, s.stat_calls
        if n == 0:
            return {"count": 0}
        mean = s.sum / n
        var = s.sumsq / n - mean * mean
        if var <= 8 * _EPS * (s.sumsq / n):  # below what the per-block float32 sums can resolve
            var = 0.0
        out: dict[str, Any] = {
            "count": n,
            "calls": calls,
            "mean": mean,
            "std": math.sqrt(var) if math.isfinite(var) else math.nan,
            "min": s.min,
            "max": s.max,
            "mean_abs": s.abs / n,
            "zero_frac": s.zeros / n,
            "norm": s.norm / calls if calls else None,
        }
        if phase == "forward" and s.chan_max is not None:
            out["dead_frac"] = sum(1 for v in s.chan_max if v <= 0) / len(s.chan_max)
            out["channels"] = len(s.chan_max)
        if self.counts:
            out["nan"], out["inf"] = s.nan, s.inf
        return out


_EPS = torch.finfo(torch.float32).eps


class StatCollector(Pass):
    """Statistics of every node's output (and with ``grads=True`` its gradient), accumulated on
    the device over every call since ``reset()``; see ``Report`` for the columns.

    Args:
        grads: also collect the statistics of the gradient w.r.t. each node's output.
        counts: also report the NaN and Inf element counts (free: the fused pass counts them).
        views: also watch reshapes, permutes, slices and selections (``fxdebug.authoring.is_view``); off by
            default, since their statistics repeat their input's.
        channel_dim: ``"auto"`` (see ``channel_dim_of``), an int for every node, or ``None`` to
            skip per-channel statistics (dead fraction).
        where: limit the watched nodes (globs over module paths / node names, or a predicate).
        histograms: also keep a value histogram per node (and gradient, with ``grads``) in fixed
            bins on the device (``True`` or ``1``: 64 bins, or the number of bins, >= 2); see ``Histograms``.
    """

    name = "stat-collector"
    observe_only = True
    shares_instances = True  # one probe per node, no identity of its own: a block's copies share the work

    def __init__(self, grads: bool = False, *, counts: bool = False,
                 channel_dim: int | str | None = "auto", views: bool = False, where: Where = None,
                 histograms: bool | int = False) -> None:
        super().__init__(where=where)
        opts = Options(self)
        self.grads, self.counts = opts.flag("grads", grads), opts.flag("counts", counts)
        self.views = opts.flag("views", views)
        self.channel_dim = channel_dim if channel_dim is None or channel_dim == "auto" else opts.number(
            "channel_dim", channel_dim, integer=True, doc="an int (the channel dim of every node), None or 'auto'")
        on = histograms if isinstance(histograms, bool) or histograms in (0, 1) and not isinstance(histograms, float) else None
        self.histograms = (64 if opts.flag("histograms", on) else 0) if on is not None else opts.number(
            "histograms", histograms, low=2, integer=True, doc="a flag (True: 64 bins) or a number of bins, an int >= 2")

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        added = []
        skip_views = None if self.views else (lambda n: not is_view(n, gm))
        for node in ctx.nodes(gm, float_outputs=True, predicate=skip_views):
            spec = ctx.tensor_spec(node)
            ndim = len(spec.shape) if spec is not None else 0
            if self.channel_dim == "auto":
                cdim = channel_dim_of(node, ndim, gm)
            else:
                cdim = self.channel_dim if ndim >= 2 else None  # type: ignore[assignment]
            added.append(ctx.observe(node, StatsProbe(grads=self.grads, counts=self.counts, channel_dim=cdim)))
            if self.histograms:
                from .histograms import HistogramProbe

                added.append(ctx.observe(node, HistogramProbe(self.histograms, grads=self.grads)))
        return PassResult(gm, added=added)
