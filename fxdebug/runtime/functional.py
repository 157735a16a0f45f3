"""``fxdebug::observe`` as plain aten reductions, for graphs that torch.compile / export trace.

Registered at the op's ``Functionalize`` dispatch key (``kernel.load``): eager calls never reach
it (the C++, Triton or pure-torch kernel runs), but when AOTAutograd functionalises a graph for
Inductor, the op is replaced by these aten ops — the statistics of ``x`` as reductions over the
same elements and a functional update of the state row (``table[row].copy_(new_row)``, written
back to the table as an input mutation). Inductor then fuses the reductions with each other and
into the kernel that produces ``x``, on every backend it targets (C++ on CPU, Triton on GPU): no
``fxdebug`` extern call is left in the generated code, and the activation is not read back from
memory for its statistics.

Same rules as the kernels (runtime/slots.py): sums, squares and |x| in float64 (the conversion
happens in registers), exact NaN/Inf/zero counts, NaN-sticky min/max, the per-call L2 norm, bad
calls and the first bad call read from the device clock ``table[0]``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from fxdebug.runtime.slots import INDEX, K

__all__ = ["observe_functional", "observe_many_functional"]

_F64 = torch.float64
_I = INDEX
_ADD = [k in ("calls", "stat_calls", "count", "sum", "sumsq", "abs", "zeros", "nan", "inf", "norm", "bad_calls",
              "chan_mismatch", "reserved") for k in INDEX]
_MIN = [k in ("min", "first_bad") for k in INDEX]


def _update(x: Tensor, table: Tensor, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    base = K * (row + 1)
    r = table[base: base + K]
    dev = table.device
    if x.numel() == 0 or not x.is_floating_point():
        r.copy_(r + torch.tensor([1.0] + [0.0] * (K - 1), dtype=_F64, device=dev))
        return
    xd = x.to(_F64)
    s = xd.sum()
    sq = (xd * xd).sum()
    ab = xd.abs().sum()
    zeros = (xd == 0).sum(dtype=_F64)
    nan = torch.isnan(xd).sum(dtype=_F64)
    inf = torch.isinf(xd).sum(dtype=_F64)
    lo, hi = xd.amin(), xd.amax()  # NaN propagates, as in the kernels
    bad = (nan + inf) > 0
    one = torch.ones((), dtype=_F64, device=dev)
    zero = torch.zeros((), dtype=_F64, device=dev)
    never = torch.full((), math.inf, dtype=_F64, device=dev)
    call = torch.stack([one, one, one * x.numel(), s, sq, ab, zeros, nan, inf, lo, hi, sq.sqrt(), bad.to(_F64),
                        torch.where(bad, table[0], never), zero, zero])
    add = torch.tensor(_ADD, device=dev)
    mins = torch.tensor(_MIN, device=dev)
    r.copy_(torch.where(add, r + call, torch.where(mins, torch.minimum(r, call), torch.maximum(r, call))))
    if channels > 0 and x.dim() >= 2:
        d = channel_dim % x.dim()
        if x.shape[d] != channels:
            flag = table[base + _I["chan_mismatch"]: base + _I["chan_mismatch"] + 1]
            flag.copy_(torch.ones_like(flag))
            return
        cur = table[chan_off: chan_off + channels]
        cur.copy_(torch.maximum(cur, x.amax(dim=[i for i in range(x.dim()) if i != d]).to(_F64)))


def observe_functional(x: Tensor, table: Tensor, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    """The ``Functionalize`` kernel of ``fxdebug::observe``."""
    _update(x, table, row, chan_off, channels, channel_dim)


def observe_many_functional(xs: Sequence[Tensor], table: Tensor, args: Sequence[Any]) -> None:
    """The ``Functionalize`` kernel of ``fxdebug::observe_many``: one update per member."""
    for i, x in enumerate(xs):
        _update(x, table, *(int(a) for a in args[4 * i: 4 * i + 4]))
