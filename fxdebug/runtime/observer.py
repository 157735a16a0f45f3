"""Runtime side of observation: one ``Observer`` per watched node, shared by every probe on it.

Observe passes do not each insert their own op after a node: they attach a ``Probe`` to the
node's single ``Observer`` (see ``PassContext.observe``). The observer computes each reduction a
probe asks for at most once per call (``Reductions`` caches them), so ``NaNCheck`` and
``StatCollector`` on the same node share one ``aminmax``. Probes keep their state as tensors on
the device of the tensor they watch and update it with tensor ops only: nothing here reads a
value back to the host, so record mode never synchronises. Reading a summary (the report) is the
one place that syncs.

The observer returns nothing and no node uses its output: the model's dataflow is untouched,
which is what keeps observe-only instrumentation bitwise equal to the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor, nn

from fxdebug.runtime.clock import Clock, _locked
from fxdebug.runtime.columns import Column
from fxdebug.runtime.reductions import SAMPLE, Reductions, systematic_sample

__all__ = ["SAMPLE", "Clock", "FusedProbe", "FusedStats", "Observer", "Probe", "Reductions", "systematic_sample"]

class GradHookable(Protocol):
    """A tensor as far as gradient hooks go (torch leaves ``Tensor.register_hook`` unannotated)."""

    def register_hook(self, hook: Callable[[Tensor], Tensor | None]) -> Any: ...


class Probe:
    """One question asked of a node's output on every call. Subclass it in a pass.

    Attributes:
        key: identity of the probe; a node never holds two probes with the same key, which is
            what makes running a pass twice (or instrumenting twice) harmless.
        grads: also observe the gradient flowing into the node's output.
        wants_inputs: pass the node's tensor inputs to ``update`` (slow paths, e.g. raise mode).
        channel_dim: which dim of the output holds channels (1 for NCHW, -1 for (N, T, D)), or
            ``None``. The observer gives the first probe's non-``None`` value to ``Reductions``,
            so probes on one node agree on it and share the per-channel pass.
        columns: the ``fxdebug.Column`` declarations of the keys ``summary`` returns (roles such
            as ``ORIGIN`` and ``COLOR`` tell the report, table, picture and CLI what they mean).
            Keys left undeclared are shown as plain values.

    ``update`` must use tensor ops only in record mode (no ``.item()``, ``bool()``, ``if t:``).
    State values may be tensors (kept on the observed tensor's device), Python numbers (host
    counts known without a sync, such as element counts) or lists of tensors (pending values a
    probe folds later, which keeps per-call work to a minimum).
    """

    key: str = "probe"
    grads: bool = False
    wants_inputs: bool = False
    channel_dim: int | None = None
    columns: Sequence[Column] = ()
    fused: bool = False

    def init_state(self, x: Tensor, phase: str) -> dict[str, Tensor]:
        """Fresh state for a tensor like ``x`` (same device); ``phase`` is "forward" or "grad"."""
        return {}

    def update(self, state: dict[str, Tensor], r: Reductions, ctx: "ObservationContext") -> None:
        """Fold this call's reductions into ``state``."""

    def summary(self, state: dict[str, Tensor], phase: str) -> dict[str, Any]:
        """Plain numbers for the report (may sync)."""
        return {}


