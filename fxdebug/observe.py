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

from typing import Any, Callable

import torch
from torch import Tensor, nn

__all__ = ["Clock", "Observer", "Probe", "Reductions"]


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class Reductions:
    """Lazily computed, cached reductions of one tensor, shared by all probes of a node.

    Keys: ``sum``, ``norm2`` (L2 norm), ``norm1`` (sum of |x|), ``min``, ``max`` (from one
    ``aminmax``), ``chan_max`` (max over every dim but dim 1; ``None`` below 2 dims), ``nonzero``
    (count), ``nan`` and ``inf`` (counts), ``numel``. Sums and norms accumulate in float32 (float64
    for float64 inputs), so half-precision activations do not overflow the statistics.
    """

    def __init__(self, x: Tensor) -> None:
        self.x = x
        self._cache: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._cache:
            self._compute(key)
        return self._cache[key]

    def _compute(self, key: str) -> None:
        x, c = self.x, self._cache
        acc = _acc_dtype(x)
        if key == "sum":
            c[key] = x.sum(dtype=acc)
        elif key == "norm2":
            c[key] = torch.linalg.vector_norm(x, 2, dtype=acc)
        elif key == "norm1":
            c[key] = torch.linalg.vector_norm(x, 1, dtype=acc)
        elif key in ("min", "max"):
            if x.numel() == 0:
                c["min"] = torch.full((), float("inf"), device=x.device, dtype=acc)
                c["max"] = torch.full((), float("-inf"), device=x.device, dtype=acc)
            elif x.dim() >= 2 and "chan_max" in c:
                c["max"] = c["chan_max"].max().to(acc)
                c["min"] = x.amin().to(acc)
            else:
                lo, hi = torch.aminmax(x)
                c["min"], c["max"] = lo.to(acc), hi.to(acc)
        elif key == "chan_max":
            if x.dim() < 2 or x.numel() == 0:
                c[key] = None
            else:
                dims = [d for d in range(x.dim()) if d != 1]
                c[key] = x.amax(dim=dims)
        elif key == "nonzero":
            c[key] = torch.count_nonzero(x)
        elif key == "nan":
            c[key] = torch.isnan(x).sum()
        elif key == "inf":
            c[key] = torch.isinf(x).sum()
        elif key == "numel":
            c[key] = x.numel()
        else:
            raise KeyError(f"no reduction named {key!r}; known: sum, norm2, norm1, min, max, chan_max, nonzero, nan, inf, numel")


class Clock(nn.Module):
    """Counts forward calls on the device, so probes can tell *which* call saw something first.

    One ``Clock`` node runs at the start of the graph; probes read ``clock.now(device)`` (a 0-d
    int64 tensor) and compare with tensor ops, never with Python ints, so the count never syncs.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ticks: dict[torch.device, Tensor] = {}
        self.calls = 0  # host-side count, for reports

    def now(self, device: torch.device) -> Tensor:
        t = self._ticks.get(device)
        if t is None:
            t = self._ticks[device] = torch.zeros((), dtype=torch.int64, device=device)
        return t

    def forward(self, *anchors: Any) -> None:
        self.calls += 1
        for t in self._ticks.values():
            t.add_(1)

    def reset(self) -> None:
        self._ticks.clear()
        self.calls = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> "Clock":
        new = Clock()
        new.training = self.training
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ticks"] = {}
        return state


class Probe:
    """One question asked of a node's output on every call. Subclass it in a pass.

    Attributes:
        key: identity of the probe; a node never holds two probes with the same key, which is
            what makes running a pass twice (or instrumenting twice) harmless.
        grads: also observe the gradient flowing into the node's output.
        wants_inputs: pass the node's tensor inputs to ``update`` (slow paths, e.g. raise mode).

    ``update`` must use tensor ops only in record mode (no ``.item()``, ``bool()``, ``if t:``).
    """

    key: str = "probe"
    grads: bool = False
    wants_inputs: bool = False

    def init_state(self, x: Tensor, phase: str) -> dict[str, Tensor]:
        """Fresh state for a tensor like ``x`` (same device); ``phase`` is "forward" or "grad"."""
        return {}

    def update(self, state: dict[str, Tensor], r: Reductions, ctx: "ObservationContext") -> None:
        """Fold this call's reductions into ``state``."""

    def summary(self, state: dict[str, Tensor], phase: str) -> dict[str, Any]:
        """Plain numbers for the report (may sync)."""
        return {}


class ObservationContext:
    """What a probe may look at during an update, besides the reductions."""

    __slots__ = ("node_name", "module_path", "op", "phase", "inputs", "clock", "observer")

    def __init__(self, observer: "Observer", phase: str, inputs: tuple[Any, ...], clock: Tensor | None) -> None:
        self.observer = observer
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

    def __init__(self, node_name: str, module_path: str, op: str, clock: Clock | None = None) -> None:
        super().__init__()
        self.node_name = node_name
        self.module_path = module_path
        self.op = op
        self.probes: dict[str, Probe] = {}
        self.states: dict[tuple[str, str], dict[str, Tensor]] = {}
        self.calls = 0
        object.__setattr__(self, "_clock", clock)  # shared, not a child: one clock per graph

    # -- set-up ---------------------------------------------------------------------------------
    def add_probe(self, probe: Probe) -> bool:
        """Attach ``probe``; returns False (and changes nothing) if one with its key is there."""
        if probe.key in self.probes:
            return False
        self.probes[probe.key] = probe
        return True

    @property
    def wants_inputs(self) -> bool:
        return any(p.wants_inputs for p in self.probes.values())

    @property
    def wants_grads(self) -> bool:
        return any(p.grads for p in self.probes.values())

    def reset(self) -> None:
        self.states.clear()
        self.calls = 0

    # -- runtime --------------------------------------------------------------------------------
    def forward(self, out: Any, *inputs: Any) -> None:
        if not isinstance(out, Tensor):
            return None
        self.calls += 1
        self._observe(out, "forward", inputs)
        if out.requires_grad and torch.is_grad_enabled() and self.wants_grads:
            out.register_hook(self._grad_hook)
        return None

    def _grad_hook(self, grad: Tensor) -> None:
        self._observe(grad, "grad", ())
        return None

    def _observe(self, x: Tensor, phase: str, inputs: tuple[Any, ...]) -> None:
        r = Reductions(x.detach())
        clock = self._clock.now(x.device) if self._clock is not None else None
        ctx = ObservationContext(self, phase, inputs, clock)
        with torch.no_grad():
            for key, probe in self.probes.items():
                if phase == "grad" and not probe.grads:
                    continue
                state = self.states.get((key, phase))
                if state is None or _state_device(state) not in (None, x.device):
                    state = self.states[(key, phase)] = (
                        {k: v.to(x.device) for k, v in state.items()} if state else probe.init_state(x, phase)
                    )
                probe.update(state, r, ctx)

    # -- reading --------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Every probe's numbers for this node, keys prefixed ``grad_`` for the gradient phase."""
        out: dict[str, Any] = {}
        for (key, phase), state in sorted(self.states.items()):
            probe = self.probes.get(key)
            if probe is None:
                continue
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
        self.__dict__.update(state)


def _state_device(state: dict[str, Tensor]) -> torch.device | None:
    for v in state.values():
        if isinstance(v, Tensor):
            return v.device
    return None


ProbeFactory = Callable[[], Probe]
