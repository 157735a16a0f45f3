"""Many processes, one report: fxdebug over ``torch.distributed``.

Instrument the inner module and wrap *that* in ``DistributedDataParallel`` (or ``fully_shard``)::

    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,))
    ddp = DistributedDataParallel(dbg)
    ...train...
    report = dbg.report(all_ranks=True)      # called on every rank: the one documented sync

Observers hold their statistics on each rank, so training is unchanged: DDP sees the model's own
parameters (the instrumented module shares them) and fxdebug adds no parameter and no buffer.
``report(all_ranks=True)`` gathers every rank's rows (``all_gather_object`` on the default group,
or ``group=``) and merges them as if one process had seen all the data:

* the fused runtime's statistics: ``count``, ``calls``, NaN/Inf counts summed; ``mean``
  count-weighted; ``std`` from each rank's count, mean and variance (the parallel variance formula
  — the population std of the concatenated data); ``mean_abs``, ``zero_frac`` count-weighted;
  ``norm`` (mean per-call L2 norm) call-weighted; ``min`` / ``max`` global;
* every other column by its declaration (``Column.merge``): ``sum``, ``min``, ``max``, ``same``,
  or a function of the ranks' rows — ``NONFINITE`` columns sum and ``ORIGIN`` columns take the
  earliest call unless they say otherwise; ``StatCollector``'s dead fraction is computed from each
  rank's per-channel maxima (gathered from the fused statistics as ``chan_max``). A rule that
  cannot tell gives ``None`` and a note, rather than a guess from per-rank values;
* the first non-finite origin is ``(call, rank, node)``: the lowest call first, then the lowest
  rank, then execution order (reverse order for gradients, as in the single-process report).

Every rank receives the merged report (an all-gather costs the same as a gather on these sizes);
each may still call ``report()`` for its own. Before gathering, the ranks meet at a barrier with a
timeout (``monitored_barrier`` on gloo): a rank that failed or hangs makes the others raise
``DistributedError`` naming it, instead of waiting forever.
"""

from __future__ import annotations

import copy
import datetime
import math
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn

from fxdebug.errors import DistributedError, UsageError
from fxdebug.runtime.columns import BASE_COLUMNS, ORIGIN, Column
from fxdebug.runtime.observer import FusedStats
from fxdebug.report.report import Report

__all__ = ["DistributedReport", "Origin", "merged_report", "unwrap_parallel"]


# -- wrapped models --------------------------------------------------------------------------------
def unwrap_parallel(model: nn.Module) -> tuple[nn.Module, str | None]:
    """``(inner module, note)`` for a ``DistributedDataParallel`` / ``DataParallel`` wrapper, else ``(model, None)``.

    Tracing the wrapper would trace its collective-calling forward; the inner module is the model.
    """
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    if not isinstance(model, wrappers):
        return model, None
    inner = model.module
    kind = type(model).__name__
    note = (f"traced {kind}.module ({type(inner).__name__}), not the {kind} wrapper: instrument the inner module and "
            f"wrap the instrumented one in {kind} to train it (gradient sync stays {kind}'s).")
    return inner, note


# -- the merged report ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Origin:
    """Where NaN/Inf first appeared over all ranks: forward call (step) index, rank, node."""

    call: int
    rank: int
    node: str
    module: str = ""

    def __str__(self) -> str:
        return f"call {self.call}, rank {self.rank}, node '{self.node}'" + (f" (module {self.module})" if self.module else "")


@dataclass(repr=False)
class DistributedReport(Report):
    """A ``Report`` merged over ranks: rows as if one process saw all the data, plus the origin.

    Attributes:
        world_size: ranks merged.
        origin / origin_grad: ``Origin`` of the first non-finite forward value / gradient, or ``None``.
        per_rank: each rank's own ``first_nonfinite`` and ``calls``.
    """

    world_size: int = 1
    origin: Origin | None = None
    origin_grad: Origin | None = None
    per_rank: list[dict[str, Any]] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"DistributedReport({len(self.rows)} rows, ranks={self.world_size}, calls={self.calls}, "
                f"origin={str(self.origin) if self.origin else None!r})")


