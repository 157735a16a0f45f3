"""Gradient-flow and activation-range figures of a ``Report`` (matplotlib, no pyplot state).

``gradient_flow`` is the ``plot_grad_flow`` every guide pastes — bars of max and mean |gradient|
per layer in execution order — drawn from the report instead of a loop over
``named_parameters()``, on a log scale, with the bands where ``Report.findings`` calls gradients
vanishing or exploding. ``activations`` draws each node's range (min..max as a line, mean ± std
as a box) and, on a second axis, the dead fraction of activation nodes.

Both return a ``Plot`` holding the path, the x labels and the exact series drawn, so callers (and
tests) can read what the picture shows. Figures are built with ``matplotlib.figure.Figure`` and
never touch pyplot's global state or backend.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from fxdebug.errors import UsageError
from fxdebug.report.findings import FindingRules, grad_figures
from fxdebug.runtime.columns import COLOR

__all__ = ["Plot", "activations", "gradient_flow"]

_FLOOR = 1e-12  # the axis reaches at least this low (lower when a gradient is smaller)
_FORMATS = ("png", "svg", "pdf")


@dataclass
class Plot:
    """What a figure shows: ``labels`` along x (execution order), ``series`` by name, the ``bands``."""

    path: str
    labels: list[str]
    nodes: list[str]
    series: dict[str, list[float | None]] = field(default_factory=dict)
    bands: dict[str, tuple[float, float]] = field(default_factory=dict)
    title: str = ""
    figure: Any = None  # the matplotlib Figure (already saved)


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("fxdebug.plot needs matplotlib: pip install 'fxdebug[plot]' (or pip install matplotlib).") from None
    return matplotlib, Figure


def _check_path(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    suffix = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if suffix not in _FORMATS:
        raise UsageError(f"plot path {path!r}: the suffix picks the format; use one of "
                         f"{', '.join('.' + f for f in _FORMATS)}.")
    return path


def _label(row: dict[str, Any]) -> str:
    module = row.get("module") or ""
    return f"{module} ({row['node']})" if module and module.replace(".", "_") != row["node"] else (module or row["node"])


def _save(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, format=path.rsplit(".", 1)[-1].lower(), dpi=110, metadata=_metadata(path))


def _metadata(path: str) -> dict[str, Any]:
    fmt = path.rsplit(".", 1)[-1].lower()
    if fmt == "svg":
        return {"Date": None}  # reproducible files: no timestamp
    if fmt == "png":
        return {"Software": "fxdebug"}
    return {}


def gradient_flow(report: Any, path: str | os.PathLike[str], *, vanishing: float | None = None,
                  exploding: float | None = None, title: str | None = None) -> Plot:
    """Bars of max and mean |gradient| per layer, in execution order, with the vanishing/exploding bands.

    Parameter gradients (``ParamGrads``) when the report has them, else the gradients of node
    outputs (``StatCollector(grads=True)``). ``vanishing`` / ``exploding`` default to
    ``FindingRules``' thresholds, so the picture and ``Report.findings()`` agree.
    """
    path = _check_path(path)
    source, items = grad_figures(report)
    if not items:
        raise UsageError("gradient_flow: the report has no gradient statistics. Instrument with ParamGrads() "
                         "(parameter gradients) or StatCollector(grads=True), and run a backward "
                         "(fxdebug.collect(dbg, loader, loss_fn=...)).")
    rules = FindingRules()
    lo = rules.vanishing if vanishing is None else vanishing
    hi = rules.exploding if exploding is None else exploding
    _, Figure = _matplotlib()
    labels = [_label(r) for r, _, _ in items]
    maxes: list[float | None] = [g for _, g, _ in items]
    means = [m for _, _, m in items]
    n = len(items)
    fig = Figure(figsize=(max(6.0, 0.32 * n + 1.5), 4.8))
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(n))

    finite = [v for v in maxes + means if v is not None and math.isfinite(v) and v > 0]
    # the axis reaches below the smallest real value: a gradient of 1e-30 is drawn at 1e-30, so the
    # decay the picture exists to show stays visible (zeros are marked, they have no log height)
    bottom = min([_FLOOR * 10, lo / 100] + [v / 10 for v in finite])
    top = max([hi * 100] + [v * 10 for v in finite])

    def draw(v: float | None) -> float:
        return v if v is not None and math.isfinite(v) and v > 0 else bottom

    ax.bar(xs, [draw(v) for v in maxes], width=0.8, color="#9ecae1", label="max |g|", zorder=2)
    ax.bar(xs, [draw(v) for v in means], width=0.45, color="#08519c", label="mean |g|", zorder=3)
    ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    zeros = [x for x, v in zip(xs, maxes) if v is not None and math.isfinite(v) and v <= 0]
    if zeros:  # a zero gradient has no bar on a log axis: mark it on the floor
        ax.plot(zeros, [bottom * 3] * len(zeros), "x", color="#cb181d", markersize=9, mew=2, zorder=4,
                label="zero gradient")
    ax.axhspan(bottom, lo, color="#fdd0a2", alpha=0.6, zorder=1, label=f"vanishing (< {lo:.0e})")
    ax.axhspan(hi, top, color="#fcbba1", alpha=0.6, zorder=1, label=f"exploding (> {hi:.0e})")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("|gradient|")
    what = f"{source} per node" if source != "gradients" else "gradients of node outputs"
    heading = title or f"gradient flow — {what}, input → output"
    ax.set_title(heading, fontsize=10)
    ax.grid(axis="y", which="major", alpha=0.3, zorder=0)
    ax.legend(loc="upper right", fontsize=7, framealpha=0.9)
    _save(fig, path)
    return Plot(path=path, labels=labels, nodes=[r["node"] for r, _, _ in items],
                series={"max_abs": maxes, "mean_abs": means}, bands={"vanishing": (bottom, lo), "exploding": (hi, top)},
                title=heading, figure=fig)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)) else None


def activations(report: Any, path: str | os.PathLike[str], *, title: str | None = None) -> Plot:
    """Each node's activation range (min..max line, mean ± std box, mean dot) in execution order,
    with the first ``COLOR`` column the rows fill (``StatCollector``: the dead fraction, on
    activations only) as red bars on a second axis (0..1)."""
    path = _check_path(path)
    rows = [r for r in report.rows if _num(r.get("min")) is not None and _num(r.get("max")) is not None]
    if not rows:
        raise UsageError("activations: the report has no activation statistics. Instrument with StatCollector() and "
                         "run the model (fxdebug.collect(dbg, loader)).")
    _, Figure = _matplotlib()
    n = len(rows)
    labels = [_label(r) for r in rows]
    lows = [_num(r.get("min")) for r in rows]
    highs = [_num(r.get("max")) for r in rows]
    means = [_num(r.get("mean")) for r in rows]
    stds = [_num(r.get("std")) for r in rows]
    color = next((c for c in report.columns_with(COLOR) if any(_num(r.get(c.key)) is not None for r in rows)), None)
    dead = [(_num(r.get(color.key)) if color.applies(r) else None) if color is not None else None for r in rows]
    share = f"{color.label or color.key} fraction" if color is not None else "fraction"
    fig = Figure(figsize=(max(6.0, 0.32 * n + 1.5), 4.8))
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(n))
    ax.vlines(xs, lows, highs, color="#636363", linewidth=1.2, label="min … max", zorder=2)
    box_lo = [(m - s) if m is not None and s is not None else m for m, s in zip(means, stds)]
    box_h = [2 * s if s is not None else 0.0 for s in stds]
    ax.bar(xs, box_h, bottom=[b if b is not None else 0.0 for b in box_lo], width=0.5, color="#6baed6",
           label="mean ± std", zorder=3)
    ax.plot(xs, [m if m is not None else math.nan for m in means], "o", color="#08306b", markersize=3,
            label="mean", zorder=4)
    spread = [abs(v) for v in lows + highs if v is not None]
    typical = sorted(spread)[len(spread) // 2] if spread else 1.0
    if spread and max(spread) > 100 * max(typical, 1e-12):  # a few huge ranges: keep the small ones readable
        ax.set_yscale("symlog", linthresh=max(typical, 1e-6))
    ax.set_ylabel("activation value")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_xlim(-0.6, n - 0.4)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    ax2 = ax.twinx()
    dead_x = [x for x, d in zip(xs, dead) if d is not None]
    ax2.bar(dead_x, [d for d in dead if d is not None], width=0.7, color="#de2d26", alpha=0.25,
            label=share, zorder=1)
    ax.set_zorder(ax2.get_zorder() + 1)  # the ranges in front of the fraction bars
    ax.patch.set_visible(False)
    ax2.set_ylim(0, 1.0)
    ax2.set_ylabel(share, color="#de2d26")
    heading = title or f"activations — {n} nodes in execution order"
    ax.set_title(heading, fontsize=10)
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="upper right", fontsize=7, framealpha=0.9)
    _save(fig, path)
    return Plot(path=path, labels=labels, nodes=[r["node"] for r in rows],
                series={"min": lows, "max": highs, "mean": means, "std": stds, color.key if color else "color": dead},
                title=heading, figure=fig)
