"""``fxdebug.plot.feature_maps``: a captured activation's channels as a grid of images.

The hook-based "detective" guides register a forward hook on a conv, stash its output, and plot a
grid of its channels with matplotlib. ``Capture`` already keeps the tensor (and, with
``grads=True``, its gradient); this draws it: one small image per channel of the first sample,
activations in ``viridis``, and — when the gradient was captured — the gradient grid beside it in a
diverging map centred on zero (red positive, blue negative), so "where does the loss push this
channel" reads at a glance.

Layouts (``layout=``, detected by default): ``"NCHW"`` → the channels of sample 0;
``"NHWC"`` (channels last: Swin, ConvNeXt blocks, TF-style models) → the same images, the last dim
as channels; ``"NTC"`` (transformer tokens, ViT/DeiT/Swin sequences) → one ``h×w`` image per
channel, the tokens laid back on the patch grid (a leading class token dropped); ``"NCL"`` → each
channel a 1×L strip; ``(N, C, D, H, W)`` → the middle depth slice; ``(N, F)`` → one map of the batch.

Detection reads the module that made the activation when the source is an instrumented module
(convolutions, batch norms and pools are channels-first; linear layers, layer norms and attention
work on the last dim) and otherwise the shape: a 4-d tensor whose dims 1 and 2 are equal and
dim 3 is not is channels-last; a 3-d tensor with ``h*w`` or ``h*w + 1`` tokens is a token sequence.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from fxdebug.errors import UsageError

__all__ = ["LAYOUTS", "FeatureMaps", "feature_maps"]

_FORMATS = ("png", "svg", "pdf")
LAYOUTS = ("auto", "NCHW", "NHWC", "NTC", "NCL")
_CHANNELS_FIRST = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.modules.pooling._MaxPoolNd,
                   nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd,
                   nn.modules.pooling._AdaptiveMaxPoolNd, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
_LAST_DIM = (nn.Linear, nn.LayerNorm, nn.MultiheadAttention, nn.Embedding)


@dataclass
class FeatureMaps:
    """What was drawn: ``channels`` of ``shape`` (``grad`` True when the gradient grid is there)."""

    path: str
    node: str
    shape: tuple[int, ...]
    channels: int
    grad: bool
    figure: Any = None
    layout: str = "NCHW"  # how the tensor was read (see LAYOUTS)


def _matplotlib_figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("fxdebug.plot.feature_maps needs matplotlib: pip install 'fxdebug[plot]' "
                          "(or pip install matplotlib).") from None
    return Figure


def _captured(source: Any, node: str) -> tuple[Tensor | None, Tensor | None, nn.Module | None]:
    """``(activation, gradient, module that made it)`` of ``node`` from a ``Capture`` pass or an
    instrumented module (the gradient ``None`` when only activations were captured)."""
    if hasattr(source, "grad") and hasattr(source, "activations"):  # a Capture pass
        try:
            value = source[node]
        except KeyError as exc:
            raise UsageError(f"feature_maps: {exc.args[0]}") from None
        return value, source.grad(node) if getattr(source, "grads", False) else None, None
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
    module = None
    try:
        module = source.get_submodule(obs.module_path) if obs.module_path else None
    except AttributeError:
        module = None
    return obs.states.get(("capture", "forward"), {}).get("value"), grad, module


def _grid_side(tokens: int) -> tuple[int, int] | None:
    """``(side, leading tokens to drop)`` when ``tokens`` is ``s*s`` or ``s*s + 1`` (a class token)."""
    for extra in (0, 1):
        side = math.isqrt(tokens - extra) if tokens - extra > 0 else 0
        if side >= 2 and side * side == tokens - extra:
            return side, extra
    return None


def _layout(t: Tensor, module: nn.Module | None) -> str:
    """The layout of a captured tensor: by the module that made it, else by its shape."""
    if t.dim() == 4:
        if isinstance(module, _CHANNELS_FIRST):
            return "NCHW"
        if isinstance(module, _LAST_DIM) or (t.shape[1] == t.shape[2] != t.shape[3]):
            return "NHWC"
        return "NCHW"
    if t.dim() == 3:
        if isinstance(module, _CHANNELS_FIRST):
            return "NCL"
        if _grid_side(t.shape[1]) is not None:
            return "NTC"
        return "NCL"
    return "NCHW"


def _maps(t: Tensor, layout: str = "NCHW") -> Tensor:
    """``(C, H, W)`` images from a captured tensor, per the layouts in the module docstring."""
    t = t.detach().float().cpu()
    if layout == "NHWC" and t.dim() == 4:
        return t[0].permute(2, 0, 1)
    if layout == "NTC" and t.dim() == 3:
        grid = _grid_side(t.shape[1])
        if grid is None:
            raise UsageError(f"feature_maps(layout='NTC'): {t.shape[1]} tokens do not form a square patch grid "
                             "(h*w, or h*w + 1 with a class token); use layout='NCL' to draw strips.")
        side, extra = grid
        return t[0, extra:].transpose(0, 1).reshape(t.shape[2], side, side)
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


def feature_maps(dbg_or_capture: Any, node: str, path: str | os.PathLike[str], *, max_channels: int = 32,
                 layout: str = "auto") -> FeatureMaps:
    """Draw the channels of ``node``'s captured activation (and gradient, if captured) to ``path``.

    Args:
        dbg_or_capture: the ``Capture`` pass, or the instrumented module that holds one.
        node: a node name or module path given to ``Capture``.
        path: ``.png``, ``.svg`` or ``.pdf``; the suffix picks the format.
        max_channels: draw at most this many channels (the first ones).
        layout: ``"auto"`` (detected: see the module docstring), ``"NCHW"``, ``"NHWC"``, ``"NTC"``
            (tokens) or ``"NCL"``.
    """
    path = os.fspath(path)
    suffix = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if suffix not in _FORMATS:
        raise UsageError(f"feature_maps path {path!r}: the suffix picks the format; use .png, .svg or .pdf.")
    if max_channels < 1:
        raise UsageError(f"feature_maps: max_channels must be at least 1, got {max_channels}.")
    if layout not in LAYOUTS:
        raise UsageError(f"feature_maps(layout={layout!r}): choose one of {', '.join(map(repr, LAYOUTS))}.")
    value, grad, module = _captured(dbg_or_capture, node)
    if value is None:
        raise UsageError(f"feature_maps: {node!r} has not been captured yet; run the instrumented model first.")
    if layout == "auto":
        layout = _layout(value, module)
    every = _maps(value, layout)
    maps = every[:max_channels]
    Figure = _matplotlib_figure()
    n = maps.shape[0]
    cols = max(1, math.ceil(math.sqrt(n)))
    rows = math.ceil(n / cols)
    width = 1.3 * cols * (2 if grad is not None else 1) + 0.5
    fig = Figure(figsize=(width, 1.3 * rows + 0.6))
    shape = tuple(value.shape)
    label = f"{node} {list(shape)} ({layout}): channels 0-{n - 1}" + (f" of {every.shape[0]}" if every.shape[0] > n else "")
    if grad is not None:
        left, right = fig.subfigures(1, 2)
        _grid(left, maps, f"{label} (activation)", "viridis", symmetric=False)
        _grid(right, _maps(grad, layout)[:max_channels], f"{node} (gradient)", "RdBu_r", symmetric=True)
    else:
        _grid(fig, maps, label, "viridis", symmetric=False)
    metadata = {"Date": None} if suffix == "svg" else {"Software": "fxdebug"} if suffix == "png" else {}
    fig.savefig(path, format=suffix, dpi=100, metadata=metadata)
    return FeatureMaps(path, node, shape, n, grad is not None, fig, layout)
