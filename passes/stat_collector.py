"""``StatCollector``: activation (and gradient) statistics of every node, over a whole data set.

Per node and call it reads cheap single-pass reductions of the output, shared with any other
probe on the node (``NaNCheck`` reads the same sum): sum, L2 norm, min, and the max taken per
channel where the output has channels (which makes the dead-channel fraction free). It adds them
in place into a fixed-size float64 state on the device; nothing is read back to the host before
the report.

Derived numbers: ``mean``, ``std`` (population, over every element seen), ``min``, ``max``,
``mean_abs``, ``zero_frac``, ``norm`` (mean per-call L2 norm), ``dead_frac`` (share of
channels never positive over everything seen: the dead-ReLU signal), and with ``counts=True``
exact ``nan`` / ``inf`` element counts. With ``grads=True`` the same for the gradient flowing
into each node's output, as ``grad_*`` columns (``grad_norm``: vanishing/exploding gradients).

``mean_abs`` and ``zero_frac`` need kernels that cost 5-15 sums each on CPU (``abs`` with a
temporary, a comparison and count), so on tensors above 65,536 elements they are estimated from
a fixed systematic sample (64 contiguous blocks spread over the whole tensor; the row says
``sampled_frac``); a fraction estimated that way is within about ±0.5 % (one standard error) of
the exact one. ``StatCollector(exact=True)`` computes them over every element. Everything else is
exact.

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
from fxdebug import COLOR, HIDDEN, Column, ObservationContext, PassContext, PassResult, Probe, Reductions, Where

from .nan_check import read

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
        if any(fxdebug.is_kind(cur, k, gm) for k in _CHANNEL_FIRST):
            return 1
        if fxdebug.is_linear(cur, gm) or cur.op == "placeholder":
            return -1
        inputs = [a for a in cur.all_input_nodes if a.op != "get_attr"]
        cur = inputs[0] if inputs else None
    return -1


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
        Column("dead_frac", roles=COLOR, threshold=0.5, doc="share of channels never positive (dead ReLU units)"),
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


class StatsProbe(Probe):
    """Accumulates the statistics of one node's output (and gradient); see the module docstring.

    State is fixed-size and updated in place on the watched tensor's device: ``acc`` (float64:
    sum, L2 norm, squared L2 norm, sum of |x| over the sample, zeros in the sample), ``counts``
    (float64: elements, sampled elements, calls), ``lo`` (running min) and ``hi`` (running max,
    per channel where there are channels). Nothing grows with the number of calls, nothing is read
    back before the report, and ``torch.compile`` sees the same state on every call.
    """

    key = "stats"

    def __init__(self, *, grads: bool = False, counts: bool = False, channel_dim: int | None = None,
                 exact: bool = False) -> None:
        self.grads = grads
        self.counts = counts
        self.channel_dim = channel_dim
        self.exact = exact
        self.columns = stats_columns(counts)
        self._count_vectors: dict[tuple[int, int, torch.device], Tensor] = {}

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        f64 = dict(dtype=torch.float64, device=x.device)
        state: dict[str, Any] = {
            "acc": torch.zeros(5, **f64),
            "counts": torch.zeros(3, **f64),
            "lo": torch.full((), math.inf, **f64),
            "hi": None,
            "eps": torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps,
        }
        if self.counts:
            state["nan"] = torch.zeros((), dtype=torch.int64, device=x.device)
            state["inf"] = torch.zeros((), dtype=torch.int64, device=x.device)
        return state

    def _count_vector(self, numel: int, sampled: int, device: torch.device) -> Tensor:
        """``[numel, sampled, 1]`` as a device tensor, made once per shape (no per-call copy)."""
        if torch.compiler.is_compiling():  # a constant in the compiled graph; caching it would alias state
            return torch.tensor([numel, sampled, 1], dtype=torch.float64, device=device)
        key = (numel, sampled, device)
        vec = self._count_vectors.get(key)
        if vec is None:
            vec = self._count_vectors[key] = torch.tensor([numel, sampled, 1], dtype=torch.float64).to(device)
        return vec

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        if r.x.numel() == 0:
            return
        sumsq = r["sumsq"]
        norm2 = r["norm2"]
        if self.exact:
            abs_sum, zeros, sampled = r["norm1"], r["numel"] - r["nonzero"], r.x.numel()
        else:
            abs_sum, zeros, sampled = r["sample_norm1"], r["sample_zeros"], r["sample_numel"]
        vec = torch.stack([r["sum"], norm2, sumsq, abs_sum, zeros.to(norm2.dtype)])
        state["acc"].add_(vec)
        state["counts"].add_(self._count_vector(r.x.numel(), sampled, vec.device))
        lo, hi = r.extremes()
        torch.minimum(state["lo"], lo, out=state["lo"])
        old = state["hi"]
        if old is None or old.shape != hi.shape:  # first call, or the channel count changed
            state["hi"] = hi.to(torch.float64) if old is None else torch.maximum(old.max(), hi.max()).to(torch.float64)
        else:
            torch.maximum(old, hi, out=old)
        if self.counts:
            state["nan"].add_(r["nan"])
            state["inf"].add_(r["inf"])

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        if state["acc"].device.type == "meta":
            return {}
        n, sampled, calls = state["counts"].tolist()
        if n == 0:
            return {"count": 0}
        s, norm_sum, sq, l1, zeros = state["acc"].tolist()
        hi = state["hi"]
        mean = s / n
        var = sq / n - mean * mean
        if var <= 8 * state["eps"] * (sq / n):  # below what the per-call float32 sums can resolve
            var = 0.0
        out: dict[str, Any] = {
            "count": int(n),
            "calls": int(calls),
            "mean": mean,
            "std": math.sqrt(var) if math.isfinite(var) else math.nan,
            "min": read(state["lo"]),
            "max": read(hi.max()) if hi is not None else None,
            "mean_abs": l1 / sampled if sampled else None,
            "zero_frac": zeros / sampled if sampled else None,
            "norm": norm_sum / calls if calls else None,
        }
        if sampled < n:
            out["sampled_frac"] = sampled / n
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
        views: also watch reshapes, permutes, slices and selections (``fxdebug.is_view``); off by
            default, since their statistics repeat their input's.
        exact: compute ``mean_abs`` and ``zero_frac`` over every element instead of a sample on
            tensors above 65,536 elements (slower on CPU; see the module docstring).
        channel_dim: ``"auto"`` (see ``channel_dim_of``), an int for every node, or ``None`` to
            skip per-channel statistics (dead fraction).
        where: limit the watched nodes (globs over module paths / node names, or a predicate).
    """

    name = "stat-collector"
    observe_only = True

    def __init__(self, grads: bool = False, *, counts: bool = False, exact: bool = False,
                 channel_dim: int | str | None = "auto", views: bool = False, where: Where = None) -> None:
        super().__init__(where=where)
        for flag, value in (("grads", grads), ("counts", counts), ("exact", exact), ("views", views)):
            if not isinstance(value, bool):  # grads="yes" would be truthy, and so would grads="no"
                raise fxdebug.UsageError(f"StatCollector({flag}={value!r}): {flag} must be True or False.")
        if not (channel_dim is None or channel_dim == "auto" or (isinstance(channel_dim, int) and not isinstance(channel_dim, bool))):
            raise fxdebug.UsageError(f"StatCollector(channel_dim={channel_dim!r}): use an int, None or 'auto'.")
        self.views = views
        self.grads, self.counts, self.exact, self.channel_dim = grads, counts, exact, channel_dim

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        added = []
        skip_views = None if self.views else (lambda n: not fxdebug.is_view(n, gm))
        for node in ctx.nodes(gm, self.where, float_outputs=True, predicate=skip_views):
            spec = ctx.tensor_spec(node)
            ndim = len(spec.shape) if spec is not None else 0
            if self.channel_dim == "auto":
                cdim = channel_dim_of(node, ndim, gm)
            else:
                cdim = self.channel_dim if ndim >= 2 else None  # type: ignore[assignment]
            added.append(ctx.observe(node, StatsProbe(grads=self.grads, counts=self.counts, channel_dim=cdim, exact=self.exact)))
        return PassResult(gm, added=[a for a in added if a is not None])
