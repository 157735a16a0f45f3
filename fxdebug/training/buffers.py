"""The model's buffers a skipped step takes back (used by ``fxdebug.guard`` when it knows the model).

A bad batch's forward has already written the model's buffers before the guard sees its gradients:
batch-norm ``running_mean`` / ``running_var`` / ``num_batches_tracked``, and any tensor a module
registered with ``register_buffer`` and updates in ``forward``. Taking back only the parameters and
the optimizer state would leave NaN statistics in every batch norm, and ``model.eval()`` would output
NaN for ever.

So the guard keeps one copy of the buffers as they were at the last good step (taken when the guard
is made, then after every good step): a bad step copies them back, a good one copies them forward —
both conditional on the step's device flag, no host sync (the same conditional copies as the
optimizer state: ``fxdebug.CopyPlan`` on the CPU, torch's fused SGD kernel as a copy for float
tensors elsewhere, a select otherwise). A good step therefore costs one copy of the buffers (batch
norms: two vectors per layer). The buffers are looked up by module and name each step (a C-level
walk over a list made once): a buffer that ``forward`` *replaces* (``self.count = self.count + 1``)
is put back too. Not covered, said in docs/training.md: buffers registered after ``guard()`` was
called, a replacement of another shape, dtype or device (``model.to()`` after ``guard()``: adopted,
not taken back), and buffers written *between* ``step()`` and the next forward (a
``load_state_dict`` there: the copy is the state at the last step).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor, nn

from fxdebug.graph.edits import NAMESPACE
from fxdebug.runtime import kernel
from fxdebug.training.restore import _copies_on_device, _copy_if, _native_copies, _on

__all__ = ["BufferPlan", "model_buffers"]

_CPU = torch.device("cpu")
_GET: Any = dict.get  # (typed Any: map() over dict.get's overloads)


def model_buffers(model: nn.Module) -> list[tuple[dict[str, Any], str]]:
    """``(module._buffers, name)`` of every non-empty buffer of ``model`` (fxdebug's own left out)."""
    slots: list[tuple[dict[str, Any], str]] = []
    for path, module in model.named_modules():
        if path == NAMESPACE or path.startswith(NAMESPACE + "."):  # fxdebug's own modules: not the model's state
            continue
        for name, value in module._buffers.items():
            if isinstance(value, Tensor) and value.numel() > 0 and value.device.type != "meta":
                slots.append((module._buffers, name))
    return slots


class BufferPlan:
    """A copy of the model's buffers at the last good step, and the conditional copies that take a
    bad step's writes back (``after_step``)."""

    def __init__(self, model: nn.Module) -> None:
        slots = model_buffers(model)
        self.dicts = [d for d, _ in slots]
        self.names = [n for _, n in slots]
        self._build(self._held())

    def _held(self) -> list[Any]:
        """What each buffer slot holds now (a C-level walk: no Python per buffer)."""
        return list(map(_GET, self.dicts, self.names))

    def _build(self, current: list[Tensor]) -> None:
        self.tensors = current  # (what the slots held when the plan was made: the identity to match)
        unique = list({id(t): t for t in current}.values())
        with torch.no_grad():
            self.backs = {id(t): t.detach().clone(memory_format=torch.preserve_format) for t in unique}
        cls = kernel.copy_plan_class()
        self.native: list[Any] = []
        native: tuple[list[Tensor], list[Tensor]] = ([], [])
        by_device: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        self.rest: list[tuple[Tensor, Tensor]] = []
        for t in unique:
            t, b = t.detach(), self.backs[id(t)]
            if cls is not None and _native_copies(t, b):
                native[0].append(t)
                native[1].append(b)
            elif _copies_on_device(t):
                ts, bs = by_device.setdefault((t.device, t.dtype), ([], []))
                ts.append(t)
                bs.append(b)
            else:
                self.rest.append((t, b))
        if native[0]:
            try:
                self.native.append(cls(*native))
            except RuntimeError:  # a layout the class refuses: select them instead
                self.rest.extend(zip(*native))
        self.copies = []
        for (dev, dtype), (ts, bs) in by_device.items():
            scratch = torch.empty(max(t.numel() for t in ts), dtype=dtype, device=dev)
            self.copies.append((dev, ts, bs, [scratch[:t.numel()].view(t.shape) for t in ts]))

    def after_step(self, bad: Tensor) -> None:
        """``bad`` (0-d float32, 1.0 when the step was taken back): the buffers back to the copy when
        bad, else the copy brought up to them. No host sync."""
        if not self.dicts:
            return  # a model without buffers: nothing to take back
        current = self._held()
        if len(current) != len(self.tensors) or not all(map(operator.is_, current, self.tensors)):
            self._replaced(current, bad)
            return
        with torch.no_grad():
            good = torch.rsub(bad, 1.0)
            for plan in self.native:
                plan.restore(_on(bad, _CPU))
                plan.save(_on(good, _CPU))
            for dev, ts, bs, scratch in self.copies:
                _copy_if(ts, bs, scratch, _on(good, dev))  # skipped on a good step: back when bad
                _copy_if(bs, ts, scratch, _on(bad, dev))  # skipped on a bad step: forward when good
            for t, b in self.rest:
                torch.where(_on(bad, t.device) > 0, b, t, out=t)
                b.copy_(t)

    def _replaced(self, current: list[Any], bad: Tensor) -> None:
        """Some slot holds another tensor than the plan's (``forward`` reassigned a buffer, or the model
        moved): a same-kind replacement is selected back over the copy (a new tensor, no sync); anything
        else is adopted as it is. Then the plan is made again over what the slots hold."""
        with torch.no_grad():
            for d, name, now, old in zip(self.dicts, self.names, current, self.tensors):
                if now is old or not isinstance(now, Tensor):
                    continue
                back = self.backs.get(id(old))
                if back is not None and (back.shape, back.dtype, back.device) == (now.shape, now.dtype, now.device):
                    d[name] = torch.where(_on(bad, now.device) > 0, back, now.detach())
            # the buffers that stayed: taken back in place as usual, before the plan is made again
            kept = [t for t, now in zip(self.tensors, current) if now is t]
            for t in {id(t): t for t in kept}.values():
                b = self.backs[id(t)]
                torch.where(_on(bad, t.device) > 0, b, t.detach(), out=t.detach())
        slots = [(d, n) for d, n in zip(self.dicts, self.names) if isinstance(d.get(n), Tensor)]
        self.dicts, self.names = [d for d, _ in slots], [n for _, n in slots]
        self._build(self._held())
