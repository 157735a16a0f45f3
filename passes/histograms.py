"""``Histograms``: value histograms of node outputs (and gradients), with fixed bins on the device.

For ``Report.to_tensorboard`` (TensorBoard's histogram and distribution tabs) and for eyeballing a
distribution the summary statistics hide (bimodal activations, saturated tanh, a spike at 0).

The bins are fixed once per node and phase, on the device, with no host sync: either the
``range=(lo, hi)`` given, or the first call's min..max widened by 5 % each side (computed with
tensor ops). Two open bins catch what falls below and above later, so nothing is dropped. Each
call adds the bucket counts of the output (an arithmetic bucket index — the bins are uniform —
and ``bincount``) into a float64 count vector; on tensors above
65,536 elements the counts come from the same fixed systematic sample the other sampled
statistics read (``fxdebug.authoring.systematic_sample``), so a histogram holds the *shape* of the
distribution, and ``num`` says how many values it counted.

Usable on its own (``Histograms()``), or through ``StatCollector(histograms=True)``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule

from fxdebug.authoring import (
    HIDDEN, Column, ObservationContext, Options, Pass, PassContext, PassResult, Probe, Reductions, Where, is_view,
)

__all__ = ["HistogramProbe", "Histograms"]

_TOP = sys.float_info.max  # TensorBoard's right edge of the last (open) bucket


class HistogramProbe(Probe):
    """Counts one node's values (and gradient) into fixed bins; the row key is ``hist`` / ``grad_hist``.

    The summary is a dict: ``limits`` (right edge of each bucket, the first open below, the last
    open above), ``counts``, ``min``, ``max``, ``num``, ``sum``, ``sum_squares`` — the fields of
    TensorBoard's ``add_histogram_raw``.
    """

    key = "histogram"
    columns = (Column("hist", roles=HIDDEN, phase="both", doc="value histogram (fixed bins): limits and counts"),)

    def __init__(self, bins: int = 64, range: tuple[float, float] | None = None, grads: bool = False) -> None:
        self.bins = bins
        self.range = range
        self.grads = grads

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        f64 = dict(dtype=torch.float64, device=x.device)
        edges = None
        if self.range is not None:
            edges = torch.linspace(float(self.range[0]), float(self.range[1]), self.bins + 1, dtype=torch.float32,
                                   device=x.device)
        return {"counts": torch.zeros(self.bins + 2, **f64), "edges": edges,
                "acc": torch.zeros(3, **f64),  # values counted, sum, sum of squares
                "lo": torch.full((), float("inf"), **f64), "hi": torch.full((), float("-inf"), **f64)}

    def _edges(self, lo: Tensor, hi: Tensor) -> Tensor:
        """``bins + 1`` edges over [lo, hi] widened by 5 %, as device tensor ops (no sync)."""
        lo = torch.nan_to_num(lo.float(), nan=0.0, posinf=1.0, neginf=-1.0)
        hi = torch.nan_to_num(hi.float(), nan=0.0, posinf=1.0, neginf=-1.0)
        span = torch.clamp(hi - lo, min=1e-6)
        lo, hi = lo - 0.05 * span, hi + 0.05 * span
        steps = torch.arange(self.bins + 1, dtype=torch.float32, device=lo.device) / self.bins
        return lo + (hi - lo) * steps

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        if r.x.numel() == 0:
            return
        if state["edges"] is None:
            state["edges"] = self._edges(r["min"], r["max"])
        sample = r["sample"].reshape(-1).contiguous()  # gradients of a sum() are expanded (stride 0)
        values = sample if sample.dtype == torch.float32 else sample.float()
        edges = state["edges"]
        # Uniform bins: the bucket index is arithmetic (20x cheaper than bucketize on CPU). Bucket i
        # holds (e[i-1], e[i]]; 0 holds x <= e[0], bins + 1 holds x > e[bins] and NaN.
        pos = torch.ceil((values - edges[0]) * (self.bins / (edges[-1] - edges[0])))
        pos = torch.nan_to_num(pos, nan=float(self.bins + 1)).clamp_(0, self.bins + 1)
        idx = pos.to(torch.int64)
        state["counts"].add_(torch.bincount(idx, minlength=self.bins + 2)[: self.bins + 2].to(torch.float64))
        n = torch.full((), float(values.numel()), dtype=torch.float64, device=values.device)  # filled there: no copy
        state["acc"].add_(torch.stack([n, values.sum(dtype=torch.float64), torch.dot(values, values).double()]))
        torch.minimum(state["lo"], r["min"].to(torch.float64), out=state["lo"])
        torch.maximum(state["hi"], r["max"].to(torch.float64), out=state["hi"])

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        if state["counts"].device.type == "meta" or state["edges"] is None:
            return {}
        edges = state["edges"].double().tolist()
        num, total, squares = state["acc"].tolist()
        return {"hist": {
            "limits": edges + [_TOP],  # bucket 0 ends at edges[0] (open below), the last is open above
            "counts": state["counts"].tolist(),
            "min": float(state["lo"]), "max": float(state["hi"]),
            "num": num, "sum": total, "sum_squares": squares,
        }}


class Histograms(Pass):
    """Value histograms of every selected node's output (and with ``grads=True`` its gradient).

    Args:
        bins: bins between the edges (two open bins are added, below and above).
        range: fixed ``(lo, hi)`` for every node; ``None`` takes each node's first call's range.
        grads: also histogram the gradient flowing into each node's output.
        views: also watch reshapes and other views (their values repeat their input's).
        where: limit the watched nodes.
    """

    name = "histograms"
    observe_only = True
    shares_instances = True  # one config-only probe per node: a block's copies share the work

    def __init__(self, bins: int = 64, *, range: tuple[float, float] | None = None, grads: bool = False,
                 views: bool = False, where: Where = None) -> None:
        opts = Options(self)
        self.bins = opts.number("bins", bins, low=1, integer=True, doc="the number of bins, an int >= 1")
        lo_hi = opts.iterable("range", range, (int, float), what="two numbers (lo, hi), lo < hi", example="(-3.0, 3.0)",
                              none=True)
        if lo_hi is not None and not (len(lo_hi) == 2 and float(lo_hi[0]) < float(lo_hi[1])):
            raise opts.error("range", range, "two numbers (lo, hi) with lo < hi, or None", wrong_kind=False)
        super().__init__(where=where)
        self.range = None if lo_hi is None else (float(lo_hi[0]), float(lo_hi[1]))
        self.grads, self.views = opts.flag("grads", grads), opts.flag("views", views)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        skip_views = None if self.views else (lambda n: not is_view(n, gm))
        added = [ctx.observe(n, HistogramProbe(self.bins, self.range, self.grads))
                 for n in ctx.nodes(gm, float_outputs=True, predicate=skip_views)]
        return PassResult(gm, added=added)
