"""``fxdebug.guard(optimizer, dbg=None)``: an optimizer step that a NaN cannot poison.

The guard wraps an optimizer. Its ``step()`` decides *on the device* whether this step is bad —
a gradient of its parameters holds NaN/Inf, or (with ``dbg=``) a node the instrumented model
watches saw NaN/Inf since the last step, or a ``torch.amp.GradScaler`` found an overflow — and
leaves every parameter and every optimizer state tensor (moments, momentum buffers, step counts)
bitwise as it was when so. Nothing in ``step()`` reads a device value back to the host:

* fused optimizers (``fused=True``) take the flag as their ``found_inf`` input, the same one
  ``GradScaler`` uses: the fused kernel skips the update and takes the step count back;
* every other optimizer (``foreach``, the per-tensor loop) steps as usual between a copy of what
  the step may change and a copy back, both conditional on the flag *in the kernel*: torch's fused
  SGD kernel, used as a copy (its first-step ``momentum_buffer = grad``), returns at once when its
  ``found_inf`` input is 1.0, so a good step copies nothing (``_copy_if``). Tensors it cannot take
  (bfloat16/float16, non-contiguous, other devices) are copied every step and selected back over
  their bits. The copies are buffers the guard keeps (one more copy of the parameters and their
  state in memory).

During ``step()`` the wrapped optimizer carries ``fxdebug_skipped`` (the flag) for its step hooks:
``ParamUpdates`` shows a step taken back as an update of 0.

A bad step therefore leaves the optimizer exactly as a run that never saw that batch: later steps
match that run bit for bit. ``int(g.skipped)`` reads how many steps were skipped (the one sync,
when asked); ``g.skipped_steps`` lists them, with the node that made the NaN when ``dbg=`` is given.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from fxdebug.errors import ArgumentTypeError, UsageError
from fxdebug.instrumented.module import Instrumented
from fxdebug.runtime.columns import NONFINITE
from fxdebug.runtime.slots import INDEX, K
from fxdebug.training.restore import _on, _Plan, _live

__all__ = ["Guard", "guard"]

# What a state entry that a step creates would have held had the step not run (the value that
# makes the next step behave as a first step does): Adam's moments and step count start at 0; a
# momentum buffer of -0.0 turns SGD's ``buf * momentum + grad`` into exactly ``grad``, its first step.
_INITIAL = {"momentum_buffer": -0.0}
_LOG = 4096  # skipped steps whose step index and origin are kept (the count itself never saturates)


def guard(optimizer: torch.optim.Optimizer, dbg: Any = None) -> "Guard":
    """An optimizer-like wrapper whose ``step()`` changes nothing when the step is non-finite.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (SGD, Adam, AdamW, ...; fused, foreach or plain).
        dbg: an ``fxdebug.Instrumented`` model; a step is also skipped when any node it watches
            for NaN/Inf (``NaNCheck``) saw one since the previous step, and ``skipped_steps``
            names that node.

    Use it where the optimizer was used, also with ``torch.amp.GradScaler`` (``scaler.step(g)``)::

        g = fxdebug.guard(torch.optim.AdamW(model.parameters()), dbg)
        loss.backward(); g.step(); g.zero_grad()
        int(g.skipped)  # steps skipped so far (reads the device once)
    """
    if isinstance(optimizer, Guard):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"fxdebug.guard(optimizer): expected a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                         "Pass the optimizer itself (not a scheduler or a list of parameters).")
    if dbg is not None and not isinstance(dbg, Instrumented):
        raise ArgumentTypeError(f"fxdebug.guard(optimizer, dbg=...): dbg must be an fxdebug.Instrumented model "
                                f"(fxdebug.instrument(...)); got {type(dbg).__name__}.")
    return Guard(optimizer, dbg)


class Guard(torch.optim.Optimizer):
    """See ``fxdebug.guard``. Attribute access not defined here reaches the wrapped optimizer.

    A ``torch.optim.Optimizer`` (so learning-rate schedulers accept it) that never runs
    ``Optimizer.__init__``: its groups and state are the wrapped optimizer's own objects."""

    # GradScaler hands an optimizer with this flag its scale and found_inf tensors instead of
    # reading found_inf on the host first: the guard folds them into its own device decision.
    _step_supports_amp_scaling = True

    # set in __init__ through __dict__ (attribute writes go there directly; see __setattr__)
    optimizer: torch.optim.Optimizer
    dbg: Any
    steps: int
    _skipped: Tensor | None
    _step_dev: Tensor | None
    _log: Tensor | None
    _origin_log: Tensor | None
    _watch: dict[str, Any] | None
    _buffers: dict[int, tuple[Tensor, Tensor]]

    def __init__(self, optimizer: torch.optim.Optimizer, dbg: Any = None) -> None:
        self.__dict__.update(optimizer=optimizer, dbg=dbg, steps=0, _skipped=None, _step_dev=None, _log=None,
                             _origin_log=None, _watch=None, _last_bad=None, _buffers={}, _device=None,
                             _plan=None)
        for group in optimizer.param_groups:
            _prepare_group(optimizer, group)

    # -- the optimizer's face ---------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]  # the wrapped optimizer's own object
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]  # the wrapped optimizer's own object
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]  # the wrapped optimizer's own object
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self._buffers.clear()
        self.__dict__["_plan"] = None
        for group in self.optimizer.param_groups:
            _prepare_group(self.optimizer, group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        _prepare_group(self.optimizer, self.optimizer.param_groups[-1])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__[name] = value  # GradScaler sets grad_scale / found_inf here for one step

    def __repr__(self) -> str:
        return f"fxdebug.guard({self.optimizer!r})"

    # -- what it counted ------------------------------------------------------------------------
    @property
    def skipped(self) -> Tensor:
        """Steps skipped so far: a 0-d int64 tensor on the parameters' device (``int()`` it to read)."""
        if self._skipped is None:
            return torch.zeros((), dtype=torch.int64)
        return self._skipped

    @property
    def skipped_steps(self) -> list[dict[str, Any]]:
        """``[{"step": index of the step() call (0-based), "origin": node or None}, ...]`` for each
        skipped step (the first 4,096); reading it syncs once. ``origin`` is, with ``dbg=``, the
        first watched node that saw NaN/Inf in that step (forward; else where the bad gradient
        entered), ``None`` when only the gradients were non-finite."""
        if self._skipped is None or self._log is None:
            return []
        n = min(int(self._skipped), _LOG)
        steps = self._log[:n].tolist()
        origins: list[str | None] = [None] * n
        if self._origin_log is not None and self._watch is not None:
            bad = self._origin_log[:n].cpu()
            labels = self._watch["labels"]
            for i in range(n):
                origins[i] = _origin([labels[j] for j in range(len(labels)) if bad[i, j]])
        return [{"step": s, "origin": o} for s, o in zip(steps, origins)]

    def report(self) -> Any:
        """``dbg.report()`` with ``skipped_steps`` filled in and one note per skipped step."""
        if self.dbg is None:
            raise UsageError("guard.report(): this guard has no instrumented model; use fxdebug.guard(optimizer, dbg=dbg) "
                             "or read g.skipped_steps.")
        rep = self.dbg.report()
        rep.skipped_steps = self.skipped_steps
        rep.notes.extend(f"guard: step {s['step']} skipped (non-finite"
                         + (f", origin {s['origin']})" if s["origin"] else " gradient)") for s in rep.skipped_steps)
        return rep

    # -- the step -------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = self.__dict__.get("grad_scale")  # set by GradScaler for this step (it deletes them after)
        scaler_inf = self.__dict__.get("found_inf")
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            self.steps += 1
            if self._step_dev is not None:
                self._step_dev.add_(1)
            return loss
        device = params[0].device
        fused = [bool(g.get("fused")) for g in self.optimizer.param_groups]
        if any(fused) and not all(fused):
            raise UsageError("fxdebug.guard: the optimizer mixes fused and unfused parameter groups; give every group the "
                             "same fused= setting.")
        # grads still scaled (GradScaler): a fused step unscales inside its kernel; else unscale here,
        # as GradScaler.unscale_ does (same op, same inverse)
        unscale = scale.double().reciprocal().float() if scale is not None and not all(fused) else None
        bad = self._bad(params, device, scaler_inf, unscale)
        # for the optimizer's step hooks (ParamUpdates): 1.0 on the device when this step is taken back
        setattr(self.optimizer, "fxdebug_skipped", bad)
        try:
            if all(fused):
                self._fused_step(params, bad, scale)
            else:
                self._restoring_step(params, bad, lambda: self.optimizer.step())
        finally:
            delattr(self.optimizer, "fxdebug_skipped")
        self._count(bad)
        self.steps += 1
        return loss

    def _bad(self, params: list[Tensor], device: torch.device, scaler_inf: Tensor | None,
             unscale: Tensor | None = None) -> Tensor:
        """0-d float32 on ``device``: 1.0 when this step must be skipped, else 0.0 (no sync).

        Gradients are checked element by element with the op GradScaler uses
        (``_amp_foreach_non_finite_check_and_unscale_``; exact, no sum that could overflow), which
        multiplies them by ``unscale`` — 1.0 leaves them bitwise as they are."""
        flags = []
        by_device: dict[torch.device, list[Tensor]] = {}
        for p in params:
            grad = p.grad
            if grad is not None and grad.numel():
                by_device.setdefault(grad.device, []).append(grad)
        for dev, grads in by_device.items():
            found = torch.zeros(1, dtype=torch.float32, device=dev)
            inv = self._ones(dev) if unscale is None else unscale.to(dev, non_blocking=True).reshape(1)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            flags.append(_on(found, device).reshape(()))
        if scaler_inf is not None:
            flags.append(scaler_inf.reshape(()).to(device=device, dtype=torch.float32, non_blocking=True))
        if self.dbg is not None:
            watched = self._watched_bad(device)
            if watched is not None:
                flags.append(watched)
        if not flags:
            return torch.zeros((), dtype=torch.float32, device=device)
        if len(flags) == 1 and scaler_inf is None:
            return flags[0]  # the check's own flag (or the watched nodes'): already exactly 0.0 or 1.0
        return (torch.stack(flags).amax() > 0).to(torch.float32)  # a scaler's found_inf sums over devices

    def _ones(self, device: torch.device) -> Tensor:
        ones = self.__dict__.setdefault("_one", {})
        if device not in ones:
            ones[device] = torch.ones(1, dtype=torch.float32, device=device)
        return ones[device]

    def _fused_step(self, params: list[Tensor], bad: Tensor, scale: Tensor | None) -> None:
        opt = self.optimizer
        fresh = [p for p in params if not opt.state.get(p)]  # SGD leaves uninitialised memory on a skipped first step
        setattr(opt, "grad_scale", scale)  # what fused optimizers read, as GradScaler sets them
        setattr(opt, "found_inf", bad)
        try:
            if fresh:
                self._restoring_step(fresh, bad, opt.step, params_too=False)
            else:
                opt.step()
        finally:
            delattr(opt, "grad_scale")
            delattr(opt, "found_inf")

    def _restoring_step(self, params: list[Tensor], bad: Tensor, step: Callable[[], Any], params_too: bool = True) -> None:
        """Run ``step`` between a copy of what it may change (into buffers kept from step to step)
        and a copy back, both taken only when ``bad`` — decided on the device, by the kernel.

        float32/float64 tensors on CPU and CUDA (all an optimizer usually holds): the copies are
        ``torch._fused_sgd_`` calls used as a conditional copy — its first-step momentum update
        ``buf = grad`` is a plain load and store, and its ``found_inf`` input (the one fused
        optimizers and ``GradScaler`` use) makes the kernel return at once when the step is good.
        So a good step costs two kernel launches, not a pass over the parameters and their state.
        Other tensors: copied every step and selected back over their bits (``t * (1 - bad) + copy
        * bad`` on integer views of the same width: exact for NaN/Inf/-0.0, nothing overflows).
        The tensors, copies and groups are a plan kept from step to step, rebuilt when the
        optimizer's state tensors change: no Python per tensor in a step."""
        state = self.optimizer.state
        live = _live(state, params, params_too)
        plan = self.__dict__.get("_plan")
        if plan is None or not plan.matches(live, params, params_too):
            plan = self.__dict__["_plan"] = _Plan(self, state, live, params, params_too)
        with torch.no_grad():
            plan.save(bad)
        step()
        with torch.no_grad():
            plan.restore(bad)
            after = _live(state, params, params_too)
            if len(after) != len(live) or not all(map(operator.is_, after, live)):
                self._restore_changed(plan, params, bad > 0)

    def _restore_changed(self, plan: "_Plan", params: list[Tensor], keep: Tensor) -> None:
        """The step replaced a state tensor (instead of updating it in place) or created entries:
        take the replaced ones back from their copies, and set the new ones to their initial values."""
        state = self.optimizer.state
        for p, k, v, back in plan.held:  # a state tensor the step replaced instead of updating in place
            now = state.get(p, {}).get(k)
            if isinstance(now, Tensor) and now is not v:
                state[p][k] = torch.where(keep.to(now.device), back.to(now.device), now)
                self._buffers.pop(id(v), None)  # the old tensor is gone: do not keep it alive
        for p in params:  # entries this step created: back to what they would start from
            st = state.get(p, {})
            before = plan.keys.get(id(p), ())
            for k, v in st.items():
                if k not in before and isinstance(v, Tensor):
                    init = torch.full_like(v, _INITIAL.get(k, 0.0))
                    torch.where(keep.to(v.device), init, v.detach(), out=v.detach())
        self.__dict__["_plan"] = None  # the next step sees other tensors

    def _buffer(self, t: Tensor) -> Tensor:
        """The persistent copy buffer of ``t`` (a parameter or an optimizer state tensor)."""
        buf = self._buffers.get(id(t))
        if buf is None or buf[0] is not t or buf[1].shape != t.shape or buf[1].dtype != t.dtype or buf[1].device != t.device:
            buf = (t, torch.empty_like(t, memory_format=torch.preserve_format))
            self._buffers[id(t)] = buf
        return buf[1]

    def _count(self, bad: Tensor) -> None:
        skipped, step, log = self._skipped, self._step_dev, self._log
        if skipped is None or step is None or log is None:
            skipped = self._skipped = torch.zeros((), dtype=torch.int64, device=bad.device)
            step = self._step_dev = torch.full((), self.steps, dtype=torch.int64, device=bad.device)
            log = self._log = torch.zeros(_LOG, dtype=torch.int64, device=bad.device)
        elif skipped.device != bad.device:  # the parameters moved: the counts move with them
            skipped = self._skipped = skipped.to(bad.device)
            step = self._step_dev = step.to(bad.device)
            log = self._log = log.to(bad.device)
        slot = skipped.clamp(max=_LOG - 1).view(1)
        log.index_copy_(0, slot, step.view(1))  # overwritten by the next skip unless this one is
        if self._origin_log is not None and self._watch is not None and self._watch.get("delta") is not None:
            self._origin_log.index_copy_(0, slot.to(self._origin_log.device),
                                         self._watch["delta"].view(1, -1).to(self._origin_log.device))
        skipped.add_(bad.to(torch.int64))
        step.add_(1)

    # -- with dbg=: did a watched node see NaN/Inf since the last step? ---------------------------
    def _watched_bad(self, device: torch.device) -> Tensor | None:
        watch = self._watch_plan()
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

    def _watch_plan(self) -> dict[str, Any] | None:
        """The ``bad_calls`` slots of every fused row that a NaN/Inf-watching probe reads, per state
        table; rebuilt when the model's tables change (a recapture, a reset, a move)."""
        quick = self._tables_key()
        if self._watch is not None and self._watch.get("quick") == quick:
            return self._watch  # the same parts and tables as last step: no walk over the observers
        observers = self.dbg.observers()
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
        if self._watch is not None and self._watch.get("key") == key:
            self._watch["quick"] = quick
            return self._watch
        if not rows:
            self._watch = None
            return None
        tables: dict[int, tuple[Tensor, list[int]]] = {}
        for t, i, _ in rows:
            tables.setdefault(id(t), (t, []))[1].append(i)
        labels: list[tuple[str, str]] = []  # in the order the concatenation lays them out: table by table, rows in graph order
        for tid, (t, idx) in tables.items():
            labels.extend(label for tt, i, label in rows if id(tt) == tid)
        plan = {"key": key, "quick": quick, "labels": labels,
                "tables": [(t, torch.tensor(idx, dtype=torch.long, device=t.device)) for t, idx in tables.values()]}
        first = next(iter(tables.values()))[0]
        self._origin_log = torch.zeros(_LOG, len(labels), dtype=torch.bool, device=first.device)
        self._watch = plan
        return plan


    def _tables_key(self) -> tuple[Any, ...]:
        """Identity of the model's captured parts and their state tables (cheap to compute)."""
        parts = self.dbg.parts()  # dbg: an Instrumented module (checked by guard())
        key = []
        for part in parts.values():
            clock = part._clock() if hasattr(part, "_clock") else None
            table = None if clock is None else clock.table
            key.append((id(part), id(table), None if clock is None else clock.rows))
        return tuple(key)


def _origin(bad: list[tuple[str, str]]) -> str | None:
    """The node a skipped step's NaN came from: the first watched node (graph order) whose output
    went bad forward; else the last one whose output gradient did (where the bad gradient entered)."""
    fwd = [n for n, phase in bad if phase == "forward"]
    if fwd:
        return fwd[0]
    grad = [n for n, phase in bad if phase == "grad"]
    return grad[-1] if grad else None


def _prepare_group(opt: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """On an accelerator, a non-fused Adam-style step count lives on the host; the guard cannot take
    it back without a sync, so such groups run capturable (the count on the device, same update)."""
    if group.get("fused") or "capturable" not in group:
        return
    devices = {p.device.type for p in group["params"]}
    if devices <= {"cpu", "meta"} or group["capturable"]:
        return
    group["capturable"] = True
    for p in group["params"]:
        st = opt.state.get(p)
        if st and isinstance(st.get("step"), Tensor):
            st["step"] = st["step"].to(p.device)


def _iter_params(opt: torch.optim.Optimizer) -> Iterator[Tensor]:
    for g in opt.param_groups:
        yield from g["params"]
