"""Eval-mode latency of a residual CNN before and after ``Fuse()`` (median of timed runs).

Run: ``python tools/bench_fuse.py [batch] [size]``. Prints median and minimum times
of the two, measured interleaved, and their ratio.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

import fxdebug
from fxdebug.passes import Fuse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from zoo import ResidualCNN  # noqa: E402


def timed_ms(fns, x, reps: int = 100) -> list[list[float]]:
    """Times of each function, interleaved call by call so machine load hits both alike."""
    times: list[list[float]] = [[] for _ in fns]
    with torch.inference_mode():
        for fn in fns:
            for _ in range(5):
                fn(x)
        for _ in range(reps):
            for fn, out in zip(fns, times):
                start = time.perf_counter()
                fn(x)
                out.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ResidualCNN().eval()
    x = torch.randn(batch, 3, size, size)
    fused = fxdebug.instrument(model, [Fuse()], example_inputs=(x[:2],))
    plain, fast = timed_ms([model, fused], x)
    for label, pick in (("median", statistics.median), ("min", min)):
        p, f = pick(plain), pick(fast)
        print(f"{label}: unfused {p:.2f} ms, fused {f:.2f} ms, speed-up {p / f:.2f}x "
              f"(batch {batch}, {size}x{size}, 1 thread)")


if __name__ == "__main__":
    main()
