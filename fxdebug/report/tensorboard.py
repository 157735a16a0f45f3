"""``Report.to_tensorboard(writer, step)``: a report as TensorBoard scalars and histograms.

Tags are grouped by module path, so TensorBoard's cards fold by top-level module and one layer's
numbers sit together: ``layer1/0/conv1/layer1_0_conv1/mean``. Nodes of the root module go under
``root/``. Per node, where the report has them:

* ``mean``, ``std``, ``max_abs`` (max(|min|, |max|)) of the output;
* ``dead_frac`` — only on activation rows, where it means dead units;
* ``grad_norm``, ``grad_max_abs`` — of the gradient into the output (``StatCollector(grads=True)``);
* ``param_grad_norm``, ``param_grad_mean_abs``, ``param_grad_max_abs`` — ``ParamGrads``;
* ``time_ms`` — ``Profile(time=True)``;
* histograms ``hist`` and ``grad_hist`` (``Histograms`` or ``StatCollector(histograms=True)``)
  through ``add_histogram_raw``, bins exactly as collected.

``writer`` is a ``torch.utils.tensorboard.SummaryWriter`` (or anything with ``add_scalar`` and
``add_histogram_raw``, such as tensorboardX's). Call it once per epoch or every N steps with that
step; ``collect`` + ``to_tensorboard`` after each validation pass gives per-layer curves over training.
"""

from __future__ import annotations

import math
from typing import Any

from fxdebug.report.findings import activation_row

__all__ = ["SCALARS", "tag_of", "to_tensorboard"]

SCALARS = ("mean", "std", "max_abs", "dead_frac", "grad_norm", "grad_max_abs", "param_grad_norm",
           "param_grad_mean_abs", "param_grad_max_abs", "time_ms")
"""The scalar names written per node (those the row has)."""


def tag_of(row: dict[str, Any], name: str, prefix: str | None = None) -> str:
    """The tag of statistic ``name`` of ``row``: ``<module/path>/<node>/<name>``."""
    module = (row.get("module") or "").replace(".", "/") or "root"
    tag = f"{module}/{row['node']}/{name}"
    return f"{prefix}/{tag}" if prefix else tag


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in ("mean", "std", "grad_norm", "param_grad_norm", "param_grad_mean_abs", "param_grad_max_abs", "time_ms"):
        v = _finite(row.get(name))
        if v is not None:
            out[name] = v
    for name, lo, hi in (("max_abs", "min", "max"), ("grad_max_abs", "grad_min", "grad_max")):
        a, b = _finite(row.get(lo)), _finite(row.get(hi))
        if a is not None and b is not None:
            out[name] = max(abs(a), abs(b))
    dead = _finite(row.get("dead_frac"))
    if dead is not None and activation_row(row):
        out["dead_frac"] = dead
    return out


def to_tensorboard(report: Any, writer: Any, step: int = 0, *, prefix: str | None = None,
                   histograms: bool = True) -> int:
    """Write ``report`` to ``writer`` at ``step``; returns the number of values written.

    Args:
        prefix: put every tag under ``<prefix>/`` (e.g. ``"val"`` vs ``"train"``).
        histograms: also write the collected histograms (``hist`` / ``grad_hist`` row keys).
    """
    if not hasattr(writer, "add_scalar"):
        from fxdebug.errors import UsageError

        raise UsageError(f"to_tensorboard needs a SummaryWriter (torch.utils.tensorboard); got {type(writer).__name__}.")
    written = 0
    for row in report.rows:
        for name, value in _scalars(row).items():
            writer.add_scalar(tag_of(row, name, prefix), value, step)
            written += 1
        if not histograms:
            continue
        for key in ("hist", "grad_hist"):
            h = row.get(key)
            if not isinstance(h, dict) or not h.get("num"):
                continue
            writer.add_histogram_raw(tag_of(row, key, prefix), min=h["min"], max=h["max"], num=h["num"],
                                     sum=h["sum"], sum_squares=h["sum_squares"],
                                     bucket_limits=list(h["limits"]), bucket_counts=list(h["counts"]),
                                     global_step=step)
            written += 1
    flush = getattr(writer, "flush", None)
    if flush is not None:
        flush()
    return written