@dataclasses.dataclass
class FusedStats:
    """What the fused op accumulated for one node and phase since the last reset (host values).

    ``calls`` counts every call, ``stat_calls`` those with a non-empty tensor; ``count`` is the
    number of elements seen; ``sum``, ``sumsq`` and ``abs`` are float64 sums of x, x² and |x|;
    ``zeros``, ``nan``, ``inf`` element counts; ``min``/``max`` (NaN once a NaN was seen);
    ``norm`` the sum of per-call L2 norms; ``bad_calls`` calls with a NaN/Inf and
    ``first_bad`` the earliest such call (``None``: never); ``chan_max`` the max per channel
    (``None`` without channels or when the channel count changed between calls).
    """

    calls: int
    stat_calls: int
    count: int
    sum: float
    sumsq: float
    abs: float
    zeros: int
    nan: int
    inf: int
    min: float
    max: float
    norm: float
    bad_calls: int
    first_bad: int | None
    chan_max: list[float] | None

    @classmethod
    def from_table(cls, host: list[float], row: int, chan: tuple[int, int] | None) -> "FusedStats":
        from fxdebug.runtime.slots import decode_row

        d = decode_row(host, row)
        cm = None
        if chan is not None and chan[1] and not d["chan_mismatch"]:
            cm = host[chan[0]: chan[0] + chan[1]]
        first = d["first_bad"]
        return cls(calls=int(d["calls"]), stat_calls=int(d["stat_calls"]), count=int(d["count"]), sum=d["sum"],
                   sumsq=d["sumsq"], abs=d["abs"], zeros=int(d["zeros"]), nan=int(d["nan"]), inf=int(d["inf"]),
                   min=d["min"], max=d["max"], norm=d["norm"], bad_calls=int(d["bad_calls"]),
                   first_bad=None if math.isinf(first) else int(first), chan_max=cm)


class FusedProbe(Probe):
    """A probe whose numbers all come from the node's fused statistics (``FusedStats``).

    Its ``update`` is never called: the graph calls the fused op once per node and call, which
    reads the tensor once for every fused probe on the node; ``summary_from`` turns the
    accumulated statistics into report numbers. ``NaNCheck`` and ``StatCollector`` are fused
    probes, which is why watching every op costs one read of each activation.
    """

    fused = True

    def summary_from(self, stats: FusedStats, phase: str) -> dict[str, Any]:
        """Plain numbers for the report from the fused statistics of ``phase``."""
        return {}


class ObservationContext:
    """What a probe may look at during an update, besides the reductions."""

    __slots__ = ("node_name", "module_path", "op", "phase", "inputs", "clock", "call", "observer")

    def __init__(self, observer: "Observer", phase: str, inputs: tuple[Any, ...], clock: Tensor | None,
                 call: int = 0) -> None:
        self.observer = observer
        self.call = call  # host-side index of the current forward call (what ``clock`` holds)
        self.node_name = observer.node_name
        self.module_path = observer.module_path
        self.op = observer.op
        self.phase = phase
        self.inputs = inputs
        self.clock = clock


