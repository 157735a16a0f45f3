"""``diff``: two reports of one model, aligned node by node; the first node whose statistics part.

Runs to compare: eager vs ``torch.compile``, fp32 vs bf16, before vs after a code change, rank i
vs rank j, one frontend vs another. Rows are aligned in three steps, each on what the previous
left over: by node name (when module path and op agree too); then the remaining rows of both, as
sequences of (module path, op), are matched like lines of two versions of a file (``difflib``):
equal stretches align ("module+op"), and where one stretch was replaced by another (a ReLU
became a GELU, a symbolic ``Linear`` faces an export ``aten.linear``) rows align in order within
the same module ("module"); last, leftover rows align by the order of the same op across the
graph ("op order"). Inserted and deleted ops stay unmatched. Every aligned pair is
compared on the statistics both rows hold (``StatCollector``'s mean/std/min/max/norm, NaN/Inf
counts, gradient statistics, ...): each difference is divided by the tensor's magnitude (the
largest |min|, |max| of the two rows) — fractions (``zero_frac`` and every ``COLOR`` column, which
is a number in [0, 1]) are compared absolutely, and a count of non-finite values (``nan``, ``inf``,
every ``NONFINITE`` column) that differs at all is an infinite divergence. ``HIDDEN`` and ``ORIGIN``
columns are bookkeeping, not statistics, and are not compared.
``first_divergent`` is the first node, in report A's execution order, whose divergence exceeds
``rtol``.
"""

from __future__ import annotations

import difflib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from fxdebug.runtime.columns import BASE_COLUMNS, COLOR, HIDDEN, NONFINITE, ORIGIN

__all__ = ["Diff", "diff"]

_SKIP = {c.key for c in BASE_COLUMNS} | {"count", "grad_count", "grad_calls", "local_err", "acc_err", "err_growth"}
_FRACTIONS = {"zero_frac", "grad_zero_frac"}
_COUNTS = {"nan", "inf", "grad_nan", "grad_inf"}


@dataclass(frozen=True)
class _Kinds:
    """How each row key is compared, from the reports' column declarations."""

    skip: frozenset[str]
    fractions: frozenset[str]
    counts: frozenset[str]

    @classmethod
    def of(cls, *reports: Any) -> "_Kinds":
        columns = [c for r in reports for c in (getattr(r, "columns", None) or [])]
        return cls(skip=frozenset(_SKIP | {c.key for c in columns if c.has(HIDDEN) or c.has(ORIGIN)}),
                   fractions=frozenset(_FRACTIONS | {c.key for c in columns if c.has(COLOR)}),
                   counts=frozenset(_COUNTS | {c.key for c in columns if c.has(NONFINITE)}))


@dataclass
class Diff:
    """Two reports aligned node by node (see the module docstring).

    Attributes:
        rows: one dict per aligned pair (``node_a``, ``node_b``, ``module``, ``op``, ``match`` — how
            it was aligned —, ``divergence``, ``column`` — the statistic that diverged most —, its
            values ``a`` and ``b``, ``diverged``), then one per unmatched row (``match=None``).
        first_divergent: name (in report A) of the first node whose divergence exceeds ``rtol``.
        rtol: the tolerance used.
    """

    rows: list[dict[str, Any]]
    rtol: float
    first_divergent: str | None = None
    unmatched_a: list[str] = field(default_factory=list)
    unmatched_b: list[str] = field(default_factory=list)

    @property
    def aligned(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["match"] is not None]

    @property
    def divergent(self) -> list[str]:
        """Nodes of report A whose statistics diverge beyond ``rtol``, in execution order."""
        return [r["node_a"] for r in self.aligned if r["diverged"]]

    def node_divergence(self, side: str = "a") -> dict[str, float]:
        """``{node name: divergence}`` for report ``side`` ("a" or "b"): what a picture colours by.
        Unmatched nodes are absent."""
        key = "node_a" if side == "a" else "node_b"
        return {r[key]: r["divergence"] for r in self.aligned}

    def row(self, node: str) -> dict[str, Any]:
        for r in self.rows:
            if node in (r["node_a"], r["node_b"]):
                return r
        raise KeyError(f"no diff row for node {node!r}")

    def table(self, max_rows: int = 200) -> str:
        head = (f"fxdebug diff — {len(self.aligned)} aligned nodes, {len(self.unmatched_a)} only in A, "
                f"{len(self.unmatched_b)} only in B, rtol {self.rtol:g}")
        lines = [head, f"first divergent: {self.first_divergent or 'none'}"]
        cols = ("node_a", "node_b", "module", "match", "divergence", "column", "a", "b")
        cells = [[_fmt(r.get(c)) + (" *" if c == "divergence" and r.get("diverged") else "") for c in cols]
                 for r in self.rows[:max_rows]]
        widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
        if len(self.rows) > max_rows:
            lines.append(f"... {len(self.rows) - max_rows} more rows")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (f"Diff({len(self.aligned)} aligned, first_divergent={self.first_divergent!r}, "
                f"{len(self.divergent)} divergent, rtol={self.rtol:g})")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.3g}"
    return str(v)


def _rows(report: Any) -> list[dict[str, Any]]:
    rows = getattr(report, "rows", report)
    if not isinstance(rows, Sequence):
        raise TypeError(f"diff() compares two fxdebug Reports (or lists of report rows); got {type(report).__name__}")
    return list(rows)


