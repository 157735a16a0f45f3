"""``fxdebug.guard(optimizer, dbg=None)``: an optimizer step that a NaN cannot poison.

The guard wraps an optimizer. Its ``step()`` decides *on the device* whether this step is bad —
a gradient of its parameters holds NaN/Inf, or (with ``dbg=``) a node the instrumented model
watches saw NaN/Inf since the last step, or a ``torch.amp.GradScaler`` found an overflow — and
leaves every parameter and every optimizer state tensor (moments, momentum buffers, step counts)
bitwise as it was when so — and, when the guard knows the model (``dbg=``), the model's buffers
that the bad batch's forward already wrote (batch-norm statistics, any ``register_buffer`` updated
in ``forward``: ``fxdebug.training.buffers``). Nothing in ``step()`` reads a device value back to
the host:

* fused optimizers (``fused=True``) take the flag as their ``found_inf`` input, the same one
  ``GradScaler`` uses: the fused kernel skips the update and takes the step count back;
* every other optimizer (``foreach``, the per-tensor loop) steps as usual between a copy of what
  the step may change and a copy back, both conditional on the flag *in the kernel*: torch's fused
  SGD kernel, used as a copy (its first-step ``momentum_buffer = grad``), returns at once when its
  ``found_inf`` input is 1.0, so a good step copies nothing (``_copy_if``); on the CPU, where the
  C++ extension is built, one ``fxdebug.CopyPlan`` does the same (byte-for-byte copies when the flag
  is set; a good step reads the flag and returns). Tensors neither can take
  (bfloat16/float16, non-contiguous, other devices) are copied every step and selected back over
  their bits. The copies are buffers the guard keeps (one more copy of the parameters and their
  state in memory).

During ``step()`` the wrapped optimizer carries ``fxdebug_skipped`` (the flag) for its step hooks:
``ParamUpdates`` shows a step taken back as an update of 0.

A bad step therefore leaves the optimizer (and, with ``dbg=``, the model's buffers) exactly as a
run that never saw that batch: later steps match that run bit for bit. Without ``dbg=`` the guard
sees only the optimizer's parameters: buffers a bad forward wrote stay written. ``int(g.skipped)`` reads how many steps were skipped (the one sync,
when asked); ``g.skipped_steps`` lists them, with the node that made the NaN when ``dbg=`` is given.
"""

from __future__ import annotations

import operator
import sys
from typing import Any, Callable

import torch
from torch import Tensor, nn

from fxdebug.errors import ArgumentTypeError, UsageError
from fxdebug.runtime import kernel
from fxdebug.training.buffers import BufferPlan
from fxdebug.training.restore import _on, _Plan, _live
from fxdebug.training.watch import origin, watched_bad

__all__ = ["Guard", "guard"]

# What a state entry that a step creates would have held had the step not run (the value that
# makes the next step behave as a first step does): Adam's moments and step count start at 0; a
# momentum buffer of -0.0 turns SGD's ``buf * momentum + grad`` into exactly ``grad``, its first step.
_INITIAL = {"momentum_buffer": -0.0}
_LOG = 4096  # skipped steps whose step index and origin are kept (the count itself never saturates)
_UNSET = object()
_IS_CPU = operator.attrgetter("is_cpu")
_RING = 256  # steps whose skip flags wait on the device before they are folded into the count and the log


