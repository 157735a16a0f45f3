"""The flight recorder: the last N calls' per-node statistics, kept in a ring buffer on the device.

Per watched node and call, ``RecorderProbe`` writes one small vector — ``mean``, ``std``,
``min``, ``max``, ``norm`` (L2), ``nonfinite`` (1 when the output held NaN/Inf) — into slot
``call % N`` of an ``(N, 6)`` tensor on the node's device, and the call index into a matching
``(N,)`` tensor, with ``index_copy_`` and a device index: nothing is read back, so recording
never synchronises. ``Report.history`` reassembles the slots into calls, oldest first.

``on_nonfinite`` (a callable, or a path) adds one node at the end of the graph that reads one
device flag per call — "did any watched node see NaN/Inf in this call?" — the one host sync this
option costs. At the end of the first call whose flag is set it calls ``on_nonfinite(report)``
(the instrumented module's report, with ``.history`` holding the calls up to and including the
bad one), or writes that report as JSON to the path. It fires once; ``reset()`` re-arms it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from ..columns import HIDDEN, Column
from ..context import PassContext
from ..meta import fx_meta
from ..observe import ObservationContext, Probe, Reductions

__all__ = ["STATS", "CallRecord", "Flight", "History", "RecorderEnd", "RecorderProbe", "add_recorder", "history_of"]

STATS = ("mean", "std", "min", "max", "norm", "nonfinite")


class Flight:
    """State shared by a graph's recorder probes and its end node: one NaN/Inf flag per device."""

    def __init__(self, history: int) -> None:
        self.history = history
        self.flags: dict[torch.device, Tensor] = {}
        self.fired = False
        self.clock: Tensor | None = None  # the clock tick last seen: a new one means reset() ran

    def seen(self, clock: Tensor | None) -> None:
        """Re-arm after ``Instrumented.reset()``, which replaces the clock's tick tensors."""
        if clock is not None and clock is not self.clock:
            if self.clock is not None and clock.device == self.clock.device:
                self.reset()
            self.clock = clock

    def flag(self, device: torch.device) -> Tensor:
        f = self.flags.get(device)
        if f is None:
            f = self.flags[device] = torch.zeros((), dtype=torch.bool, device=device)
        return f

    def reset(self) -> None:
        for f in self.flags.values():
            f.zero_()
        self.fired = False

    def __deepcopy__(self, memo: dict[int, Any]) -> "Flight":
        new = Flight(self.history)
        memo[id(self)] = new
        return new


class RecorderProbe(Probe):
    """Writes this call's statistics of the node's output into the ring buffer (see module doc)."""

    key = "recorder"
    columns = (Column("history", roles=HIDDEN, doc="the last N calls' statistics of this output (Report.history)"),)

    def __init__(self, flight: Flight) -> None:
        self.flight = flight

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        n = self.flight.history
        return {"ring": torch.zeros(n, len(STATS), dtype=torch.float64, device=x.device),
                "calls": torch.full((n,), -1, dtype=torch.int64, device=x.device),
                "n": torch.tensor([n], dtype=torch.int64, device=x.device)}

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        x = r.x
        if x.numel() == 0:
            return
        self.flight.seen(ctx.clock)
        clock = ctx.clock if ctx.clock is not None else torch.full((), ctx.call, dtype=torch.int64, device=x.device)
        slot = torch.remainder(clock.view(1), state["n"])
        total = r["sum"].to(torch.float64)
        n = float(x.numel())
        mean = total / n
        norm = r["norm2"].to(torch.float64)
        var = (norm * norm / n - mean * mean).clamp_min(0)
        lo, hi = r["min"].to(torch.float64), r["max"].to(torch.float64)
        bad = ~(torch.isfinite(lo) & torch.isfinite(hi) & torch.isfinite(total))
        vec = torch.stack([mean, var.sqrt(), lo, hi, norm, bad.to(torch.float64)])
        state["ring"].index_copy_(0, slot, vec.view(1, -1))
        state["calls"].index_copy_(0, slot, clock.view(1))
        self.flight.flag(x.device).logical_or_(bad)

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        ring, calls = state["ring"], state["calls"]
        if ring.device.type == "meta":
            return {}
        rows = ring.cpu().tolist()
        entries = sorted((int(c), dict(zip(STATS, v))) for c, v in zip(calls.cpu().tolist(), rows) if c >= 0)
        for _, stats in entries:
            stats["nonfinite"] = bool(stats["nonfinite"])
        return {"history": entries}


