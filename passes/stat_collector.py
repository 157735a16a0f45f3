"""``StatCollector``: activation (and gradient) statistics of every node, over a whole data set.

Per node and call it reads five single-pass reductions of the output, shared with any other
probe on the node: sum, L2 norm, sum of |x|, nonzero count, min — and the max, taken per channel
where the output has channels (that is what makes the dead-channel fraction free). It stacks
them into one small tensor and keeps a reference; every 64 calls, and when the report is read,
the pending values are folded into float64 running totals with a few tensor ops. Nothing reads
a value back to the host before the report.

Derived numbers: ``mean``, ``std`` (population, over every element seen), ``min``, ``max``,
``mean_abs``, ``zero_frac``, ``norm`` (mean per-call L2 norm), ``dead_frac`` (share of
channels never positive over everything seen: the dead-ReLU signal), and with ``counts=True``
exact ``nan`` / ``inf`` element counts. With ``grads=True`` the same for the gradient flowing
into each node's output, as ``grad_*`` columns (``grad_norm``: vanishing/exploding gradients).

``std`` comes from running sums of x and x² (one pass each, where a Welford pass would be several
times slower on CPU): its resolution is about 1e-3 of the root-mean-square (float32 sums per
call), so a std below that is reported as 0 — plenty unless |mean| dwarfs std.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

import fxdebug
from fxdebug import ObservationContext, PassContext, PassResult, Probe, Reductions, Where

from .nan_check import read

__all__ = ["StatCollector", "channel_dim_of"]

_FOLD_EVERY = 64
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
        if any(fxdebug.is_kind(cur, k, gm) for k in _CHANNEL_FIRST):
            return 1
        if fxdebug.is_linear(cur, gm) or cur.op == "placeholder":
            return -1
        inputs = [a for a in cur.all_input_nodes if a.op != "get_attr"]
        cur = inputs[0] if inputs else None
    return -1


class StatsProbe(Probe):
    """Accumulates the statistics of one node's output (and gradient); see the module docstring."""

    key = "stats"

    def __init__(self, *, grads: bool = False, counts: bool = False, channel_dim: int | None = None) -> None:
        self.grads = grads
        self.counts = counts
        self.channel_dim = channel_dim

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        f64 = dict(dtype=torch.float64, device=x.device)
        state: dict[str, Any] = {
            "pending": [], "count": 0, "calls": 0,
            "acc": torch.zeros(5, **f64),  # sum, sum of squares, sum |x|, nonzero, sum of per-call norms
            "lo": torch.full((), math.inf, **f64), "hi": None,
            "eps": torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps,
        }
        if self.counts:
            state["nan"] = torch.zeros((), dtype=torch.int64, device=x.device)
            state["inf"] = torch.zeros((), dtype=torch.int64, device=x.device)
        return state

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        if r.x.numel() == 0:
            return
        lo, hi = r.extremes()
        vec = torch.stack([r["sum"], r["norm2"], r["norm1"], lo])
        state["pending"].append((vec, r["nonzero"], hi))
        state["count"] += r.x.numel()
        state["calls"] += 1
        if self.counts:
            state["nan"].add_(r["nan"])
            state["inf"].add_(r["inf"])
        if len(state["pending"]) >= _FOLD_EVERY:
            self.fold(state)

    @staticmethod
    def fold(state: dict[str, Any]) -> None:
        """Fold pending per-call vectors into the float64 running totals (tensor ops only)."""
        pending = state["pending"]
        if not pending:
            return
        v = torch.stack([vec for vec, _, _ in pending]).to(torch.float64)  # (K, 4)
        nonzero = torch.stack([nz for _, nz, _ in pending]).to(torch.float64)
        norms = v[:, 1]
        totals = torch.stack([v[:, 0], norms * norms, v[:, 2], nonzero, norms], dim=1).sum(dim=0)
        state["acc"] = state["acc"] + totals
        state["lo"] = torch.minimum(state["lo"], v[:, 3].amin())
        by_shape: dict[tuple[int, ...], list[Tensor]] = {}
        for _, _, hi in pending:
            by_shape.setdefault(tuple(hi.shape), []).append(hi)
        for shape, his in by_shape.items():
            top = torch.stack(his).amax(dim=0).to(torch.float64)
            old = state["hi"]
            state["hi"] = top if old is None or tuple(old.shape) != shape else torch.maximum(old, top)
        pending.clear()

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        self.fold(state)
        n, calls = state["count"], state["calls"]
        if n == 0 or state["acc"].device.type == "meta":
            return {"count": n}
        s, sq, l1, nnz, norm_sum = state["acc"].tolist()
        hi = state["hi"]
        mean = s / n
        var = sq / n - mean * mean
        if var <= 8 * state["eps"] * (sq / n):  # below what the per-call float32 sums can resolve
            var = 0.0
        out: dict[str, Any] = {
            "count": n,
            "mean": mean,
            "std": math.sqrt(var) if math.isfinite(var) else math.nan,
            "min": read(state["lo"]),
            "max": read(hi.max()) if hi is not None else None,
            "mean_abs": l1 / n,
            "zero_frac": 1.0 - nnz / n,
            "norm": norm_sum / calls if calls else None,
        }
        if phase == "forward" and self.channel_dim is not None and hi is not None and hi.dim() == 1:
            out["dead_frac"] = read((hi <= 0).to(torch.float64).mean())
            out["channels"] = hi.numel()
        if self.counts:
            out["nan"], out["inf"] = read(state["nan"]), read(state["inf"])
        return out


class StatCollector(fxdebug.Pass):
    """Statistics of every node's output (and with ``grads=True`` its gradient), accumulated on
    the device over every call since ``reset()``; see ``Report`` for the columns.

    Args:
        grads: also collect the statistics of the gradient w.r.t. each node's output.
        counts: also count NaN and Inf elements exactly (two extra passes per node and call).
        channel_dim: ``"auto"`` (see ``channel_dim_of``), an int for every node, or ``None`` to
            skip per-channel statistics (dead fraction).
        where: limit the watched nodes (globs over module paths / node names, or a predicate).
    """

    name = "stat-collector"
    observe_only = True

    def __init__(self, grads: bool = False, *, counts: bool = False, channel_dim: int | str | None = "auto",
                 where: Where = None) -> None:
        super().__init__(where=where)
        self.grads, self.counts, self.channel_dim = grads, counts, channel_dim

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        added = []
        for node in ctx.nodes(gm, self.where, float_outputs=True):
            spec = ctx.tensor_spec(node)
            ndim = len(spec.shape) if spec is not None else 0
            if self.channel_dim == "auto":
                cdim = channel_dim_of(node, ndim, gm)
            else:
                cdim = self.channel_dim if ndim >= 2 else None  # type: ignore[assignment]
            added.append(ctx.observe(node, StatsProbe(grads=self.grads, counts=self.counts, channel_dim=cdim)))
        return PassResult(gm, added=[a for a in added if a is not None])
