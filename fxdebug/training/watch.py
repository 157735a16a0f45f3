"""``fxdebug.guard(optimizer, dbg=...)``: did a node the instrumented model watches see NaN/Inf since
the last step? Read on the device from the observers' state tables (their ``bad_calls`` slots), no
sync; and which node it was, for ``skipped_steps``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fxdebug.runtime.columns import NONFINITE
from fxdebug.runtime.slots import INDEX, K

__all__ = ["origin", "watched_bad"]


def watched_bad(g: Any, device: torch.device) -> Tensor | None:
    """With ``dbg=``: 1.0 (0-d float32 on ``device``) when a node the model watches for NaN/Inf saw one
    since the previous step, else 0.0; ``None`` when it watches none. No sync."""
    watch = _watch_plan(g)
    if watch is None:
        return None
    tables = watch["tables"]
    counts = torch.cat([t.index_select(0, idx).to(device, non_blocking=True) for t, idx in tables])
    last = watch.get("last")
    if last is None or last.shape != counts.shape:
        last = torch.zeros_like(counts)
    delta = counts > last
    watch["last"] = counts
    watch["delta"] = delta
    return delta.any().to(torch.float32)


def _watch_plan(g: Any) -> dict[str, Any] | None:
    """The ``bad_calls`` slots of every fused row that a NaN/Inf-watching probe reads, per state
    table; rebuilt when the model's tables change (a recapture, a reset, a move)."""
    quick = _tables_key(g)
    if g._watch is not None and g._watch.get("quick") == quick:
        return g._watch  # the same parts and tables as last step: no walk over the observers
    observers = g.dbg.observers()
    rows: list[tuple[Tensor, int, tuple[str, str]]] = []
    for name, obs in observers.items():
        if not any(c.key and NONFINITE in c.roles for p in obs.fused_probes for c in p.columns):
            continue
        clock = obs._clock
        if clock is None or clock.table is None:
            continue
        for phase, (row, *_rest) in obs.fused_rows.items():
            rows.append((clock.table, K * (row + 1) + INDEX["bad_calls"], (name, phase)))
    key = tuple((id(t), i) for t, i, _ in rows)
    if g._watch is not None and g._watch.get("key") == key:
        g._watch["quick"] = quick
        return g._watch
    if not rows:
        g.__dict__["_watch"] = None
        return None
    tables: dict[int, tuple[Tensor, list[int]]] = {}
    for t, i, _ in rows:
        tables.setdefault(id(t), (t, []))[1].append(i)
    labels: list[tuple[str, str]] = []  # in the order the concatenation lays them out: table by table, rows in graph order
    for tid, (t, idx) in tables.items():
        labels.extend(label for tt, i, label in rows if id(tt) == tid)
    plan = {"key": key, "quick": quick, "labels": labels,
            "tables": [(t, torch.tensor(idx, dtype=torch.long, device=t.device)) for t, idx in tables.values()]}
    g._fold()  # the skipped steps so far keep the origins of the old labels' layout...
    g.__dict__.update(_origin_log=None, _origin_ring=None)  # ...which the next ones do not share
    g.__dict__["_watch"] = plan
    return plan


def _tables_key(g: Any) -> tuple[Any, ...]:
    """Identity of the model's captured parts and their state tables (cheap to compute)."""
    parts = g.dbg.parts()  # dbg: an Instrumented module (checked by guard())
    key = []
    for part in parts.values():
        clock = part._clock() if hasattr(part, "_clock") else None
        table = None if clock is None else clock.table
        key.append((id(part), id(table), None if clock is None else clock.rows))
    return tuple(key)


def origin(bad: list[tuple[str, str]]) -> str | None:
    """The node a skipped step's NaN came from: the first watched node (graph order) whose output
    went bad forward; else the last one whose output gradient did (where the bad gradient entered)."""
    fwd = [n for n, phase in bad if phase == "forward"]
    if fwd:
        return fwd[0]
    grad = [n for n, phase in bad if phase == "grad"]
    return grad[-1] if grad else None
