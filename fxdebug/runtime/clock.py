"""The clock: one counter per instrumented module, ticked once per forward call, that every observer's
row reads to say *which call* saw a value first (the NaN origin in time order). It lives in slot 0 of
the state table, so ticking it is one store on the device, never a host read.

Also the one re-entrant lock every observer and clock takes around its read-modify-write updates."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

import torch
from torch import Tensor, nn

# One re-entrant lock for every observer and clock: probe states are read-modify-write (pending
# lists folded and cleared, counters), so calls from several threads must not interleave inside an
# update. Uncontended it costs well under a microsecond per observed node; it never syncs a device.
_LOCK = threading.RLock()


def _locked() -> Any:
    """The lock, except while torch.compile traces (Dynamo cannot trace a lock; compiled code is
    one region per call anyway)."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else _LOCK


def _ticker(table: Tensor) -> Callable[[], Any]:
    """A no-argument callable adding 1 to slot 0 of ``table``: the C++ ``fxdebug::tick`` op where
    the build is there (one store on CPU, ~1.5 µs a call from Python), else an in-place add on a
    one-element view of the slot (~4-5 µs: TensorIterator set-up), made once per table."""
    from fxdebug.runtime.kernel import tick_op

    op = tick_op()
    if op is not None:
        return functools.partial(op, table)
    return functools.partial(table.narrow(0, 0, 1).add_, 1)


class Clock(nn.Module):
    """Counts forward calls, and owns the graph's fused-observation state table.

    One ``Clock`` node runs at the start of the graph. It advances, in place, the device call
    counter of the state table (``runtime.slots``: slot 0; every fused row reads it to know the
    call it is in) and the 0-d int64 ticks that Python probes read through ``clock.now(device)``,
    so probes compare calls with tensor ops and never sync. In a lowered graph it returns the
    table, which every ``fxdebug::observe`` node takes as its state argument; it moves the table
    to the device of the graph's first tensor input when that changes. The host count is skipped
    while ``torch.compile`` traces (a Python int that changes every call would make every call
    recompile); ``calls`` then reads the device count instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ticks: dict[torch.device, Tensor] = {}
        self._host_calls = 0
        self.rows = 0  # fused rows allocated (one per observed node and phase, plus channel rows)
        self.spans: list[tuple[int, int]] = []  # (first index, count) of each node's channel slots
        self.table: Tensor | None = None
        self._host: list[float] | None = None  # host copy while a report is read
        self._tick: tuple[Tensor, Callable[[], Any]] | None = None  # (table, its ticker): the eager fast path

    @property
    def calls(self) -> int:
        """Forward calls since the last reset (reading it may sync when only devices counted)."""
        if self._host_calls:
            return self._host_calls
        counts = [int(t) + 1 for t in self._ticks.values() if t.device.type != "meta"]
        if self.table is not None and self.table.device.type != "meta":
            counts.append(int(self.table[0]) + 1)
        return max(counts, default=0)

    def now(self, device: torch.device) -> Tensor:
        tick = self._ticks.get(device)
        if tick is None:
            start = max(self._host_calls - 1, 0)
            tick = self._ticks[device] = torch.full((), start, dtype=torch.int64, device=device)
        return tick

    # -- fused state ------------------------------------------------------------------------------
    def allocate(self, channels: int = 0) -> tuple[int, int]:
        """A new fused row, followed by ``channels`` per-channel slots (whole rows of them):
        ``(row, absolute index of the first channel slot, or 0 without channels)``. Allocating
        more later never moves what was allocated (re-instrumenting adds rows at the end)."""
        from fxdebug.runtime.slots import K

        row = self.rows
        off = K * (row + 2) if channels else 0
        state = self.__dict__  # plain values: nn.Module.__setattr__ costs ~5 µs, once per observed node
        state["rows"] = row + 1 + (channels + K - 1) // K
        if channels:
            self.spans.append((off, channels))
        state["table"] = None
        return row, off

    def materialize(self, device: torch.device | str = "cpu") -> Tensor:
        """The state table, created fresh on ``device`` when missing (or moved there)."""
        from fxdebug.runtime.slots import init_table

        if self.table is None:
            self.table = init_table(self.rows, self.spans, device)
            if self._host_calls:
                self.table[0] = self._host_calls - 1
        elif self.table.device != torch.device(device):
            if self.table.device.type == "meta":  # statistics kept on 'meta' hold no data: start afresh
                self.table = None
                return self.materialize(device)
            self.table = self.table.to(device)
        return self.table

    def host_table(self) -> list[float] | None:
        """The table as Python floats (cached while ``reading()``); ``None`` on meta or unset."""
        from fxdebug.runtime.slots import host_copy

        if self._host is not None:
            return self._host
        return host_copy(self.table)

    @contextlib.contextmanager
    def reading(self) -> Any:
        """Read the table once for a whole report (one device-to-host copy)."""
        from fxdebug.runtime.slots import host_copy

        self._host = host_copy(self.table)
        try:
            yield self
        finally:
            self._host = None

    def forward(self, *anchors: Any) -> Tensor | None:
        if torch.compiler.is_compiling():
            return self._forward_traced(anchors)
        with _LOCK:  # the eager path: plain dict writes (nn.Module.__setattr__ costs ~2 µs) and one tick
            state = self.__dict__
            ticks = self._ticks
            if ticks:  # none exist before the first call asks for one
                for device_tick in ticks.values():
                    device_tick.add_(1)
            table = state["table"]
            if not self.rows:
                state["_host_calls"] += 1
                return table
            device = None
            for a in anchors:
                if isinstance(a, Tensor):
                    device = a.device
                    break
            if table is None or (device is not None and table.device != device):
                # made (or moved) before this call is counted: its slot 0 holds the calls before it, and the tick
                # below makes it this call's index (a table first made here, as a region copy's is, read 1 for the
                # first call, and its NaN origin lost to another graph's)
                table = self.materialize(device if device is not None else "cpu")
            state["_host_calls"] += 1
            cached = state["_tick"]
            if cached is None or cached[0] is not table:  # identity: the ticker is made once per table
                cached = state["_tick"] = (table, _ticker(table))
            cached[1]()
            return table

    def _forward_traced(self, anchors: tuple[Any, ...]) -> Tensor | None:
        """Under torch.compile: no host count (a Python int that changes every call would make
        every call recompile), no lock, and the tick as an indexing add the compiler sees."""
        for device_tick in self._ticks.values():
            device_tick.add_(1)
        table = self.table
        if self.rows:
            device = next((a.device for a in anchors if isinstance(a, Tensor)), None)
            if table is None or (device is not None and table.device != device):
                table = self.materialize(device if device is not None else "cpu")
            table[0] += 1
        return table

    def reset(self) -> None:
        self._ticks.clear()
        self._host_calls = 0
        if self.table is not None:
            device = self.table.device
            self.table = None
            self.materialize(device)

    def __deepcopy__(self, memo: dict[int, Any]) -> "Clock":
        new = Clock()
        new.training = self.training
        new.rows, new.spans = self.rows, list(self.spans)
        if self.table is not None:
            new.materialize(self.table.device)
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ticks"] = {}
        state["_host"] = None
        state["_tick"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("rows", 0)
        state.setdefault("spans", [])
        state.setdefault("table", None)
        state.setdefault("_host", None)
        state.setdefault("_tick", None)
        self.__dict__.update(state)
