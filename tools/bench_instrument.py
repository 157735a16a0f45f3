"""``instrument()`` at scale: CPU ms and KB per graph node, ``python tools/bench_instrument.py [--large]``.

The model is one long ``nn.Sequential`` of small blocks, ``Sequential(Linear(4, 4), ReLU(),
Linear(4, 4), Tanh())`` — four graph nodes per block, so 10,000 nodes are 2,500 blocks (issue 33's
model) — instrumented with the README's first example, ``ShapeAssert(), NaNCheck(),
StatCollector()`` (``--passes cheap``: NaNCheck and StatCollector only, the earlier benchmark's
set; ``--model chain``: the earlier flat chain of Linear/ReLU modules), on a 2x4 example input,
through ``--frontend`` (``auto``, the default: what a user gets — above 1,000 modules that is the
symbolic snapshot today, and the table's "frontend" column says which ran; ``symbolic``;
``dynamo``: live at any size). Each size is instrumented ``--runs`` times in a fresh model; the
table gives the median CPU time (``time.process_time``, one thread) with min–max, per node and in
total, the first call's CPU time (the instrumented module generates its Python code lazily, at
the first call), the CPU time of a call at a new batch size (ShapeAssert checks every node's
shape once per new input signature), and tracemalloc figures per node from one separate run
(tracemalloc slows the run, so it is never timed): the peak during ``instrument()``, what is
held after it, and the peak during the first call. Sizes: 1k and 10k nodes, plus 100k with
``--large``. Targets: issue 26/27 ≤ 0.2 ms and ≤ 4 KB per node; issue 33, the README's passes:
10k nodes ≤ 3 s, 100k ≤ 30 s.
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
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector  # noqa: E402


def chain(nodes: int) -> nn.Module:
    """``nodes`` modules, alternating ``Linear(4, 4)`` and ``ReLU``: one graph node each."""
    layers: list[nn.Module] = []
    for i in range(nodes):
        layers.append(nn.Linear(4, 4) if i % 2 == 0 else nn.ReLU())
    return nn.Sequential(*layers)


def blocks(nodes: int) -> nn.Module:
    """``nodes // 4`` small blocks of four modules (Linear, ReLU, Linear, Tanh): one graph node each."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh())
                           for _ in range(max(1, nodes // 4))])


MODELS = {"blocks": blocks, "chain": chain}
PASSES = {"readme": lambda: [ShapeAssert(), NaNCheck(), StatCollector()], "cheap": lambda: [NaNCheck(), StatCollector()]}


def _frontend(dbg: object) -> str:
    report = getattr(dbg, "report", None)
    try:
        return str(report().frontend) if report is not None else "?"
    except Exception:  # noqa: BLE001 - a label only
        return "?"


def instrument_once(nodes: int, args: argparse.Namespace) -> tuple[float, float, float, int, str]:
    """CPU seconds of ``instrument()``, of the first call (the module generates its Python code
    lazily, at the first call: that cost moved there, so it is timed and shown beside it) and of a
    call at a new batch size; the graph's node count; the frontend that ran."""
    model, x = MODELS[args.model](nodes), torch.randn(2, 4)
    gc.collect()
    start = time.process_time()
    gm = fxdebug.instrument(model, PASSES[args.passes](), example_inputs=(x,), frontend=args.frontend)
    seconds = time.process_time() - start
    start = time.process_time()
    with torch.no_grad():
        gm(x)
    first = time.process_time() - start
    start = time.process_time()
    with torch.no_grad():
        gm(torch.randn(3, 4))
    new_batch = time.process_time() - start
    parts = gm.parts() if hasattr(gm, "parts") else {"": gm}
    graph_nodes = sum(len(p.graph.nodes) for p in parts.values() if hasattr(p, "graph"))
    frontend = _frontend(gm)
    del gm
    return seconds, first, new_batch, graph_nodes, frontend


def peak_bytes(nodes: int, args: argparse.Namespace) -> tuple[int, int, int]:
    """tracemalloc: peak during ``instrument()``, held after it, and peak during the first call."""
    model, x = MODELS[args.model](nodes), torch.randn(2, 4)
    gc.collect()
    tracemalloc.start()
    gm = fxdebug.instrument(model, PASSES[args.passes](), example_inputs=(x,), frontend=args.frontend)
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
    p.add_argument("--model", choices=sorted(MODELS), default="blocks")
    p.add_argument("--passes", choices=sorted(PASSES), default="readme")
    p.add_argument("--frontend", default="auto", help="auto (default), symbolic, dynamo, ...")
    args = p.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [1_000, 10_000] + ([100_000] if args.large else [])
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"# instrument() at scale — {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, one thread, median of {args.runs} (min–max), CPU time; model {args.model}, "
          f"passes {args.passes}, frontend={args.frontend!r}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| nodes | frontend | graph nodes after | instrument() s | ms / node | first call s (code generation) | "
          "new batch size s | KB / node: peak in instrument() | held after | peak in first call |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        runs = [instrument_once(n, args) for _ in range(args.runs)]
        secs, firsts, news = [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]
        med, first, new = statistics.median(secs), statistics.median(firsts), statistics.median(news)
        if args.no_memory:
            kb = "— | — | —"
        else:
            peak, held, first_peak = peak_bytes(n, args)
            kb = f"{peak / n / 1024:.1f} | {held / n / 1024:.1f} | {first_peak / n / 1024:.1f}"
        print(f"| {n:,} | {runs[0][4]} | {runs[0][3]:,} | {med:.2f} ({min(secs):.2f}–{max(secs):.2f}) | "
              f"{med / n * 1e3:.3f} ({min(secs) / n * 1e3:.3f}–{max(secs) / n * 1e3:.3f}) | "
              f"{first:.2f} ({min(firsts):.2f}–{max(firsts):.2f}) | {new:.2f} ({min(news):.2f}–{max(news):.2f}) | "
              f"{kb} |", flush=True)


if __name__ == "__main__":
    main()
