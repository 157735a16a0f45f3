"""What a restoring step saves and takes back, so a skipped step leaves parameters and optimizer state
bitwise as they were without a host sync (used by ``fxdebug.guard``).

A plan groups the tensors once by device and dtype (not per step). Float32/float64 tensors are saved
and restored by a *conditional copy*: torch's fused SGD kernel, on its first step, sets the momentum
buffer to the gradient (a plain load and store) and returns at once under its ``found_inf`` flag, so
the copy happens only when the step is taken back. On the CPU, where the C++ extension is built, every
contiguous tensor (any dtype) goes to one ``fxdebug.CopyPlan`` instead (byte-for-byte copies under the
same flag, nothing touched on a good step). Other tensors are saved each step and selected back over
integer views of the same width (exact for NaN payloads, -0.0, Inf; nothing overflows)."""
from __future__ import annotations

import operator
from itertools import chain, repeat
from typing import Any, Protocol

import torch
from torch import Tensor

from fxdebug.runtime import kernel


class _Buffers(Protocol):
    def _buffer(self, t: Tensor) -> Tensor: ...


# the integer dtype of each width: a select over the bits of a tensor, exact for every value
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _live(state: Any, params: list[Tensor], params_too: bool) -> list[Any]:
    """What a step may change, in a fixed order: the parameters (``params_too``), then every value of
    their state entries (tensors and anything else: a value replaced or added changes the list).
    Built by C-level iteration: no Python per tensor."""
    values = list(chain.from_iterable(map(dict.values, map(state.get, params, repeat(_NO_STATE)))))
    return [*params, *values] if params_too else values


_NO_STATE: dict[str, Any] = {}


