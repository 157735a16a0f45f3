"""The pure-torch implementation of ``fxdebug::observe`` (same schema, same state layout).

Used for devices without a native kernel, on CPU when the C++ kernel could not be built, and
everywhere with ``FXDEBUG_KERNEL=torch``. No host sync, and few ops per call (each op is a
kernel launch on a GPU): one pass classifies every element (zero / finite / not NaN, by comparing
``|x|`` with three thresholds at once), four reductions give the sums and extremes, and the whole
16-slot row is folded in with one add, one min and one max against constant-shaped vectors:

    row' = max(min(row + D, lo_bounds), hi_bounds)

where ``D`` holds the additive slots (calls, counts, sums, norm, bad calls), ``lo_bounds`` is
``+inf`` except the min slot (this call's min) and the first-bad slot (this call's clock when it
saw a NaN/Inf), and ``hi_bounds`` is ``-inf`` except the max slot. ``torch.minimum`` /
``maximum`` propagate NaN, which is the kernel's rule (min/max read NaN once a NaN was seen).
Sums accumulate in float64, so float32 values up to its range never overflow the statistics.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from fxdebug.runtime.slots import INDEX, K

__all__ = ["observe_many_torch", "observe_torch"]

_I = INDEX
_F64 = torch.float64
_CONST: dict[tuple[Any, ...], tuple[Tensor, ...]] = {}
_ADD = tuple(_I[k] for k in ("calls", "stat_calls", "count", "sum", "sumsq", "abs", "zeros", "nan", "inf", "norm",
                             "bad_calls", "chan_mismatch", "reserved"))


def _const(device: torch.device, dtype: torch.dtype, n: int) -> tuple[Tensor, ...]:
    """Made once per (device, dtype, element count): the thresholds ``[0, max finite, inf]``
    (``|x| <= t`` classifies an element as zero / finite / not NaN), the masks of the additive and
    the min-like slots, and the 0-d constants the per-call row is stacked from."""
    key = (device, dtype, n)
    got = _CONST.get(key)
    if got is None:
        thresholds = torch.tensor([0.0, torch.finfo(dtype).max, math.inf], dtype=dtype)
        add = torch.zeros(K, dtype=torch.bool)
        add[list(_ADD)] = True
        mins = torch.zeros(K, dtype=torch.bool)
        mins[[_I["min"], _I["first_bad"]]] = True
        consts = torch.tensor([1.0, float(n), 0.0, math.inf], dtype=_F64)
        got = (thresholds.to(device), add.to(device), mins.to(device), *consts.to(device).unbind())
        _CONST[key] = got
        if len(_CONST) > 4096:
            _CONST.clear()
    return got


def observe_torch(x: Tensor, table: Tensor, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    """One call's statistics of ``x`` folded into row ``row`` of ``table`` (about 20 aten ops; no sync)."""
    if table.device != x.device:
        raise RuntimeError(f"fxdebug::observe: the observed tensor is on {x.device} but the instrumentation state is "
                           f"on {table.device}; keep the model and its inputs on one device.")
    base = K * (row + 1)
    if x.numel() == 0 or not x.is_floating_point():
        table[base + _I["calls"]] += 1
        return
    n = x.numel()
    thresholds, add, mins, one, cnt, zero, inf = _const(x.device, x.dtype, n)
    a = x.abs()
    zeros, finite, numeric = torch.le(a.reshape(-1, 1), thresholds).sum(0, dtype=_F64).unbind()
    norm = torch.linalg.vector_norm(x, 2, dtype=_F64)
    lo, hi = torch.aminmax(x)
    bad = finite < n  # a NaN or an Inf in this call
    # this call as a row, in the table's slot order (stack promotes to float64)
    call = torch.stack([one, one, cnt, x.sum(dtype=_F64), norm * norm, a.sum(dtype=_F64), zeros, cnt - numeric,
                        numeric - finite, lo, hi, norm, bad, torch.where(bad, table[0], inf), zero, zero])
    r = table[base: base + K]
    # additive slots add; min and first-bad take the minimum, max the maximum (NaN propagates:
    # the kernel's rule that min/max read NaN once a NaN was seen)
    torch.where(add, r + call, torch.where(mins, torch.minimum(r, call), torch.maximum(r, call)), out=r)
    if channels > 0 and x.dim() >= 2:
        d = channel_dim % x.dim()
        if x.shape[d] != channels:
            r[_I["chan_mismatch"]] = 1.0
            return
        cur = table[chan_off: chan_off + channels]
        torch.maximum(cur, x.amax(dim=[i for i in range(x.dim()) if i != d]), out=cur)


def observe_many_torch(xs: Sequence[Tensor], table: Tensor, args: Sequence[int]) -> None:
    for i, x in enumerate(xs):
        observe_torch(x, table, *args[4 * i: 4 * i + 4])
