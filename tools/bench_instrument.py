"""``instrument()`` at scale: CPU ms and KB per graph node, ``python tools/bench_instrument.py [--large]``.

The graph is a long ``nn.Sequential`` of ``Linear(4, 4)`` / ``ReLU`` pairs (one graph node per
module), instrumented with ``NaNCheck()`` and ``StatCollector()`` through the symbolic frontend
on a 2x4 example input. Each size is instrumented ``--runs`` times in a fresh model; the table
gives the median CPU time (``time.process_time``, one thread) with min–max, per node and in
total, the first call's CPU time (the instrumented module generates its Python code lazily, at
the first call), and tracemalloc figures per node from one separate run (tracemalloc slows the
run, so it is never timed): the peak during ``instrument()``, what is held after it, and the
peak during the first call. Sizes: 1k and 10k nodes, plus 100k with ``--large``. Issue 26/27 targets:
≤ 0.2 ms and ≤ 4 KB per node (10k ≤ 2 s, 100k ≤ 20 s).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fxdebug  # noqa: E402
from fxdebug.passes import NaNCheck, StatCollector  # noqa: E402


def chain(nodes: int) -> nn.Module:
    """``nodes`` modules, alternating ``Linear(4, 4)`` and ``ReLU``: one graph node each."""
    layers: list[nn.Module] = []
    for i in range(nodes):
        layers.append(nn.Linear(4, 4) if i % 2 == 0 else nn.ReLU())
    return nn.Sequential(*layers)


def instrument_once(nodes: int) -> tuple[float, float, int]:
    """CPU seconds of ``instrument()`` and of the first call (the module generates its Python code
    lazily, at the first call: that cost moved there, so it is timed and shown beside it)."""
    model, x = chain(nodes), torch.randn(2, 4)
    gc.collect()
    start = time.process_time()
    gm = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    seconds = time.process_time() - start
    start = time.process_time()
    with torch.no_grad():
        gm(x)
    first = time.process_time() - start
    graph_nodes = len(gm.graph.nodes)
    del gm
    return seconds, first, graph_nodes


def peak_bytes(nodes: int) -> tuple[int, int, int]:
    """tracemalloc: peak during ``instrument()``, held after it, and peak during the first call."""
    model, x = chain(nodes), torch.randn(2, 4)
    gc.collect()
    tracemalloc.start()
    gm = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    with torch.no_grad():
        gm(x)
    _, first_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del gm
    return peak, held, first_peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--large", action="store_true", help="also 100k nodes (minutes)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--sizes", default="", help="comma-separated node counts (overrides the defaults)")
    p.add_argument("--no-memory", action="store_true", help="skip the tracemalloc run")
    args = p.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [1_000, 10_000] + ([100_000] if args.large else [])
    print(f"# instrument() at scale — {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, one thread, median of {args.runs} (min–max), CPU time")
    print("| nodes | graph nodes after | instrument() s | ms / node | first call s (code generation) | "
          "KB / node: peak in instrument() | held after | peak in first call |")
    print("|---|---|---|---|---|---|---|---|")
    for n in sizes:
        runs = [instrument_once(n) for _ in range(args.runs)]
        secs, firsts = [r[0] for r in runs], [r[1] for r in runs]
        med, first = statistics.median(secs), statistics.median(firsts)
        if args.no_memory:
            kb = "— | — | —"
        else:
            peak, held, first_peak = peak_bytes(n)
            kb = f"{peak / n / 1024:.1f} | {held / n / 1024:.1f} | {first_peak / n / 1024:.1f}"
        print(f"| {n:,} | {runs[0][2]:,} | {med:.2f} ({min(secs):.2f}–{max(secs):.2f}) | "
              f"{med / n * 1e3:.3f} ({min(secs) / n * 1e3:.3f}–{max(secs) / n * 1e3:.3f}) | "
              f"{first:.2f} ({min(firsts):.2f}–{max(firsts):.2f}) | {kb} |", flush=True)


if __name__ == "__main__":
    main()