def _align(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    pairs: list[tuple[int, int, str]] = []
    used_a: set[int] = set()
    used_b: set[int] = set()
    b_by_name = {r["node"]: j for j, r in enumerate(b)}
    for i, r in enumerate(a):
        j = b_by_name.get(r["node"])
        if j is not None and b[j].get("op") == r.get("op") and b[j].get("module") == r.get("module"):
            pairs.append((i, j, "name"))
            used_a.add(i)
            used_b.add(j)

    rest_a = [i for i in range(len(a)) if i not in used_a]
    rest_b = [j for j in range(len(b)) if j not in used_b]
    keys_a = [(a[i].get("module"), a[i].get("op")) for i in rest_a]
    keys_b = [(b[j].get("module"), b[j].get("op")) for j in rest_b]
    matcher = difflib.SequenceMatcher(a=keys_a, b=keys_b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for i, j in zip(rest_a[i1:i2], rest_b[j1:j2]):
                pairs.append((i, j, "module+op"))
                used_a.add(i)
                used_b.add(j)
        elif tag == "replace":  # same place, different ops: pair in order within one module
            block_b = list(rest_b[j1:j2])
            for i in rest_a[i1:i2]:
                k = next((k for k, j in enumerate(block_b) if b[j].get("module") == a[i].get("module")), None)
                if k is None:
                    continue
                j = block_b[k]
                del block_b[: k + 1]
                pairs.append((i, j, "module"))
                used_a.add(i)
                used_b.add(j)
    groups_b: dict[Any, list[int]] = defaultdict(list)
    for j in range(len(b)):
        if j not in used_b:
            groups_b[b[j].get("op")].append(j)
    for i in range(len(a)):
        if i not in used_a and groups_b.get(a[i].get("op")):
            j = groups_b[a[i].get("op")].pop(0)
            pairs.append((i, j, "op order"))
            used_a.add(i)
            used_b.add(j)
    pairs.sort()
    return pairs


def _divergence(ra: dict[str, Any], rb: dict[str, Any], kinds: _Kinds) -> tuple[float, str | None, Any, Any]:
    if ra.get("shape") is not None and rb.get("shape") is not None and tuple(ra["shape"]) != tuple(rb["shape"]):
        return math.inf, "shape", ra["shape"], rb["shape"]
    mags = [abs(v) for r in (ra, rb) for k in ("min", "max", "grad_min", "grad_max")
            if isinstance(v := r.get(k), (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    worst: tuple[float, str | None, Any, Any] = (0.0, None, None, None)
    for key in ra:
        if key in kinds.skip or key not in rb:
            continue
        va, vb = ra[key], rb[key]
        if isinstance(va, bool) or isinstance(vb, bool) or not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
            continue
        d = _one(key, float(va), float(vb), mags, kinds)
        if d > worst[0]:
            worst = (d, key, va, vb)
    return worst


def _one(key: str, va: float, vb: float, mags: list[float], kinds: _Kinds) -> float:
    if math.isnan(va) and math.isnan(vb):
        return 0.0
    if not (math.isfinite(va) and math.isfinite(vb)):
        return 0.0 if va == vb else math.inf
    if key in kinds.counts:
        return 0.0 if va == vb else math.inf
    diff = abs(va - vb)
    if key in kinds.fractions:
        return diff
    base = key[5:] if key.startswith("grad_") else key
    scale = max(mags) if mags and base != "norm" else max(abs(va), abs(vb))
    if scale == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / scale


def diff(report_a: Any, report_b: Any, rtol: float = 1e-3) -> Diff:
    """Align two reports of the same model node by node and find where they first diverge.

    Both reports should come from the same inputs (statistics accumulate over calls). ``rtol``:
    the divergence (see the module docstring) above which a node counts as divergent.
    """
    if not rtol >= 0:
        raise ValueError(f"diff(rtol={rtol!r}): rtol is a tolerance >= 0")
    a, b = _rows(report_a), _rows(report_b)
    pairs = _align(a, b)
    kinds = _Kinds.of(report_a, report_b)
    rows: list[dict[str, Any]] = []
    for i, j, how in pairs:
        ra, rb = a[i], b[j]
        d, col, va, vb = _divergence(ra, rb, kinds)
        rows.append({"node_a": ra["node"], "node_b": rb["node"], "module": ra.get("module"), "op": ra.get("op"),
                     "match": how, "divergence": d, "column": col, "a": va, "b": vb, "diverged": d > rtol})
    matched_a = {i for i, _, _ in pairs}
    matched_b = {j for _, j, _ in pairs}
    only_a = [r["node"] for i, r in enumerate(a) if i not in matched_a]
    only_b = [r["node"] for j, r in enumerate(b) if j not in matched_b]
    for name in only_a:
        rows.append({"node_a": name, "node_b": None, "module": None, "op": None, "match": None,
                     "divergence": None, "column": None, "a": None, "b": None, "diverged": False})
    for name in only_b:
        rows.append({"node_a": None, "node_b": name, "module": None, "op": None, "match": None,
                     "divergence": None, "column": None, "a": None, "b": None, "diverged": False})
    first = next((r["node_a"] for r in rows if r["diverged"]), None)
    return Diff(rows=rows, rtol=rtol, first_divergent=first, unmatched_a=only_a, unmatched_b=only_b)