class _Plan:
    """The tensors a restoring step saves and takes back, grouped by device and dtype once (not per
    step): their copies, and how each group is copied (see ``Guard._restoring_step``)."""

    def __init__(self, owner: _Buffers, state: Any, live: list[Tensor], params: list[Tensor], params_too: bool) -> None:
        self.live, self.params, self.params_too = live, params, params_too  # (the identity to match)
        self.keys = {id(p): set(state.get(p, {})) for p in params}
        live = [t for t in live if isinstance(t, Tensor)]
        backs = {id(t): owner._buffer(t) for t in live}
        self.held = [(p, k, v, backs[id(v)]) for p in params for k, v in state.get(p, {}).items() if isinstance(v, Tensor)]
        # conditional copies: (device, tensors, copies, scratch views for the kernel's unused "param" output)
        self.copies: list[tuple[torch.device, list[Tensor], list[Tensor], list[Tensor]]] = []
        self.saved: tuple[list[Tensor], list[Tensor]] = ([], [])  # copied every step (the rest)
        self.groups: list[tuple[torch.device, torch.dtype, list[Tensor], list[Tensor]]] = []  # selected back over bits
        self.other: list[tuple[Tensor, Tensor]] = []  # bool, 1-byte, complex128, sparse: torch.where
        by_kind: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        rest: list[tuple[Tensor, Tensor]] = []
        # on the CPU, where the C++ extension is built: one CopyPlan (fxdebug/csrc/observe.cpp) copies
        # byte for byte when the flag is set, and on a good step reads the flag and returns, touching no
        # tensor (the fused SGD kernel's call unpacks three lists of tensors and dispatches over them)
        cls = kernel.copy_plan_class()
        self.native: list[Any] = []
        native: tuple[list[Tensor], list[Tensor]] = ([], [])
        for t in live:
            t, b = t.detach(), backs[id(t)]
            if cls is not None and _native_copies(t, b):
                native[0].append(t)
                native[1].append(b)
            elif _copies_on_device(t):
                ts, bs = by_kind.setdefault((t.device, t.dtype), ([], []))
                ts.append(t)
                bs.append(b)
            else:
                rest.append((t, b))
        if native[0]:
            try:
                self.native.append(cls(*native))
            except RuntimeError:  # a layout the class refuses: the fused kernel's copies, or copy-and-select
                for t, b in zip(*native):
                    if _copies_on_device(t):
                        ts, bs = by_kind.setdefault((t.device, t.dtype), ([], []))
                        ts.append(t)
                        bs.append(b)
                    else:
                        rest.append((t, b))
        for (dev, dtype), (ts, bs) in by_kind.items():
            scratch = torch.empty(max(t.numel() for t in ts), dtype=dtype, device=dev)
            # one view per shape, shared by the tensors of that shape on the CPU (the kernel walks the
            # tensors one after another there, and only a bad step writes it): fewer objects touched
            # per step. On an accelerator each tensor gets its own view (the kernel runs them at once).
            views: dict[Any, Tensor] = {}
            self.copies.append((dev, ts, bs, [
                views.setdefault(t.shape if dev.type == "cpu" else i, scratch[:t.numel()].view(t.shape))
                for i, t in enumerate(ts)]))
        self._select(rest)

    def _select(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Add ``(tensor, copy)`` pairs to those copied every step and selected back."""
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {
            (dev, bits): (ts, bs) for dev, bits, ts, bs in self.groups}
        for t, b in pairs:
            self.saved[0].append(t)
            self.saved[1].append(b)
            bits = _BITS.get(t.element_size())
            if bits is None or t.dtype == torch.bool or t.is_sparse:
                self.other.append((t, b))
                continue
            ts, bs = groups.setdefault((t.device, bits), ([], []))
            ts.append(t.view(bits))
            bs.append(b.view(bits))
        self.groups = [(dev, bits, ts, bs) for (dev, bits), (ts, bs) in groups.items()]

    def matches(self, live: list[Tensor], params: list[Tensor], params_too: bool) -> bool:
        return (params_too == self.params_too and len(live) == len(self.live) and len(params) == len(self.params)
                and all(map(operator.is_, live, self.live)) and all(map(operator.is_, params, self.params)))

    def save(self, bad: Tensor) -> None:
        """Before the step: the copies (the conditional ones only when ``bad``)."""
        for plan in self.native:
            plan.save(_on(bad, _CPU))
        if self.copies:
            self._skip = torch.rsub(bad, 1.0)  # found_inf of the conditional copies: 1.0 (return at once) on a good step
        for i, (dev, ts, bs, scratch) in enumerate(list(self.copies)):
            try:
                _copy_if(bs, ts, scratch, _on(self._skip, dev))
            except (RuntimeError, NotImplementedError, AttributeError):  # a torch build or device without the kernel: copy always
                self.copies.remove((dev, ts, bs, scratch))
                self._select(list(zip(ts, bs)))
        if self.saved[0]:
            torch._foreach_copy_(self.saved[1], self.saved[0])

    def restore(self, bad: Tensor) -> None:
        """After the step: what it changed back from the copies, when ``bad`` (0.0 or 1.0 on the device)."""
        for plan in self.native:
            plan.restore(_on(bad, _CPU))
        for dev, ts, bs, scratch in self.copies:
            _copy_if(ts, bs, scratch, _on(self._skip, dev))
        for dev, bits, ts, bs in self.groups:
            take = _on(bad, dev).to(bits)
            torch._foreach_mul_(ts, 1 - take)
            torch._foreach_addcmul_(ts, bs, [take] * len(bs))
        keep = None
        for t, b in self.other:
            keep = (bad > 0) if keep is None else keep
            torch.where(_on(keep, t.device), b, t, out=t)


def _on(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``. Without waiting, except from an accelerator to the CPU (parameters or
    state kept on the CPU while the flag is on the GPU): a CPU kernel reads the flag at once, so that
    copy must have landed — the one case that syncs, and only in such a split setup."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu" or t.device.type == "cpu")


_CPU = torch.device("cpu")


def _native_copies(t: Tensor, copy: Tensor) -> bool:
    """Whether ``t`` (and its copy) take the C++ ``CopyPlan``: dense, contiguous, on the CPU (any dtype:
    the copy is byte for byte)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous() and t.numel() > 0
            and copy.is_contiguous() and copy.nbytes == t.nbytes and not t.is_conj() and not t.is_neg())


def _copies_on_device(t: Tensor) -> bool:
    """Whether ``t`` takes the conditional copy (``_copy_if``): a dense float32/float64 tensor on
    CPU or CUDA, laid out contiguously (the kernel walks its memory linearly)."""
    return (t.dtype in (torch.float32, torch.float64) and t.device.type in ("cpu", "cuda") and not t.is_sparse
            and t.is_contiguous() and t.numel() > 0)


def _copy_if(dst: list[Tensor], src: list[Tensor], scratch: list[Tensor], skip: Tensor) -> None:
    """``dst[i].copy_(src[i])`` for every i unless ``skip`` (a 0-d float32 on their device) is 1.0 —
    decided by the kernel, no host sync. It is torch's fused SGD kernel on its first step with
    momentum: ``momentum_buffer = grad`` (a load and a store: bit for bit, NaN payloads, -0.0 and
    subnormals included; tests/test_guard.py checks it), and its ``found_inf`` input returns before
    any work; ``scratch`` takes the (unused) parameter update, ``src`` is only read."""
    torch._fused_sgd_(scratch, src, dst, weight_decay=0.0, momentum=1.0, lr=0.0, dampening=0.0, nesterov=False,
                      maximize=False, is_first_step=True, found_inf=skip)
