"""The pure-torch implementation of ``fxdebug::observe`` (same schema, same state layout).

Used for devices without a native kernel, on CPU when the C++ kernel could not be built, and
everywhere with ``FXDEBUG_KERNEL=torch``. No host sync, and few ops per call (each op is a
kernel launch on a GPU): one comparison classifies every element (zero / finite / not NaN, by
comparing ``|x|`` with three thresholds shaped to broadcast against ``x``, so no reshape), one
small matrix-vector product turns those three counts into the zero / NaN / Inf / non-finite
counts, four reductions give the sums and extremes, and the whole 16-slot row is folded in with one add and
one clamp against three per-call vectors taken at once from one vector of this call's values:

    row' = clamp(row + D, min=HI, max=LO)

where ``D`` holds the additive slots (calls, counts, sums, norm, bad calls; 0 elsewhere), ``LO``
is ``+inf`` except the min slot (this call's min) and the first-bad slot (this call's clock when
it saw a NaN/Inf), and ``HI`` is ``-inf`` except the max slot (this call's max). ``clamp``
propagates NaN from the value and from either bound, which is the kernel's rule (min/max read
NaN once a NaN was seen). Sums accumulate in float64, so float32 values up to its range never
overflow the statistics. 19 aten ops per call, views included (``tests/test_torch_path.py``).
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
_CONST: dict[tuple[Any, ...], tuple[Any, ...]] = {}


# Where each slot of D (additive), LO (min-like bounds) and HI (max-like bounds) is taken from in the
# per-call vector V = [zeros, NaN, Inf, non-finite counts (0-3), the same > 0 (4-7, the last: bad),
# the clock where > 0 else inf (8-11, the last: first-bad candidate), sum, sum of squares, sum of
# |x|, L2 norm, min, max (12-17), constants 1, n, 0, inf, -inf (18-22)].
_Z, _ONE, _N, _INF, _NINF = 20, 18, 19, 21, 22
_TAKE = [
    [_ONE, _ONE, _N, 12, 13, 14, 0, 1, 2, _Z, _Z, 15, 7, _Z, _Z, _Z],
    [_INF] * 9 + [16, _INF, _INF, _INF, 11, _INF, _INF],
    [_NINF] * 10 + [17] + [_NINF] * 5,
]


def _const(device: torch.device, dtype: torch.dtype, n: int, ndim: int) -> tuple[Any, ...]:
    """Made once per (device, dtype, element count, dims): the thresholds ``[0, max finite, inf]``
    shaped ``(3, 1, ..., 1)`` (``|x| <= t`` classifies an element as zero / finite / not NaN), the
    dims to reduce, the matrix and bias that turn those three counts into the zero / NaN / Inf /
    non-finite counts, the 0-d constants and the index that places V's values into D / LO / HI."""
    key = (device, dtype, n, ndim)
    got = _CONST.get(key)
    if got is None:
        thresholds = torch.tensor([0.0, torch.finfo(dtype).max, math.inf], dtype=dtype).view((3,) + (1,) * ndim)
        # [zeros, finite, not NaN] -> [zeros, NaN, Inf, non-finite] = bias + mix @ counts (exact: small integers)
        mix = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, -1.0, 1.0], [0.0, -1.0, 0.0]], dtype=_F64)
        bias = torch.tensor([0.0, float(n), 0.0, float(n)], dtype=_F64)
        consts = torch.tensor([1.0, float(n), 0.0, math.inf, -math.inf], dtype=_F64)
        take = torch.tensor(_TAKE, dtype=torch.int64)
        got = (thresholds.to(device), tuple(range(1, ndim + 1)), mix.to(device), bias.to(device), take.to(device),
               *consts.to(device).unbind())
        _CONST[key] = got
        if len(_CONST) > 4096:
            _CONST.clear()
    return got


def observe_torch(x: Tensor, table: Tensor, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    """One call's statistics of ``x`` folded into row ``row`` of ``table`` (19 aten ops; no sync)."""
    if table.device != x.device:
        raise RuntimeError(f"fxdebug::observe: the observed tensor is on {x.device} but the instrumentation state is "
                           f"on {table.device}; keep the model and its inputs on one device.")
    base = K * (row + 1)
    if x.numel() == 0 or not x.is_floating_point():
        table[base + _I["calls"]] += 1
        return
    n = x.numel()
    flat = x if x.dim() else x.reshape(1)  # a 0-d tensor: one dim to reduce
    thresholds, dims, mix, bias, take, one, cnt, zero, inf, ninf = _const(x.device, x.dtype, n, flat.dim())
    a = flat.abs()
    classes = torch.le(a, thresholds).sum(dims, dtype=_F64)  # zeros, finite, not NaN
    counts = torch.addmv(bias, mix, classes)  # zeros, NaN, Inf, non-finite
    seen = counts > 0  # the last: a NaN or an Inf in this call
    dated = torch.where(seen, table[0], inf)  # the last: this call's clock if it was bad
    norm = torch.linalg.vector_norm(flat, 2, dtype=_F64)
    lo, hi = torch.aminmax(flat)
    rest = torch.stack([flat.sum(dtype=_F64), norm * norm, a.sum(dtype=_F64), norm, lo, hi, one, cnt, zero, inf, ninf])
    values = torch.cat([counts, seen, dated, rest])  # promotes to float64
    add, upper, lower = torch.take(values, take).unbind()
    r = table[base: base + K]
    torch.clamp(r + add, min=lower, max=upper, out=r)
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
