"""The pure-torch implementation of ``fxdebug::observe`` (same schema, same state layout).

Used for devices without a native kernel (CUDA: these reductions, each a fused device kernel,
with no host sync) and on CPU when the C++ kernel could not be built. It reads the tensor once
per statistic instead of once in all, so it is slower than the C++ kernel, but exact and
overflow-free in the same way: sums accumulate in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxdebug.runtime.slots import INDEX, K

__all__ = ["observe_torch"]

_I = INDEX


def observe_torch(x: Tensor, table: Tensor, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    if table.device != x.device:
        raise RuntimeError(f"fxdebug::observe: the observed tensor is on {x.device} but the instrumentation state is "
                           f"on {table.device}; keep the model and its inputs on one device.")
    base = K * (row + 1)
    r = table[base: base + K]
    r[_I["calls"]] += 1
    if x.numel() == 0 or not x.is_floating_point():
        return
    with torch.no_grad():
        x = x.detach()
        f64 = torch.float64
        s = x.sum(dtype=f64)
        sq = torch.linalg.vector_norm(x, 2, dtype=f64).square()
        ab = torch.linalg.vector_norm(x, 1, dtype=f64)
        nz = torch.count_nonzero(x).to(f64)
        nan = torch.isnan(x).sum().to(f64)
        inf = torch.isinf(x).sum().to(f64)
        lo, hi = x.amin().to(f64), x.amax().to(f64)  # NaN propagates, as in the C++ kernel
        n = float(x.numel())
        add = torch.stack([s, sq, ab, n - nz, nan, inf])
        r[_I["stat_calls"]] += 1
        r[_I["count"]] += n
        r[_I["sum"]: _I["inf"] + 1] += add
        r[_I["min"]] = torch.where(torch.isnan(r[_I["min"]]), r[_I["min"]], torch.minimum(r[_I["min"]], lo))
        r[_I["max"]] = torch.where(torch.isnan(r[_I["max"]]), r[_I["max"]], torch.maximum(r[_I["max"]], hi))
        r[_I["norm"]] += sq.sqrt()
        bad = (nan + inf) > 0
        r[_I["bad_calls"]] += bad.to(f64)
        r[_I["first_bad"]] = torch.where(bad, torch.minimum(r[_I["first_bad"]], table[0]), r[_I["first_bad"]])
        if channels > 0 and x.dim() >= 2:
            d = channel_dim % x.dim()
            if x.shape[d] != channels:
                r[_I["chan_mismatch"]] = 1.0
                return
            dims = [i for i in range(x.dim()) if i != d]
            cm = x.amax(dim=dims).to(f64)
            cur = table[chan_off: chan_off + channels]
            cur.copy_(torch.where(torch.isnan(cur), cur, torch.maximum(cur, cm)))
