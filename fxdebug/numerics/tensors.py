"""Small tensor helpers shared by the numerics tools: casting nested values, relative errors.

Everything here works on arbitrary nested values (tuples, lists, dicts of tensors, as FX node
arguments and outputs are) and stays on the device: errors are 0-d float64 tensors, never read
back, so the runtime modules that call these never synchronise with the host.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["float_leaves", "no_autocast", "rel_error", "tree_cast"]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def _map(fn: Any, value: Any) -> Any:
    """``fn`` over the leaves of tuples, lists and dicts (what FX arguments and outputs are made
    of); much cheaper than a general pytree walk on the per-call path."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map(fn, v) for v in value)
    if isinstance(value, list):
        return [_map(fn, v) for v in value]
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)):
        return value
    return pytree.tree_map(lambda t: fn(t) if isinstance(t, Tensor) else t, value)


def _leaves(value: Any, out: list[Tensor]) -> list[Tensor]:
    if isinstance(value, Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        for v in value:
            _leaves(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _leaves(v, out)
    elif not isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        out.extend(t for t in pytree.tree_leaves(value) if isinstance(t, Tensor))
    return out


def tree_cast(value: Any, dtype: torch.dtype, *, copy: bool = False, only_lower: bool = False) -> Any:
    """``value`` with every floating-point tensor inside cast to ``dtype``.

    ``copy=True`` returns a fresh tensor even when the dtype already matches, so an in-place op
    on the result never writes into the original. ``only_lower=True`` leaves tensors whose
    dtype is at least as wide as ``dtype`` alone (used to upcast bf16/fp16 to fp32 only).
    Non-floating tensors and non-tensors are returned as they are.
    """
    bits = torch.finfo(dtype).bits

    def cast(t: Tensor) -> Tensor:
        if not t.is_floating_point():
            return t
        if only_lower and torch.finfo(t.dtype).bits >= bits:
            return t.detach().clone() if copy else t
        if t.dtype == dtype:
            return t.detach().clone() if copy else t.detach()
        return t.detach().to(dtype)

    return _map(cast, value)


def float_leaves(value: Any) -> list[Tensor]:
    """Every floating-point tensor inside ``value``, in order."""
    return [t for t in _leaves(value, []) if t.is_floating_point()]


def rel_error(real: Any, ref: Any) -> Tensor | None:
    """``‖real − ref‖₂ / ‖ref‖₂`` over all floating tensors of two like-structured values.

    A 0-d float64 tensor on the tensors' device (no sync), or ``None`` when there is nothing to
    compare (no floating tensors, or the structures differ). When ``ref`` is all zeros the
    absolute error is returned instead. Non-finite values give ``inf`` or ``nan``.
    """
    a, b = float_leaves(real), float_leaves(ref)
    if not a or len(a) != len(b):
        return None
    pairs = [(x.detach(), y.detach()) for x, y in zip(a, b) if x.shape == y.shape and x.numel()]
    if not pairs:
        return None
    dev = pairs[0][1].device
    if len(pairs) == 1:
        x, y = pairs[0]
        y64 = y.to(dev, torch.float64)
        num = torch.linalg.vector_norm(x.to(dev, torch.float64) - y64)
        den = torch.linalg.vector_norm(y64)
    else:
        pairs64 = [(x.to(dev, torch.float64), y.to(dev, torch.float64)) for x, y in pairs]
        num = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x - y) for x, y in pairs64]))
        den = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(y) for _, y in pairs64]))
    # float64 norms overflow only beyond ~1e154; a shadow that large is reported as infinite error
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), num)


@contextlib.contextmanager
def no_autocast(device_type: str) -> Iterator[None]:
    """Run the enclosed ops at their inputs' own precision, even inside ``torch.autocast``."""
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            yield
    else:
        yield


def device_of(value: Any) -> torch.device:
    """The device of the first tensor inside ``value`` (CPU when there is none)."""
    for t in pytree.tree_leaves(value):
        if isinstance(t, Tensor):
            return t.device
    return torch.device("cpu")
