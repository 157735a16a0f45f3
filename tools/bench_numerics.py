"""Overhead of the numerics tools against the plain model (forward, no grad, one thread).

    python tools/bench_numerics.py            # zoo models: residual_cnn, transformer_block

Prints, per model, the plain forward time and the ratios for NaNCheck, NaNCheck(history=64),
NaNCheck(history=64, on_nonfinite=...) and Shadow(). Best of 5 repeats; run on a quiet machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fxdebug  # noqa: E402
from fxdebug.passes import NaNCheck, Shadow  # noqa: E402
from zoo import ZOO  # noqa: E402


def bench(f, x, n: int) -> float:
    with torch.no_grad():
        for _ in range(5):
            f(x)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                f(x)
            best = min(best, (time.perf_counter() - t) / n)
    return best


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names:
        model, (x,) = ZOO[name]()
        model.eval()
        base = bench(model, x, 100)
        row = {"NaNCheck": [NaNCheck()], "history=64": [NaNCheck(history=64)],
               "+on_nonfinite": [NaNCheck(history=64, on_nonfinite=lambda r: None)], "Shadow": [Shadow()]}
        parts = [f"{name}: plain {base * 1e6:.0f} us"]
        for label, passes in row.items():
            dbg = fxdebug.instrument(model, passes, example_inputs=(x,))
            t = bench(dbg, x, 10 if label == "Shadow" else 100)
            parts.append(f"{label} x{t / base:.2f}")
        print("  ".join(parts))


if __name__ == "__main__":
    main(sys.argv[1:] or ["residual_cnn", "transformer_block"])