class Observer(nn.Module):
    """Watches one node's output (and optionally its gradient) for a set of probes.

    Inserted by ``PassContext.observe``; called as ``observer(output, *inputs)``; returns ``None``.
    """

    # Set directly in __init__ (through __dict__); declared here for type checkers.
    node_name: str
    module_path: str
    op: str
    probes: dict[str, Probe]
    states: dict[tuple[str, str], dict[str, Tensor]]
    fused_rows: dict[str, tuple[int, int, int, int]]
    _grads: bool
    _channel_dim: int | None
    _devices: dict[tuple[str, str], torch.device]
    _calls: int
    _clock: Clock | None  # shared, not a child

    # nn.Module.__init__ gives every module fifteen containers of its own (parameters, buffers,
    # children, hook tables: ~1.8 KB). An observer holds none of them and there is one per watched
    # node, so each is made on first use (``_Made``, below the class), as are the states of Python
    # probes; the plain values start as class defaults (a smaller instance dict).
    _is_full_backward_hook = None
    training = True
    _grads = False
    _channel_dim = None
    _calls = 0

    def __init__(self, node_name: str, module_path: str, op: str, clock: Clock | None = None) -> None:
        # Not nn.Module.__init__ (see above); plain values set directly (nn.Module.__setattr__
        # costs ~10 µs each, and a 10k-node graph makes 10k observers).
        # (``states``: (key, phase) -> state dict, ``_devices``: where each state lives; made on first use)
        self.__dict__.update(
            node_name=node_name, module_path=module_path, op=op,
            probes={},  # key -> Probe
            fused_rows={},  # phase -> (row, first channel slot, channels, channel dim); set by lowering
            _clock=clock,  # shared, not a child: one clock per graph
        )

    # -- set-up ---------------------------------------------------------------------------------
    def add_probe(self, probe: Probe) -> bool:
        """Attach ``probe``; returns False (and changes nothing) if one with its key is there."""
        if probe.key in self.probes:
            return False
        self.probes[probe.key] = probe
        state = self.__dict__  # plain values: skip nn.Module.__setattr__
        if probe.grads and not self._grads:
            state["_grads"] = True
        if self._channel_dim is None and probe.channel_dim is not None:
            state["_channel_dim"] = probe.channel_dim
        return True

    @property
    def wants_inputs(self) -> bool:
        return any(p.wants_inputs for p in self.probes.values())

    @property
    def wants_grads(self) -> bool:
        return self._grads

    @property
    def fused_probes(self) -> list[Probe]:
        return [p for p in self.probes.values() if p.fused]

    @property
    def fully_fused(self) -> bool:
        """Every probe reads fused statistics only: the graph can call the op directly."""
        return bool(self.probes) and all(p.fused and not p.wants_inputs for p in self.probes.values())

    @property
    def fused_channel_dim(self) -> int | None:
        return next((p.channel_dim for p in self.fused_probes if p.channel_dim is not None), None)

    def assign_rows(self, channels: int) -> None:
        """Allocate this node's fused rows in the clock's table (once; kept when re-lowered)."""
        if self._clock is None:
            return
        fused = self.fused_probes  # once: the lowering asks this of every observer
        if not fused:
            return
        cdim = next((p.channel_dim for p in fused if p.channel_dim is not None), None)
        phases = ("forward", "grad") if any(p.grads for p in fused) else ("forward",)
        for phase in phases:
            if phase in self.fused_rows:
                continue
            n = channels if (cdim is not None and phase == "forward") else 0
            row, off = self._clock.allocate(n)
            self.fused_rows[phase] = (row, off, n, cdim if cdim is not None else 0)

    @property
    def calls(self) -> int:
        """Forward calls seen (a lowered observer's count lives in the table: reading it may sync)."""
        fused = self.fused_rows.get("forward")
        host = self._clock.host_table() if (fused is not None and self._clock is not None) else None
        if host is not None and fused is not None:
            from fxdebug.runtime.slots import decode_row

            return max(self._calls, int(decode_row(host, fused[0])["calls"]))
        return self._calls

    @calls.setter
    def calls(self, value: int) -> None:
        self._calls = value

    def reset(self) -> None:
        self.__dict__.pop("states", None)  # made again on first use
        self.__dict__.pop("_devices", None)
        self._calls = 0

    # -- runtime --------------------------------------------------------------------------------
    def forward(self, out: Any, *inputs: Any) -> None:
        if not isinstance(out, Tensor):
            return None
        with _locked():
            if not torch.compiler.is_compiling():  # a changing Python int would recompile every call
                self._calls += 1
            self._observe(out, "forward", inputs)
        if self._grads and out.requires_grad and torch.is_grad_enabled():
            hooked: GradHookable = out
            hooked.register_hook(self._grad_hook)
        return None

    def _grad_hook(self, grad: Tensor) -> None:
        with _locked():
            self._observe(grad, "grad", ())
        return None

    def _observe(self, x: Tensor, phase: str, inputs: tuple[Any, ...]) -> None:
        fused = self.fused_rows.get(phase)
        if fused is not None and self._clock is not None:  # one fused read for every fused probe
            table = self._clock.table
            if table is None or table.device != x.device:
                table = self._clock.materialize(x.device)
            from fxdebug.runtime.kernel import observe_op

            observe_op()(x.detach(), table, *fused)
        python = [(k, p) for k, p in self.probes.items() if not p.fused and (phase == "forward" or p.grads)]
        if not python:
            return
        r = Reductions(x.detach(), self._channel_dim)
        clock = self._clock.now(x.device) if self._clock is not None else None
        call = max(self._clock._host_calls - 1, 0) if self._clock is not None else max(self._calls - 1, 0)
        ctx = ObservationContext(self, phase, inputs, clock, call)
        # No no_grad() block: reductions run on the detached tensor, so they record no graph,
        # and entering the context manager would cost as much as a reduction on small tensors.
        for key, probe in python:
            state = self.states.get((key, phase))
            if state is None or self._devices.get((key, phase)) != x.device:
                state = self._state_for(key, phase, probe, state, x)
            probe.update(state, r, ctx)

    def _state_for(self, key: str, phase: str, probe: Probe, state: dict[str, Any] | None, x: Tensor) -> dict[str, Any]:
        """A probe's state on ``x``'s device: new, or moved there (the model changed device)."""
        old = None if state is None else _state_device(state)
        if state is None or (old is not None and old.type == "meta" and x.device.type != "meta"):
            # nothing yet, or statistics kept on 'meta' (which holds no data): start afresh here
            state = probe.init_state(x, phase)
        elif old not in (None, x.device):
            state = _to_device(state, x.device)
        self.states[(key, phase)] = state
        self._devices[(key, phase)] = x.device
        return state

    # -- reading --------------------------------------------------------------------------------
    def columns(self) -> list[Column]:
        """Every probe's column declarations (grad-phase ones only for probes that watch grads)."""
        out: list[Column] = []
        for probe in self.probes.values():
            for c in probe.columns:
                if probe.grads or c.phase == "forward":
                    out.append(c)
                elif c.phase == "both":
                    out.append(_forward_only(c))
        return out

    def summary(self) -> dict[str, Any]:
        """Every probe's numbers for this node, keys prefixed ``grad_`` for the gradient phase."""
        out: dict[str, Any] = {}
        host = self._clock.host_table() if (self.fused_rows and self._clock is not None) else None
        for phase in ("forward", "grad"):
            fused = self.fused_rows.get(phase)
            if fused is None or host is None:
                continue
            stats = FusedStats.from_table(host, fused[0], (fused[1], fused[2]))
            if not stats.calls:
                continue  # never observed (e.g. no gradient flowed here): no numbers, as for Python probes
            for probe in self.fused_probes:
                if phase == "grad" and not probe.grads:
                    continue
                values = probe.summary_from(stats, phase)  # type: ignore[attr-defined]
                out.update({f"grad_{k}": v for k, v in values.items()} if phase == "grad" else values)
        with _locked():
            items = sorted(self.states.items())
        for (key, phase), state in items:
            found = self.probes.get(key)
            if found is None:
                continue
            probe = found
            with _locked():
                values = probe.summary(state, phase)
            if phase == "grad":
                values = {f"grad_{k}": v for k, v in values.items()}
            out.update(values)
        return out

    def extra_repr(self) -> str:
        return f"node={self.node_name!r}, probes={sorted(self.probes)}"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_devices", {})
        state.setdefault("fused_rows", {})
        if "calls" in state:
            state["_calls"] = state.pop("calls")
        self.__dict__.update(state)


