"""The flight recorder: the last N calls' per-node statistics, kept in a ring buffer on the device.

The fused observation runtime already accumulates, per watched node, the sums, counts and NaN/Inf
tallies of every call in one float64 state table on the device (``fxdebug/runtime``). The recorder
adds one node at the end of the graph that copies that whole table into slot ``call % (N + 1)`` of
an ``(N + 1, table size)`` ring — one ``index_copy_`` per call, with a device index: no host
sync, no per-node work. Per-call statistics are the differences of consecutive snapshots, so each
watched node costs nothing more than its (already fused) observation; ``RecorderProbe`` only makes
sure the node has a row in the table.

``Report.history`` reassembles calls, oldest first; per node and call: ``mean``, ``std``, ``norm``
(that call's L2 norm), ``nan`` and ``inf`` (element counts), ``nonfinite`` (the call saw NaN/Inf),
and ``min_so_far`` / ``max_so_far`` (the running extremes since ``reset()`` up to that call:
the table keeps extremes as running values).

``on_nonfinite`` (a callable, or a path) makes the end node also compare the watched nodes'
count of NaN/Inf calls with the previous call's and read that one device flag — the one host sync
this option costs. At the end of the first call whose flag is set it calls
``on_nonfinite(report)`` (the instrumented module's report, whose ``.history`` ends with the bad
call), or writes that report as JSON to the path. It fires once; ``reset()`` re-arms it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxdebug.runtime.call_flags import defer
from fxdebug.runtime.columns import HIDDEN, Column
from fxdebug.authoring.context import PassContext
from fxdebug.graph.meta import fx_meta
from fxdebug.runtime.observer import FusedProbe, FusedStats, Observer
from fxdebug.runtime.slots import INDEX, K

__all__ = ["STATS", "CallRecord", "Flight", "History", "RecorderEnd", "RecorderProbe", "add_recorder", "history_of"]

STATS = ("mean", "std", "norm", "nan", "inf", "nonfinite", "min_so_far", "max_so_far")


class Flight:
    """The ring of table snapshots (on the table's device) and what reads it."""

    def __init__(self, history: int) -> None:
        self.history = history
        self.ring: Tensor | None = None
        self.calls: Tensor | None = None
        self.bad_total: Tensor | None = None
        self.fired = False
        self.table: Tensor | None = None  # the state table last snapshotted
        self.prev: Tensor | None = None  # the table at the end of the previous call (after repair)
        self._host: tuple[int, int, list[int], list[list[float]]] | None = None

    def record(self, table: Tensor, rows: Tensor | None = None) -> None:
        """Store this call's own values (additive slots: the difference from the previous call's
        end; extremes: as they are) in the ring. A watched row (``rows``) whose sums went NaN/Inf in
        this call gets its sums and extremes put back as they were before it, so the call keeps its
        NaN in the history and the calls after it keep their own values (the running sums would
        otherwise stay NaN forever); its NaN/Inf counts and ``bad_calls`` still count the call."""
        size = self.history + 1
        if self.ring is None or self.ring.shape[1] != table.numel() or self.ring.device != table.device:
            self.ring = torch.full((size, table.numel()), math.nan, dtype=table.dtype, device=table.device)
            self.calls = torch.full((size,), -1, dtype=torch.int64, device=table.device)
            self.prev = None
        if self.prev is None or self.prev.shape != table.shape:
            self.prev = torch.zeros_like(table)
        additive = _additive_mask(table)
        call = table[:1].to(torch.int64)
        slot = torch.remainder(call, size)
        own = torch.where(additive, table - self.prev, table)
        self.ring.index_copy_(0, slot, own.view(1, -1))
        assert self.calls is not None
        self.calls.index_copy_(0, slot, call)
        if rows is not None and rows.numel():
            grid, before = table.view(-1, K), self.prev.view(-1, K)
            idx = rows + 1
            sums = grid[idx][:, _REPAIR]
            went_bad = ~torch.isfinite(sums).all(dim=1, keepdim=True) & torch.isfinite(before[idx][:, _REPAIR]).all(
                dim=1, keepdim=True)
            fixed = torch.where(went_bad, before[idx][:, _REPAIR], sums)
            cols = torch.tensor(_REPAIR, device=table.device)
            grid[idx.unsqueeze(1), cols.unsqueeze(0)] = fixed
        self.prev = table.detach().clone()

    def went_bad(self, table: Tensor, rows: Tensor) -> Tensor:
        """0-d bool on the device: did a watched node's NaN/Inf call count grow in this call?"""
        total = table.view(-1, K)[rows + 1, INDEX["bad_calls"]].sum()
        if self.bad_total is None or self.bad_total.device != total.device:
            self.bad_total = torch.zeros_like(total)
        bad = total > self.bad_total
        self.bad_total.copy_(total)
        return bad

    def reset(self) -> None:
        self.ring = self.calls = self.bad_total = self.table = self.prev = None
        self.fired = False
        self._host = None

    def host(self) -> tuple[list[int], list[list[float]]] | None:
        """Recorded call indices and snapshots on the host (one copy, cached until the next write)."""
        if self.ring is None or self.calls is None or self.ring.device.type == "meta":
            return None
        key = (id(self.ring), self.ring._version)
        if self._host is None or self._host[:2] != key:
            self._host = (*key, self.calls.cpu().tolist(), self.ring.cpu().tolist())
        return self._host[2], self._host[3]

    def node_history(self, row: int) -> list[tuple[int, dict[str, Any]]]:
        """``[(call, stats), ...]`` for table row ``row``, oldest first (see the module doc)."""
        got = self.host()
        if got is None:
            return []
        calls, snaps = got
        by_call = {c: snaps[i] for i, c in enumerate(calls) if c >= 0}
        out = [(c, _per_call(_fields(by_call[c], row), None)) for c in sorted(by_call)]  # each call's own values
        return out[-self.history:]

    def __deepcopy__(self, memo: dict[int, Any]) -> "Flight":
        new = Flight(self.history)
        memo[id(self)] = new
        return new


_ADDITIVE = tuple(INDEX[n] for n in ("calls", "stat_calls", "count", "sum", "sumsq", "abs", "zeros", "nan", "inf",
                                       "norm", "bad_calls"))
_REPAIR = [INDEX[n] for n in ("sum", "sumsq", "abs", "norm", "min", "max")]


def _additive_mask(table: Tensor) -> Tensor:
    """True at the table's per-row running sums and counts (their per-call value is a difference)."""
    mask = torch.zeros(K, dtype=torch.bool)
    mask[list(_ADDITIVE)] = True
    rows = table.numel() // K
    full = mask.repeat(rows).to(table.device)
    full[0] = False  # the clock
    return full


def _fields(snap: list[float], row: int) -> dict[str, float]:
    base = K * (row + 1)
    return {name: snap[base + i] for name, i in INDEX.items()}


def _per_call(now: dict[str, float], before: dict[str, float] | None) -> dict[str, Any]:
    def delta(name: str) -> float:
        return now[name] - (before[name] if before is not None else 0.0)

    n = delta("count")
    mean = delta("sum") / n if n else math.nan
    var = delta("sumsq") / n - mean * mean if n else math.nan
    return {
        "mean": mean,
        "std": math.sqrt(var) if var >= 0 else (0.0 if var > -1e-9 else math.nan),
        "norm": delta("norm"),
        "nan": int(delta("nan")),
        "inf": int(delta("inf")),
        "nonfinite": delta("bad_calls") > 0,
        "min_so_far": now["min"],
        "max_so_far": now["max"],
    }


def _history(rows: Sequence[dict[str, Any]]) -> "History | None":
    return history_of(rows)


class RecorderProbe(FusedProbe):
    """Gives the node a row in the fused table and reads its recorded calls for the report."""

    key = "recorder"
    columns = (Column("history", roles=HIDDEN, doc="the last N calls' statistics of this output (Report.history)",
                      answers="history", reading=_history),)

    def __init__(self, flight: Flight) -> None:
        self.flight = flight
        self.observer: Observer | None = None

    def summary_from(self, stats: FusedStats, phase: str) -> dict[str, Any]:
        if phase != "forward" or self.observer is None or "forward" not in self.observer.fused_rows:
            return {}
        return {"history": self.flight.node_history(self.observer.fused_rows["forward"][0])}


class RecorderEnd(nn.Module):
    """The end-of-call node: snapshots the table; with ``on_nonfinite``, reads one device flag."""

    flight: Flight  # shared with the probes; plain attributes, not submodules or state
    observers: list[Observer]

    def __init__(self, flight: Flight, observers: Sequence[Observer],
                 on_nonfinite: Callable[[Any], Any] | str | None) -> None:
        super().__init__()
        object.__setattr__(self, "flight", flight)
        object.__setattr__(self, "observers", list(observers))
        self.on_nonfinite = on_nonfinite
        self._rows: Tensor | None = None
        self._owner: Any = None

    def bind(self, gm: nn.Module) -> None:
        self._owner = weakref.ref(gm)

    def forward(self, table: Any, *outputs: Any) -> None:
        if not isinstance(table, Tensor):
            return None
        flight = self.flight
        if flight.table is not table:  # a new table: first call, or reset() (which re-creates it)
            if flight.table is not None:
                flight.reset()
            flight.table = table
        rows = self._rows
        if rows is None or rows.device != table.device:
            ids = [o.fused_rows["forward"][0] for o in self.observers if "forward" in o.fused_rows]
            rows = self._rows = torch.tensor(ids, dtype=torch.int64).to(table.device)
        flight.record(table, rows)
        if self.on_nonfinite is None or flight.fired or table.device.type == "meta":
            return None
        bad = flight.went_bad(table, rows)
        if defer(bad, self._fire):  # a live call reads every graph's flag at its end, in one transfer
            return None
        if not bool(bad):  # the documented sync: one flag per call
            return None
        self._fire()
        return None

    def _fire(self) -> None:
        if self.flight.fired:
            return
        self.flight.fired = True
        owner = self._owner() if self._owner is not None else None
        report = owner.report() if owner is not None and hasattr(owner, "report") else None
        if callable(self.on_nonfinite):
            self.on_nonfinite(report)
        elif report is not None:
            report.to_json(str(self.on_nonfinite))

    def __deepcopy__(self, memo: dict[int, Any]) -> "RecorderEnd":
        import copy

        new = RecorderEnd(copy.deepcopy(self.flight, memo), copy.deepcopy(self.observers, memo), self.on_nonfinite)
        new.training = self.training
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_owner"] = None
        state["_rows"] = None
        return state


def add_recorder(gm: GraphModule, ctx: PassContext, nodes: Sequence[Node], history: int,
                 on_nonfinite: Callable[[Any], Any] | str | None = None) -> list[Node]:
    """Give each of ``nodes`` a fused row (``RecorderProbe``) and add the end-of-call snapshot
    node (one per graph; a second recorder pass reuses it). Returns the nodes added."""
    if not isinstance(history, int) or isinstance(history, bool) or history < 1:
        raise ValueError(f"history={history!r}: the number of calls to keep, an int >= 1")
    if on_nonfinite is not None and not callable(on_nonfinite) and not isinstance(on_nonfinite, str) \
            and not hasattr(on_nonfinite, "__fspath__"):
        raise TypeError(f"on_nonfinite={on_nonfinite!r}: a callable taking the report, or a path to dump it to")
    added: list[Node] = []
    end_node = next((n for n in gm.graph.nodes if fx_meta(n).get("module_type") == "RecorderEnd"), None)
    end: Any = gm.get_submodule(str(end_node.target)) if end_node is not None else None
    flight = end.flight if isinstance(end, RecorderEnd) and end.flight.history == history else Flight(history)
    observers: list[Observer] = []
    for node in nodes:
        probe = RecorderProbe(flight)
        obs_node = ctx.observe(node, probe)
        if obs_node is None:
            continue
        added.append(obs_node)
        observer: Any = gm.get_submodule(str(obs_node.target))
        probe.observer = observer
        observers.append(observer)
    if isinstance(end, RecorderEnd):
        end.observers.extend(observers)
        if on_nonfinite is not None:
            end.on_nonfinite = on_nonfinite if callable(on_nonfinite) else str(on_nonfinite)
        return added
    clock_node = ctx.clock_node(gm)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    end = RecorderEnd(flight, observers, on_nonfinite if on_nonfinite is None or callable(on_nonfinite) else str(on_nonfinite))
    end.bind(gm)
    target = ctx.add_module(gm, "recorder_end", end)
    with gm.graph.inserting_before(out):
        node = gm.graph.call_module(target, (clock_node, *out.all_input_nodes), {})
    meta = fx_meta(node)
    meta["role"], meta["module"], meta["module_type"] = "shadow", "", "RecorderEnd"
    meta["shadows"] = out.all_input_nodes[0].name if out.all_input_nodes else ""
    added.append(node)
    return added


# -- reading --------------------------------------------------------------------------------------
@dataclass
class CallRecord:
    """One recorded call: ``nodes`` maps node name -> ``{mean, std, norm, nan, inf, nonfinite,
    min_so_far, max_so_far}`` (see the module docstring)."""

    call: int
    nodes: dict[str, dict[str, Any]]

    @property
    def nonfinite(self) -> list[str]:
        """Nodes whose output held NaN/Inf in this call, in graph order."""
        return [n for n, s in self.nodes.items() if s.get("nonfinite")]


@dataclass
class History:
    """The recorded calls, oldest first (at most N: the ring keeps the last N)."""

    records: list[CallRecord] = field(default_factory=list)

    @property
    def calls(self) -> list[int]:
        return [r.call for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Any:
        return iter(self.records)

    def __getitem__(self, i: int) -> CallRecord:
        return self.records[i]

    def at(self, call: int) -> CallRecord:
        for r in self.records:
            if r.call == call:
                return r
        raise KeyError(f"call {call} is not in the history (recorded calls: {self.calls})")

    def node(self, name: str) -> list[tuple[int, dict[str, Any]]]:
        """``[(call, stats), ...]`` for one node, oldest first."""
        return [(r.call, r.nodes[name]) for r in self.records if name in r.nodes]

    @property
    def first_nonfinite(self) -> tuple[int, str] | None:
        """``(call, node)``: the earliest recorded call with a NaN/Inf and its first such node."""
        for r in self.records:
            bad = r.nonfinite
            if bad:
                return r.call, bad[0]
        return None

    def before(self, call: int) -> list[CallRecord]:
        """The recorded calls strictly before ``call``."""
        return [r for r in self.records if r.call < call]

    def __str__(self) -> str:
        if not self.records:
            return "history: no calls recorded"
        lines = [f"history: {len(self.records)} call(s), {self.calls[0]}..{self.calls[-1]}"]
        for r in self.records:
            worst = max((s["norm"] for s in r.nodes.values() if math.isfinite(s.get("norm", math.nan))), default=math.nan)
            bad = r.nonfinite
            lines.append(f"  call {r.call}: {len(r.nodes)} nodes, largest finite norm {worst:.3g}"
                         + (f", NaN/Inf at {', '.join(bad[:3])}" if bad else ""))
        return "\n".join(lines)


def history_of(rows: Sequence[dict[str, Any]]) -> History | None:
    """Reassemble the rows' ``history`` entries into calls (``None`` without a recorder)."""
    per_call: dict[int, dict[str, dict[str, Any]]] = {}
    found = False
    for r in rows:
        entries = r.get("history")
        if entries is None:
            continue
        found = True
        for call, stats in entries:
            per_call.setdefault(int(call), {})[r["node"]] = stats
    if not found:
        return None
    for r in rows:  # other probes' figures per recorded call (``history_<name>``: [(call, {figure: value}), ...])
        for key, extra in r.items():
            if key.startswith("history_") and isinstance(extra, list):
                for call, stats in extra:
                    if int(call) in per_call and isinstance(stats, dict):
                        per_call[int(call)].setdefault(r["node"], {}).update(stats)
    return History([CallRecord(c, per_call[c]) for c in sorted(per_call)])