def guard(optimizer: torch.optim.Optimizer, dbg: Any = None) -> "Guard":
    """An optimizer-like wrapper whose ``step()`` changes nothing when the step is non-finite.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (SGD, Adam, AdamW, ...; fused, foreach or plain).
        dbg: an ``fxdebug.Instrumented`` model; a step is also skipped when any node it watches
            for NaN/Inf (``NaNCheck``) saw one since the previous step, and ``skipped_steps``
            names that node. A skipped step also takes back the model's buffers its forward wrote
            (batch-norm running statistics and ``num_batches_tracked``, any buffer ``forward``
            updates or replaces), from a copy made at the last good step (and at ``guard()``).
            A plain ``nn.Module`` is accepted too: its buffers are taken back, no node is watched.

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
    if dbg is not None and not isinstance(dbg, nn.Module):
        raise ArgumentTypeError(f"fxdebug.guard(optimizer, dbg=...): dbg must be an fxdebug.Instrumented model "
                                f"(fxdebug.instrument(...)) or the nn.Module being trained; got {type(dbg).__name__}.")
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
    _log: Tensor | None
    _origin_log: Tensor | None
    _ring: Tensor | None
    _ring_slots: tuple[Tensor, ...]
    _origin_ring: Tensor | None
    _ring_steps: list[int]
    _watch: dict[str, Any] | None
    _model_buffers: BufferPlan | None
    _buffers: dict[int, tuple[Tensor, Tensor]]

    def __init__(self, optimizer: torch.optim.Optimizer, dbg: Any = None) -> None:
        self.__dict__.update(optimizer=optimizer, dbg=dbg if _instrumented(dbg) else None, steps=0, _skipped=None, _log=None, _origin_log=None,
                             _ring=None, _ring_slots=(), _origin_ring=None, _ring_steps=[], _watch=None, _buffers={}, _plan=None,
                             _found={}, _all_state=None,
                             _model_buffers=BufferPlan(dbg) if isinstance(dbg, nn.Module) else None)
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
        self.__dict__.update(_plan=None, _all_state=None)
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
        """Steps skipped so far: a 0-d int64 tensor on the parameters' device (``int()`` it to read).
        Read the property again for a later count: the steps since are folded in when it is read."""
        self._fold()
        if self._skipped is None:
            return torch.zeros((), dtype=torch.int64)
        return self._skipped

    @property
    def skipped_steps(self) -> list[dict[str, Any]]:
        """``[{"step": index of the step() call (0-based), "origin": node or None}, ...]`` for each
        skipped step (the first 4,096); reading it syncs once. ``origin`` is, with ``dbg=``, the
        first watched node that saw NaN/Inf in that step (forward; else where the bad gradient
        entered), ``None`` when only the gradients were non-finite."""
        self._fold()
        if self._skipped is None or self._log is None:
            return []
        n = min(int(self._skipped), _LOG)
        steps = self._log[:n].tolist()
        origins: list[str | None] = [None] * n
        if self._origin_log is not None and self._watch is not None and self._origin_log.shape[1] == len(self._watch["labels"]):
            bad = self._origin_log[:n].cpu()
            labels = self._watch["labels"]
            for i in range(n):
                origins[i] = origin([labels[j] for j in range(len(labels)) if bad[i, j]])
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
            if self._model_buffers is not None:  # nothing to step: the forward's buffer writes stay
                self._model_buffers.after_step(torch.zeros(()))
            self.steps += 1
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
        if self._model_buffers is not None:
            self._model_buffers.after_step(bad)  # back to the last good step's copy when bad; else a new copy
        self._count(bad)
        self.steps += 1
        return loss

    def _bad(self, params: list[Tensor], device: torch.device, scaler_inf: Tensor | None,
             unscale: Tensor | None = None) -> Tensor:
        """0-d float32 on ``device``: 1.0 when this step must be skipped, else 0.0 (no sync).

        Gradients are checked element by element, exactly (no sum that could overflow): CPU
        gradients by ``fxdebug::any_nonfinite`` (a bit test on the exponent; reads them, writes
        nothing) where the C++ extension is built and no GradScaler asks to unscale; else with the op
        GradScaler uses (``_amp_foreach_non_finite_check_and_unscale_``), which multiplies them by
        ``unscale`` — 1.0 leaves them bitwise as they are."""
        flags = []
        grads = [g for p in params if (g := p.grad) is not None]  # (params: those with a gradient)
        dev0 = grads[0].device
        # (the usual case: one device, no dict to build; on the CPU asked of each tensor as a bool, no
        # device object made per gradient)
        if all(map(_IS_CPU, grads)) if dev0.type == "cpu" else all(g.device == dev0 for g in grads):
            by_device: dict[torch.device, list[Tensor]] = {dev0: grads}
        else:
            by_device = {}
            for g in grads:
                by_device.setdefault(g.device, []).append(g)
        for dev, on_dev in by_device.items():
            found = self._found_flag(dev)  # kept from step to step: zeroed, then set by the check
            check = self._read_only_check() if unscale is None and dev.type == "cpu" else None
            if check is not None:
                check(on_dev, found)  # reads each gradient once, writes none
            else:
                inv = self._ones(dev) if unscale is None else unscale.to(dev, non_blocking=True)
                torch._amp_foreach_non_finite_check_and_unscale_(on_dev, found, inv)
            flags.append(_on(found, device))
        if scaler_inf is not None:
            flags.append(scaler_inf.reshape(()).to(device=device, dtype=torch.float32, non_blocking=True))
        if self.dbg is not None:
            watched = watched_bad(self, device)
            if watched is not None:
                flags.append(watched)
        if len(flags) == 1 and scaler_inf is None:
            return flags[0]  # the check's own flag (or the watched nodes'): already exactly 0.0 or 1.0
        return (torch.stack(flags).amax() > 0).to(torch.float32)  # a scaler's found_inf sums over devices

    def _read_only_check(self) -> Callable[[list[Tensor], Tensor], None] | None:
        """``fxdebug::any_nonfinite`` (the C++ extension's CPU kernel: the same exact answer as the amp
        op, reading each gradient once and writing none), or ``None`` where the extension is not
        built (``FXDEBUG_NO_KERNEL=1``, no compiler): the amp op then. Looked up once per guard."""
        check = self.__dict__.get("_check", _UNSET)
        if check is _UNSET:
            check = self.__dict__["_check"] = kernel.any_nonfinite_op()
        return check

    def _found_flag(self, device: torch.device) -> Tensor:
        """The 0-d float32 flag the gradient check sets on ``device``, zeroed (one buffer, reused:
        it holds this step's decision until the next step's check)."""
        found = self._found.get(device)
        if found is None:
            found = self._found[device] = torch.zeros((), dtype=torch.float32, device=device)
        return found.zero_()

    def _ones(self, device: torch.device) -> Tensor:
        ones = self.__dict__.setdefault("_one", {})
        if device not in ones:
            ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return ones[device]

    def _fused_step(self, params: list[Tensor], bad: Tensor, scale: Tensor | None) -> None:
        opt = self.optimizer
        # SGD leaves uninitialised memory on a skipped first step: such parameters take the restoring
        # step. Once every parameter has state (kept from then on), the check is a length compare.
        fresh: list[Tensor] = []
        seen = self._all_state  # (state dict, its length, the parameters) when all of them last had state
        if (seen is None or seen[0] is not opt.state or seen[1] != len(opt.state) or len(seen[2]) != len(params)
                or not all(map(operator.is_, seen[2], params))):
            fresh = [p for p in params if not opt.state.get(p)]
            self.__dict__["_all_state"] = None if fresh else (opt.state, len(opt.state), params)
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
        """Note this step's flag: one copy into a ring on the device; every ``_RING`` steps (and when
        read) the ring is folded into the count and the log (``_fold``)."""
        ring = self._ring
        if ring is None or ring.device != bad.device:
            self._fold()
            ring = self._ring = torch.empty(_RING, dtype=torch.float32, device=bad.device)
            self.__dict__["_ring_slots"] = ring.unbind(0)  # one view per slot, made once
        i = len(self._ring_steps)
        self._ring_slots[i].copy_(bad)
        self._ring_steps.append(self.steps)
        watch = self._watch
        if watch is not None and watch.get("delta") is not None:
            delta = watch["delta"]
            origins = self._origin_ring
            if origins is None or origins.shape[1] != delta.numel() or origins.device != ring.device:
                self._fold(keep_last=True)
                i = 0
                origins = self._origin_ring = torch.zeros(_RING, delta.numel(), dtype=torch.bool, device=ring.device)
            origins.select(0, i).copy_(delta.view(-1))
        elif self._origin_ring is not None:
            self._origin_ring.select(0, i).zero_()  # no watched node this step: no origin
        if len(self._ring_steps) == _RING:
            self._fold()

    def _fold(self, keep_last: bool = False) -> None:
        """Fold the ring of per-step flags into the skipped count and the log of skipped steps (their
        indices and, with ``dbg=``, the watched nodes that went bad), on the device: no sync.
        ``keep_last``: the newest entry stays in the ring (its origins are about to be written)."""
        steps = self._ring_steps
        n = len(steps) - 1 if keep_last else len(steps)
        ring = self._ring
        if ring is None or n <= 0:
            return
        dev = ring.device
        if self._skipped is None or self._log is None:
            self._skipped = torch.zeros((), dtype=torch.int64, device=dev)
            self._log = torch.zeros(_LOG + _RING, dtype=torch.int64, device=dev)  # the tail: where unkept entries go
        elif self._skipped.device != dev:  # the parameters moved: the counts move with them
            self._skipped, self._log = self._skipped.to(dev), self._log.to(dev)
        flags = ring[:n].to(torch.int64)
        at = self._skipped + flags.cumsum(0) - 1  # each skipped step's place in the log
        spare = torch.arange(_LOG, _LOG + n, dtype=torch.int64, device=dev)  # a distinct unkept place each
        at = torch.where((flags > 0) & (at < _LOG), at, spare)
        self._log.index_copy_(0, at, torch.tensor(steps[:n], dtype=torch.int64).to(dev, non_blocking=True))
        origins = self._origin_ring
        if origins is not None:
            log = self._origin_log
            if log is None or log.shape[1] != origins.shape[1] or log.device != dev:
                log = self._origin_log = torch.zeros(_LOG + _RING, origins.shape[1], dtype=torch.bool, device=dev)
            log.index_copy_(0, at, origins[:n])
        self._skipped.add_(flags.sum())
        if keep_last:
            ring[0].copy_(ring[n])
            if origins is not None:
                origins[0].copy_(origins[n])
        del steps[:n]

def _instrumented(dbg: Any) -> bool:
    """Whether ``dbg`` is an ``fxdebug.Instrumented`` model, without importing it (and Dynamo with it)
    when nothing has: no model can be one before its module is imported."""
    module = sys.modules.get("fxdebug.instrumented.module")
    return module is not None and isinstance(dbg, module.Instrumented)


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