# The fused runtime's statistics (its state-table slots and what every probe derives from them).
_SUM = {"count", "calls", "nan", "inf"}
_MIN = {"min"}
_MAX = {"max"}
_WEIGHTED = {"mean_abs", "zero_frac"}  # fractions/means over the elements seen
_SAME = {c.key for c in BASE_COLUMNS if c.key != "calls"}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _merge_phase(rows: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """Merge one phase (forward ``""`` or backward ``"grad_"``) of one node's rows."""
    out: dict[str, Any] = {}

    def key(k: str) -> str:
        return prefix + k
    counts = [_num(r.get(key("count"))) or 0.0 for r in rows]
    n = sum(counts)
    if any(key(k) in r for r in rows for k in ("count", "mean")):
        out[key("count")] = int(n)
    if n > 0 and all(key("mean") in r for r, c in zip(rows, counts) if c):
        live = [(r, c) for r, c in zip(rows, counts) if c]
        mean = sum(c * r[key("mean")] for r, c in live) / n
        out[key("mean")] = mean
        if all(key("std") in r for r, _ in live):
            m2 = sum(c * (r[key("std")] ** 2 + (r[key("mean")] - mean) ** 2) for r, c in live)
            out[key("std")] = math.sqrt(m2 / n) if math.isfinite(m2) else math.nan
        for k in _WEIGHTED:
            weighted = [(_num(r.get(key(k))), c) for r, c in live]
            if weighted and all(v is not None for v, _ in weighted):
                out[key(k)] = sum((v or 0.0) * c for v, c in weighted) / n
    calls = [_num(r.get(key("calls"))) or 0.0 for r in rows]
    if any(key("norm") in r for r in rows) and sum(calls) > 0:
        norms = [(_num(r.get(key("norm"))), c) for r, c in zip(rows, calls) if c]
        if all(v is not None for v, _ in norms):
            out[key("norm")] = sum((v or 0.0) * c for v, c in norms) / sum(calls)
    for k in _SUM:
        summed = [r[key(k)] for r in rows if r.get(key(k)) is not None]
        if summed:
            out[key(k)] = sum(summed)
    for k in _MIN | _MAX:
        found = [v for v in (_num(r.get(key(k))) for r in rows) if v is not None]
        if found:
            pick = min(found) if k in _MIN else max(found)
            if any(math.isnan(v) for v in found):
                pick = math.nan
            out[key(k)] = pick
    return out


def _merge_declared(col: Column, rows: list[dict[str, Any]]) -> tuple[Any, bool]:
    """``(merged value, known)`` of one declared column over the ranks' rows of one node."""
    rule = col.merge_rule
    if callable(rule):
        value = rule(rows)
        return value, value is not None
    values = [r.get(col.key) for r in rows if r.get(col.key) is not None]
    if not values:
        return None, True
    if rule == "same":
        return values[0], all(v == values[0] for v in values)
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) != len(values):
        return None, False
    if rule == "sum":
        return sum(numbers), True
    return (min(numbers) if rule == "min" else max(numbers)), True