_FORWARD: dict[int, tuple[Column, Column]] = {}  # id(column) -> (column, its forward-phase copy)


def _forward_only(column: Column) -> Column:
    """``column`` declared for the forward phase only (a probe that does not watch gradients), made once per
    column: a report asks it of every observer (55,000 ``dataclasses.replace`` were 40% of a 5,000-row report)."""
    hit = _FORWARD.get(id(column))
    if hit is None or hit[0] is not column:
        if len(_FORWARD) > 4096:
            _FORWARD.clear()
        hit = _FORWARD[id(column)] = (column, dataclasses.replace(column, phase="forward"))
    return hit[1]


class _Made:
    """A per-instance container that ``nn.Module.__init__`` would make eagerly, made on first use.

    A non-data descriptor: the first read stores a new one in the instance, which then shadows it."""

    def __init__(self, name: str, factory: Callable[[], Any]) -> None:
        self.name, self.factory = name, factory

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        made = obj.__dict__[self.name] = self.factory()
        return made


for _name, _factory in (("states", dict), ("_devices", dict), ("_parameters", dict), ("_buffers", dict), ("_modules", dict), ("_non_persistent_buffers_set", set),
                        *((h, OrderedDict) for h in (
                            "_backward_pre_hooks", "_backward_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
                            "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                            "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                            "_load_state_dict_post_hooks"))):
    setattr(Observer, _name, _Made(_name, _factory))


def _state_device(state: dict[str, Any]) -> torch.device | None:
    for v in state.values():
        if isinstance(v, Tensor):
            return v.device
    return None


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples) moved to ``device``."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value
