"""``Report.to_tensorboard(writer, step)``: a report as TensorBoard scalars and histograms.

Tags are grouped by module path, so TensorBoard's cards fold by top-level module and one layer's
numbers sit together: ``layer1/0/conv1/layer1_0_conv1/mean``. Nodes of the root module go under
``root/``. Per node, where the report has them:

* every number of a declared, shown column (``Column``; not ``HIDDEN``), on the rows the column
  applies to (``Column.only``: a dead fraction only after activations) — ``mean``, ``std``,
  ``grad_norm`` (``StatCollector``), the parameter-gradient norms (``ParamGrads``), ``time_ms``
  (``Profile``), a user's probe's columns alike;
* ``max_abs`` (max(|min|, |max|)) and ``grad_max_abs`` where the row has ``min`` / ``max``;
* histograms: every declared column whose value is a collected histogram (a dict with ``num``,
  ``limits``, ``counts``, ...: ``Histograms`` or ``StatCollector(histograms=True)``) through
  ``add_histogram_raw``, bins exactly as collected.

``writer`` is a ``torch.utils.tensorboard.SummaryWriter`` (or anything with ``add_scalar`` and
``add_histogram_raw``, such as tensorboardX's). Call it once per epoch or every N steps with that
step; ``collect`` + ``to_tensorboard`` after each validation pass gives per-layer curves over training.
"""

from __future__ import annotations

import math
from typing import Any

from fxdebug.runtime.columns import BASE_COLUMNS, Column

__all__ = ["tag_of", "to_tensorboard"]

_BASE = {c.key for c in BASE_COLUMNS}
_HISTOGRAM = {"min", "max", "num", "sum", "sum_squares", "limits", "counts"}


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


def _scalars(row: dict[str, Any], columns: list[Column]) -> dict[str, float]:
    out: dict[str, float] = {}
    for col in columns:
        if col.key in _BASE or not col.shown or not col.applies(row):
            continue
        v = _finite(row.get(col.key))
        if v is not None:
            out[col.key] = v
    for name, lo, hi in (("max_abs", "min", "max"), ("grad_max_abs", "grad_min", "grad_max")):
        a, b = _finite(row.get(lo)), _finite(row.get(hi))
        if a is not None and b is not None:
            out[name] = max(abs(a), abs(b))
    return out


def to_tensorboard(report: Any, writer: Any, step: int = 0, *, prefix: str | None = None,
                   histograms: bool = True) -> int:
    """Write ``report`` to ``writer`` at ``step``; returns the number of values written.

    Args:
        prefix: put every tag under ``<prefix>/`` (e.g. ``"val"`` vs ``"train"``).
        histograms: also write the collected histograms (columns whose values are histogram dicts).
    """
    if not hasattr(writer, "add_scalar"):
        from fxdebug.errors import UsageError

        raise UsageError(f"to_tensorboard needs a SummaryWriter (torch.utils.tensorboard); got {type(writer).__name__}.")
    written = 0
    columns = list(getattr(report, "columns", None) or [])
    for row in report.rows:
        for name, value in _scalars(row, columns).items():
            writer.add_scalar(tag_of(row, name, prefix), value, step)
            written += 1
        if not histograms:
            continue
        for col in columns:
            key, h = col.key, row.get(col.key)
            if not isinstance(h, dict) or not h.get("num") or not _HISTOGRAM <= set(h):
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