def _merge_rows(per_rank: list[list[dict[str, Any]]], chan_max: list[dict[str, list[float]]] | None = None,
                columns: list[Column] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """One merged row per node (rank 0's order), and notes about columns that could not be merged.

    ``chan_max``: per rank, ``{node: per-channel maxima}``, handed to declared merge functions as
    each row's ``chan_max`` (rows may also carry them); ``columns``: the declarations.
    """
    declared = [c for c in columns or [] if c.key not in _SAME]
    notes: list[str] = []
    by_node = [{r["node"]: r for r in rows} for rows in per_rank]
    if chan_max is not None:
        by_node = [{k: ({**r, "chan_max": maxima[k]} if k in maxima else r) for k, r in m.items()}
                   for m, maxima in zip(by_node, chan_max)]
    merged: list[dict[str, Any]] = []
    unmerged: set[str] = set()
    unknown: set[str] = set()
    for base in per_rank[0]:
        rows = [m[base["node"]] for m in by_node if base["node"] in m]
        base = rows[0]
        row = {k: base[k] for k in base if k in _SAME}
        row.update(_merge_phase(rows, ""))
        row.update(_merge_phase(rows, "grad_"))
        for col in declared:
            if col.key in row or not any(col.key in r for r in rows):
                continue
            value, known = _merge_declared(col, rows)
            row[col.key] = value if known else None
            if not known:
                unknown.add(col.key)
        for k in base:
            if k not in row and k not in ("chan_max",):
                values = [r.get(k) for r in rows]
                if all(v == values[0] for v in values):
                    row[k] = values[0]
                else:
                    unmerged.add(k)
        merged.append(row)
    if unknown:
        notes.append(f"distributed: the merge rules of {', '.join(sorted(unknown))} could not tell a value from the "
                     "ranks' rows (a rule over per-channel maxima needs the fused statistics' 'chan_max'), so the "
                     "merged rows say None (unknown) rather than guess.")
    if unmerged:
        notes.append(f"distributed: columns {', '.join(sorted(unmerged))} differ between ranks and have no merge "
                     "rule; the merged rows leave them out (each rank's own report() has them).")
    return merged, notes


def _origin(per_rank: list[dict[str, Any]], key: str, reverse: bool) -> Origin | None:
    """Lowest call, then rank, then execution order (reversed for gradients)."""
    best: tuple[int, int, int] | None = None
    found: Origin | None = None
    for info in per_rank:
        hit = info.get(key)
        if hit is None:
            continue
        call, node, order, module = hit
        rank_key = (call, info["rank"], -order if reverse else order)
        if best is None or rank_key < best:
            best, found = rank_key, Origin(call, info["rank"], node, module)
    return found


def _local_origin(report: Report, node: str | None, grad: bool) -> tuple[int, str, int, str] | None:
    if node is None:
        return None
    order = [r["node"] for r in report.rows]
    row = report.rows[order.index(node)] if node in order else {}
    calls = [row.get(c.key) for c in report.columns_with(ORIGIN, "grad" if grad else "forward")]
    found = [int(c) for c in calls if isinstance(c, (int, float)) and not isinstance(c, bool)]
    call = min(found) if found else 0
    return call, node, order.index(node) if node in order else len(order), row.get("module", "")


def channel_maxima(dbg: Any) -> dict[str, list[float]]:
    """``{node: per-channel max of its output}`` from the fused statistics, where the node has channels.

    A channel is dead over all ranks only if its max is <= 0 on every rank, which per-rank
    fractions cannot tell; these maxima can. Empty when the runtime keeps none.
    """
    merged = getattr(dbg, "channel_maxima", None)  # a live capture: its captures' maxima, merged
    if callable(merged):
        return dict(merged())
    out: dict[str, list[float]] = {}
    hosts: dict[int, list[float] | None] = {}  # one host copy per state table, not one per node
    try:
        for name, obs in dbg.observers().items():
            rows, clock = getattr(obs, "fused_rows", None), getattr(obs, "_clock", None)
            if not rows or clock is None or "forward" not in rows:
                continue
            if id(clock) not in hosts:
                hosts[id(clock)] = clock.host_table()
            host = hosts[id(clock)]
            if host is None:
                continue
            fused = rows["forward"]
            stats = FusedStats.from_table(host, fused[0], (fused[1], fused[2]))
            if stats.calls and stats.chan_max is not None:
                out[name] = [float(v) for v in stats.chan_max]
    except (AttributeError, IndexError, KeyError, TypeError):  # a runtime without fused tables: no maxima
        return {}
    return out


def _barrier(group: Any, timeout: datetime.timedelta) -> None:
    backend = dist.get_backend(group)
    try:
        if backend == "gloo":
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier(group=group)
    except RuntimeError as exc:
        raise DistributedError(
            f"report(all_ranks=True) on rank {dist.get_rank()}: not every rank reached the merge within "
            f"{timeout.total_seconds():g} s ({str(exc).strip().splitlines()[0]}). A rank that failed or is stuck "
            "cannot send its statistics; its own log holds the cause. Call report(all_ranks=True) on every rank, "
            "or report() for this rank alone.") from exc


def merged_report(dbg: Any, *, group: Any = None, timeout: float = 60.0) -> DistributedReport:
    """The report of ``dbg`` merged over every rank of ``group`` (default: the world). Call it on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("report(all_ranks=True) needs torch.distributed initialised (dist.init_process_group(...), "
                         "or run under torchrun); for one process call report().")
    local = dbg.report()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    info = {
        "rank": rank,
        "rows": local.rows,
        "calls": local.calls,
        "first_nonfinite": local.first_nonfinite,
        "fwd": _local_origin(local, local.first_nonfinite, grad=False),
        "bwd": _local_origin(local, local.first_nonfinite_grad, grad=True),
        "chan_max": channel_maxima(dbg),
    }
    _barrier(group, datetime.timedelta(seconds=timeout))
    gathered: list[Any] = [None] * world
    try:
        dist.all_gather_object(gathered, info, group=group)
    except RuntimeError as exc:
        raise DistributedError(f"report(all_ranks=True) on rank {rank}: gathering the ranks' statistics failed: "
                               f"{str(exc).strip().splitlines()[0]}. Another rank probably failed.") from exc
    gathered.sort(key=lambda g: g["rank"])
    rows, notes = _merge_rows([g["rows"] for g in gathered], [g["chan_max"] for g in gathered], local.columns)
    origin = _origin(gathered, "fwd", reverse=False)
    origin_grad = _origin(gathered, "bwd", reverse=True)
    merged = DistributedReport(
        rows=rows,
        first_nonfinite=origin.node if origin else None,
        first_nonfinite_grad=origin_grad.node if origin_grad else None,
        nonfinite_grad_from=list(local.nonfinite_grad_from) if origin_grad and origin_grad.rank == rank else [],
        auto_leaves=dict(local.auto_leaves),
        frontend=local.frontend,
        notes=list(local.notes) + [f"distributed: merged over {world} ranks"] + notes,
        calls=sum(g["calls"] for g in gathered),
        columns=copy.copy(local.columns),
        world_size=world,
        origin=origin,
        origin_grad=origin_grad,
        per_rank=[{"rank": g["rank"], "calls": g["calls"], "first_nonfinite": g["first_nonfinite"]} for g in gathered],
    )
    return merged
