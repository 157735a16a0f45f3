"""``Profile``: fxdebug's node names in profiler traces, and per-node wall time as a report column.

``Profile()`` runs each selected node under ``torch.profiler.record_function("<node>")``, so a
``torch.profiler`` trace (and TensorBoard's profiler plugin) groups aten ops by graph node —
``layer1_0_conv1``, ``add_3`` — instead of one flat list. When no profiler is running, the
inserted calls return at once (one check of ``torch.autograd._profiler_enabled``).

``Profile(time=True)`` also measures each node's wall time: host ``perf_counter`` around the op
on CPU, CUDA events on GPU (read at the report, which is the only sync). The report gets
``time_ms`` (mean per call), ``time_total_ms`` and ``time_share`` (the node's time over the slowest
node's: 1.0 for the slowest, a ``COLOR`` column the picture can shade by). Timing brackets exactly
the node's op: the start node runs right before it, the stop node right after it (put ``Profile``
last in the pass list so no observer of another pass runs inside the bracket). Figures from
``time=True`` are for finding the slow node, not for benchmarking: the bracket itself costs a few
microseconds per node.
"""

from __future__ import annotations

import time as _time
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxdebug.authoring import (
    COLOR, GUARD, HIDDEN, Column, ObservationContext, Options, Pass, PassContext, PassResult, Probe, Reductions, Where,
    module_path, node_meta,
)

__all__ = ["Profile"]


class _Range(nn.Module):
    """Opens a ``record_function`` range (when a profiler runs) and, with timing on, notes the start."""

    def __init__(self, label: str, timer: "_Timer | None") -> None:
        super().__init__()
        self.label = label
        object.__setattr__(self, "_timer", timer)

    def forward(self, *deps: Any) -> Any:
        handle = None
        if torch.autograd._profiler_enabled():
            handle = torch.ops.profiler._record_function_enter_new(self.label, None)
        if self._timer is not None:
            self._timer.start(deps)
        return handle

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Range":
        import copy

        new = _Range(self.label, copy.deepcopy(self._timer, memo))
        memo[id(self)] = new
        return new


class _Stop(nn.Module):
    """Closes the range opened by ``_Range`` once the node's output exists; notes the stop time."""

    def __init__(self, timer: "_Timer | None") -> None:
        super().__init__()
        object.__setattr__(self, "_timer", timer)

    def forward(self, handle: Any, out: Any) -> None:
        if self._timer is not None:
            self._timer.stop(out)
        if handle is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(handle)
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Stop":
        import copy

        new = _Stop(copy.deepcopy(self._timer, memo))
        memo[id(self)] = new
        return new


def _device_of(value: Any) -> torch.device | None:
    if isinstance(value, Tensor):
        return value.device
    if isinstance(value, (list, tuple)):
        for v in value:
            d = _device_of(v)
            if d is not None:
                return d
    return None


class _Timer:
    """Brackets one node's op: host seconds on CPU, a CUDA event pair on GPU. Holds only the last
    call; ``TimeProbe`` folds it into the observer's state right after the op."""

    def __init__(self) -> None:
        self._t0: float | None = None
        self._event: Any = None
        self.last: float | tuple[Any, Any] | None = None

    def start(self, deps: tuple[Any, ...]) -> None:
        device = _device_of(deps)
        if device is not None and device.type == "cuda":
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
            self._t0 = None
        else:
            self._event = None
            self._t0 = _time.perf_counter()

    def stop(self, out: Any) -> None:
        if self._event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.last, self._event = (self._event, end), None
        elif self._t0 is not None:
            self.last, self._t0 = _time.perf_counter() - self._t0, None

    def take(self) -> float | tuple[Any, Any] | None:
        last, self.last = self.last, None
        return last

    def __getstate__(self) -> dict[str, Any]:
        return {"_t0": None, "_event": None, "last": None}


class TimeProbe(Probe):
    """Folds the node's last bracketed time into the observer's state (no reduction of the output)."""

    key = "profile_time"
    columns = (
        Column("time_ms", doc="mean wall time per call of the node's op, milliseconds"),
        Column("time_total_ms", roles=HIDDEN, doc="wall time over every call, milliseconds"),
        Column("time_share", roles=COLOR, threshold=0.5, label="time share",
               doc="the node's total time over the slowest profiled node's (the picture marks those >= 0.5)"),
    )

    def __init__(self, timer: _Timer, group: list["TimeProbe"]) -> None:
        self.timer = timer
        self.group = group  # every probe of the pass: the share is relative to the slowest
        group.append(self)
        self._state: dict[str, Any] | None = None

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        return {"seconds": 0.0, "calls": 0, "pending": []}

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        self._state = state
        last = self.timer.take()
        if last is None:
            return
        state["calls"] += 1
        if isinstance(last, tuple):
            state["pending"].append(last)  # CUDA events: read at the report
        else:
            state["seconds"] += last

    @staticmethod
    def _total(state: dict[str, Any]) -> float:
        for a, b in state["pending"]:
            b.synchronize()
            state["seconds"] += a.elapsed_time(b) / 1e3
        state["pending"] = []
        return state["seconds"]

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        if not state["calls"]:
            return {}
        total = self._total(state)
        live = [p._state for p in self.group if p._state is not None and p._state["calls"]]
        slowest = max((self._total(s) for s in live), default=0.0)
        return {"time_ms": 1e3 * total / state["calls"], "time_total_ms": 1e3 * total,
                "time_share": total / slowest if slowest > 0 else 0.0}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"] = None
        return state


class Profile(Pass):
    """Each selected node runs inside a profiler range named after it; ``time=True`` adds wall times.

    Args:
        time: also measure per-node wall time (columns ``time_ms``, ``time_share``; see the module
            docstring).
        where: limit the profiled nodes (globs, ``fxdebug.outputs_of``, or a predicate).
    """

    name = "profile"
    observe_only = True

    def __init__(self, time: bool = False, *, where: Where = None) -> None:
        super().__init__(where=where)
        self.time = Options(self).flag("time", time)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        group: list[TimeProbe] = []
        added: list[Node] = []
        for node in ctx.nodes(gm, self.where):
            if str(node.target).startswith("fxdebug.") and node.op == "call_module":
                continue
            timer = _Timer() if self.time else None
            if timer is not None:  # the observer first, so the stop lands between the op and it
                obs = ctx.observe(node, TimeProbe(timer, group))
                if obs is not None:
                    added.append(obs)
            deps = tuple(a for a in node.all_input_nodes)
            with gm.graph.inserting_before(node):
                name = ctx.add_module(gm, f"profile_{node.name}", _Range(node.name, timer))
                start = gm.graph.call_module(name, deps, {})
            stop = ctx.insert_after(node, _Stop(timer), (start, node), hint=f"profile_end_{node.name}")
            for n in (start, stop):
                meta = node_meta(n)
                meta.watch(GUARD)
                ctx.record(n, {"times": node.name})
                meta.module, meta.keep_unused = module_path(node), True
            added += [start, stop]
        return PassResult(gm, added=added)