class RecorderEnd(nn.Module):
    """The end-of-call check behind ``on_nonfinite``: one device flag read per call (a sync)."""

    def __init__(self, flight: Flight, on_nonfinite: Callable[[Any], Any] | str) -> None:
        super().__init__()
        object.__setattr__(self, "flight", flight)
        self.on_nonfinite = on_nonfinite
        self._owner: Any = None

    def bind(self, gm: nn.Module) -> None:
        self._owner = weakref.ref(gm)

    def forward(self, *outputs: Any) -> None:
        flight = self.flight
        if flight.fired or not flight.flags:
            return None
        if not any(bool(f) for f in flight.flags.values() if f.device.type != "meta"):  # the documented sync
            return None
        flight.fired = True
        owner = self._owner() if self._owner is not None else None
        report = owner.report() if owner is not None and hasattr(owner, "report") else None
        if callable(self.on_nonfinite):
            self.on_nonfinite(report)
        elif report is not None:
            report.to_json(str(self.on_nonfinite))
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> "RecorderEnd":
        import copy

        new = RecorderEnd(copy.deepcopy(self.flight, memo), self.on_nonfinite)
        new.training = self.training
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_owner"] = None
        return state


def add_recorder(gm: GraphModule, ctx: PassContext, nodes: Sequence[Node], history: int,
                 on_nonfinite: Callable[[Any], Any] | str | None = None) -> list[Node]:
    """Attach a ``RecorderProbe`` to each of ``nodes`` (one ``Flight`` per graph) and, with
    ``on_nonfinite``, the end-of-call check. Returns the nodes added."""
    if not isinstance(history, int) or isinstance(history, bool) or history < 1:
        raise ValueError(f"history={history!r}: the number of calls to keep, an int >= 1")
    if on_nonfinite is not None and not callable(on_nonfinite) and not isinstance(on_nonfinite, (str, bytes)) \
            and not hasattr(on_nonfinite, "__fspath__"):
        raise TypeError(f"on_nonfinite={on_nonfinite!r}: a callable taking the report, or a path to dump it to")
    flight = gm.meta.setdefault("fxdebug", {}).get("flight")
    if flight is None or flight.history != history:
        flight = Flight(history)
        gm.meta["fxdebug"]["flight"] = flight
    added: list[Node] = []
    for node in nodes:
        obs = ctx.observe(node, RecorderProbe(flight))
        if obs is not None:
            added.append(obs)
    if on_nonfinite is not None:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        end = RecorderEnd(flight, on_nonfinite if callable(on_nonfinite) else str(on_nonfinite))
        end.bind(gm)
        target = ctx.add_module(gm, "recorder_end", end)
        with gm.graph.inserting_before(out):
            node = gm.graph.call_module(target, tuple(out.all_input_nodes), {})
        meta = fx_meta(node)
        meta["role"], meta["module"], meta["module_type"] = "shadow", "", "RecorderEnd"
        meta["shadows"] = out.all_input_nodes[0].name if out.all_input_nodes else ""
        added.append(node)
    return added


# -- reading --------------------------------------------------------------------------------------
@dataclass
class CallRecord:
    """One recorded call: ``nodes`` maps node name -> ``{mean, std, min, max, norm, nonfinite}``."""

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
            worst = max((abs(s["max"]) for s in r.nodes.values() if math.isfinite(s.get("max", math.nan))), default=math.nan)
            bad = r.nonfinite
            lines.append(f"  call {r.call}: {len(r.nodes)} nodes, max |x| {worst:.3g}"
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
    return History([CallRecord(c, per_call[c]) for c in sorted(per_call)])
