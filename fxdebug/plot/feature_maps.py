"""``fxdebug.plot.feature_maps``: a captured activation's channels as a grid of images.

The hook-based "detective" guides register a forward hook on a conv, stash its output, and plot a
grid of its channels with matplotlib. ``Capture`` already keeps the tensor (and, with
``grads=True``, its gradient); this draws it: one small image per channel of the first sample,
activations in ``viridis``, and — when the gradient was captured — the gradient grid beside it in a
diverging map centred on zero (red positive, blue negative), so "where does the loss push this
channel" reads at a glance.

Layouts: ``(N, C, H, W)`` → the channels of sample 0; ``(N, C, D, H, W)`` → the middle depth
slice; ``(N, C, L)`` → each channel a 1×L strip; ``(N, F)`` → one map of the batch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from fxdebug.errors import UsageError

__all__ = ["FeatureMaps", "feature_maps"]

_FORMATS = ("png", "svg", "pdf")


@dataclass
class FeatureMaps:
    """What was drawn: ``channels`` of ``shape`` (``grad`` True when the gradient grid is there)."""

    path: str
    node: str
    shape: tuple[int, ...]
    channels: int
    grad: bool
    figure: Any = None


def _matplotlib_figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("fxdebug.plot.feature_maps needs matplotlib: pip install 'fxdebug[plot]' "
                          "(or pip install matplotlib).") from None
    return Figure


def _captured(source: Any, node: str) -> tuple[Tensor | None, Tensor | None]:
    """``(activation, gradient)`` of ``node`` from a ``Capture`` pass or an instrumented module."""
    if hasattr(source, "grad") and hasattr(source, "activations"):  # a Capture pass
        try:
            value = source[node]
        except KeyError as exc:
            raise UsageError(f"feature_maps: {exc.args[0]}") from None
        return value, source.grad(node)
    observers = getattr(source, "observers", None)
    if not callable(observers):
        raise UsageError("feature_maps needs a Capture pass or an instrumented module (fxdebug.instrument(..., "
                         f"[Capture([...])])); got {type(source).__name__}.")
    found = {name: obs for name, obs in observers().items() if "capture" in getattr(obs, "probes", {})}
    inside = [o for o in found.values() if o.module_path == node or o.module_path.startswith(node + ".")]
    obs = found.get(node) or (inside[-1] if inside else None)  # a module's output: its last captured node
    if obs is None:
        known = ", ".join(sorted(found)) or "none"
        raise UsageError(f"feature_maps: node {node!r} holds no captured activation (captured: {known}). Instrument "
                         f"with Capture([{node!r}]) (grads=True for the gradient grid) and run the model first.")
    grad = obs.states.get(("capture", "grad"), {}).get("value")
    return obs.states.get(("capture", "forward"), {}).get("value"), grad


def _maps(t: Tensor) -> Tensor:
    """``(C, H, W)`` images from a captured tensor, per the layouts in the module docstring."""
    t = t.detach().float().cpu()
    if t.dim() == 5:
        t = t[0, :, t.shape[2] // 2]
    elif t.dim() == 4:
        t = t[0]
    elif t.dim() == 3:
        t = t[0].unsqueeze(1)
    elif t.dim() == 2:
        t = t.unsqueeze(0)
    elif t.dim() == 1:
        t = t.view(1, 1, -1)
    else:
        raise UsageError(f"feature_maps: cannot draw a tensor of shape {tuple(t.shape)} (a scalar).")
    return t


def _grid(fig_or_sub: Any, maps: Tensor, title: str, cmap: str, symmetric: bool) -> None:
    n = maps.shape[0]
    cols = max(1, math.ceil(math.sqrt(n)))
    rows = math.ceil(n / cols)
    axes = fig_or_sub.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i >= n:
            continue
        img = maps[i].numpy()
        if symmetric:
            lim = float(abs(img).max()) or 1.0
            ax.imshow(img, cmap=cmap, vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        else:
            ax.imshow(img, cmap=cmap, aspect="auto", interpolation="nearest")
        ax.set_title(str(i), fontsize=7)
    fig_or_sub.suptitle(title, fontsize=9)


def feature_maps(dbg_or_capture: Any, node: str, path: str | os.PathLike[str], *, max_channels: int = 32) -> FeatureMaps:
    """Draw the channels of ``node``'s captured activation (and gradient, if captured) to ``path``.

    Args:
        dbg_or_capture: the ``Capture`` pass, or the instrumented module that holds one.
        node: a node name or module path given to ``Capture``.
        path: ``.png``, ``.svg`` or ``.pdf``; the suffix picks the format.
        max_channels: draw at most this many channels (the first ones).
    """
    path = os.fspath(path)
    suffix = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if suffix not in _FORMATS:
        raise UsageError(f"feature_maps path {path!r}: the suffix picks the format; use .png, .svg or .pdf.")
    if max_channels < 1:
        raise UsageError(f"feature_maps: max_channels must be at least 1, got {max_channels}.")
    value, grad = _captured(dbg_or_capture, node)
    if value is None:
        raise UsageError(f"feature_maps: {node!r} has not been captured yet; run the instrumented model first.")
    maps = _maps(value)[:max_channels]
    Figure = _matplotlib_figure()
    n = maps.shape[0]
    cols = max(1, math.ceil(math.sqrt(n)))
    rows = math.ceil(n / cols)
    width = 1.3 * cols * (2 if grad is not None else 1) + 0.5
    fig = Figure(figsize=(width, 1.3 * rows + 0.6))
    shape = tuple(value.shape)
    label = f"{node} {list(shape)}: channels 0-{n - 1}" + (f" of {_maps(value).shape[0]}" if _maps(value).shape[0] > n else "")
    if grad is not None:
        left, right = fig.subfigures(1, 2)
        _grid(left, maps, f"{label} (activation)", "viridis", symmetric=False)
        _grid(right, _maps(grad)[:max_channels], f"{node} (gradient)", "RdBu_r", symmetric=True)
    else:
        _grid(fig, maps, label, "viridis", symmetric=False)
    metadata = {"Date": None} if suffix == "svg" else {"Software": "fxdebug"} if suffix == "png" else {}
    fig.savefig(path, format=suffix, dpi=100, metadata=metadata)
    return FeatureMaps(path, node, shape, n, grad is not None, fig)
