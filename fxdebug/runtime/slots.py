"""Layout of the observation state: one float64 table per graph, on the observed device.

``table[0]`` is the clock (index of the current forward call, -1 before the first). Row ``r``
(one per observed node and phase) is ``table[K * (r + 1) : K * (r + 2)]``. Everything is fixed-size once the graph is instrumented, so
nothing grows with calls and ``torch.compile`` sees the same state on every call. Channel slots take whole rows right after their node's row, so allocating more rows later
(re-instrumenting) never moves what was allocated. The C++ kernel
(fxdebug/csrc/observe.cpp) and the pure-torch fallback (``fallback.py``) share this layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["K", "SLOTS", "init_table", "decode_row"]

K = 16
SLOTS = ("calls", "stat_calls", "count", "sum", "sumsq", "abs", "zeros", "nan", "inf", "min", "max", "norm",
         "bad_calls", "first_bad", "chan_mismatch", "reserved")
INDEX = {name: i for i, name in enumerate(SLOTS)}
_INIT = {"min": math.inf, "max": -math.inf, "first_bad": math.inf}


def init_table(rows: int, spans: list[tuple[int, int]], device: torch.device | str) -> Tensor:
    """A fresh table of ``rows`` rows on ``device``; ``spans`` (first index, count) are channel slots."""
    t = torch.zeros(rows + 1, K, dtype=torch.float64)
    for name, v in _INIT.items():
        t[1:, INDEX[name]] = v
    t = t.view(-1)
    t[0] = -1.0
    if spans:  # one indexed write (a slice write per node cost ~5 µs: 0.05 s at 10k nodes)
        t[torch.tensor([i for off, n in spans for i in range(off, off + n)], dtype=torch.long)] = -math.inf
    return t.to(device)


def decode_row(host: list[float], row: int) -> dict[str, float]:
    """Row ``row`` of a host copy of the table as ``{slot name: value}``."""
    base = K * (row + 1)
    return dict(zip(SLOTS, host[base: base + K]))


def host_copy(table: Any) -> list[float] | None:
    """The table as Python floats (the one sync), or ``None`` on a device holding no data."""
    if table is None or table.device.type == "meta":
        return None
    host: list[float] = table.detach().cpu().tolist()
    return host
