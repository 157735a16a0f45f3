"""Paired per-call microbenchmarks of the instrumented forward's fixed costs: ``python tools/bench.py --suite calls``.

On a loaded machine a whole-model ratio moves by more than the few microseconds a per-call
constant costs, so each figure here is a *paired* difference: calls of A and B alternate one by
one (the order flipped every pair), each timed by ``perf_counter_ns``, and the table gives the
median of the per-pair differences A − B (plus both medians), repeated ``--repeats`` times
(median, min–max). What is measured, per model (one thread, no_grad, the suite's passes):

* ``clock``: ``Clock.forward`` now against the previous implementation (kept below, verbatim:
  an ``nn.Module.__setattr__`` per call, two compile checks, an in-place add on a view of slot 0);
* ``clock call``: the module call the graph makes (``self.fxdebug.clock(x)``) against no call;
* ``wrappers``: ``dbg(x)`` against ``dbg.forward(x)`` (the live guard, the mode check, the export
  signature routing, ``nn.Module.__call__`` and the failure diagnosis' ``try``);
* ``instrumented``: ``dbg(x)`` against the plain model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fxdebug  # noqa: E402
from bench_models import DEBUG_MODELS, collector_passes  # noqa: E402

Fn = Callable[[], Any]
DEFAULT_MODELS = ("zoo functional_ops", "zoo transformer_block", "mlp 20x256 batch 2", "hf bert 2L d64 2x16")


def _previous_clock_forward(clock: Any, *anchors: Any) -> Any:
    """``Clock.forward`` as it was before the C++ tick (commit d091273), for the paired comparison."""
    from fxdebug.runtime.clock import _locked

    with _locked():
        if not torch.compiler.is_compiling():
            clock._host_calls += 1
        for device_tick in clock._ticks.values():
            device_tick.add_(1)
        table = clock.table
        if clock.rows:
            device = next((a.device for a in anchors if isinstance(a, Tensor)), None)
            if table is None or (device is not None and table.device != device):
                table = clock.materialize(device if device is not None else "cpu")
            if torch.compiler.is_compiling():
                table[0] += 1
            else:
                cached = clock.__dict__.get("_previous_tick")
                if cached is None or cached[0] is not table:
                    cached = clock.__dict__["_previous_tick"] = (table, table.narrow(0, 0, 1))
                cached[1].add_(1)
        return table


def paired(fa: Fn, fb: Fn, pairs: int) -> tuple[float, float, float]:
    """(median µs of A, of B, median of the per-pair differences A − B)."""
    clock = time.perf_counter_ns
    for _ in range(20):
        fa()
        fb()
    ta, tb, diff = [], [], []
    for i in range(pairs):
        if i & 1:
            s = clock(); fb(); m = clock(); fa(); e = clock()  # noqa: E702
            b, a = m - s, e - m
        else:
            s = clock(); fa(); m = clock(); fb(); e = clock()  # noqa: E702
            a, b = m - s, e - m
        ta.append(a / 1e3)
        tb.append(b / 1e3)
        diff.append((a - b) / 1e3)
    return statistics.median(ta), statistics.median(tb), statistics.median(diff)


def measure(name: str, args: argparse.Namespace) -> list[tuple[str, str, list[tuple[float, float, float]]]]:
    model, x = DEBUG_MODELS[name](False)
    frontend = "export" if name.startswith("hf ") else "auto"
    dbg = fxdebug.instrument(model, collector_passes(False), example_inputs=x, frontend=frontend)
    clock = dbg._clock()
    anchor = next(a for a in x if isinstance(a, Tensor))
    with torch.no_grad():
        dbg(*x)
        cases: dict[str, tuple[str, Fn, Fn]] = {
            "clock": ("previous Clock.forward − now", lambda: _previous_clock_forward(clock, anchor),
                      lambda: clock.forward(anchor)),
            "clock call": ("clock module call − nothing", lambda: clock(anchor), lambda: None),
            "wrappers": ("dbg(x) − dbg.forward(x)", lambda: dbg(*x), lambda: dbg.forward(*x)),
            "instrumented": ("dbg(x) − model(x)", lambda: dbg(*x), lambda: model(*x)),
        }
        out = []
        for key, (what, fa, fb) in cases.items():
            if clock is None and key.startswith("clock"):
                continue
            out.append((key, what, [paired(fa, fb, args.pairs) for _ in range(args.repeats)]))
    return out


def render(name: str, rows: list[tuple[str, str, list[tuple[float, float, float]]]]) -> list[str]:
    lines = []
    for key, what, reps in rows:
        d = [r[2] for r in reps]
        a = statistics.median(r[0] for r in reps)
        b = statistics.median(r[1] for r in reps)
        lines.append(f"| {name} | {key} | {what} | {a:.1f} | {b:.1f} | **{statistics.median(d):.1f}** "
                     f"({min(d):.1f}–{max(d):.1f}) |")
    return lines


def run(args: argparse.Namespace, machine: Callable[[], str]) -> str:
    torch.set_num_threads(args.threads)
    names = args.models.split(",") if args.models else list(DEFAULT_MODELS)
    head = ["model", "case", "A − B", "A µs (median)", "B µs (median)", "A − B µs: **median** (min–max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        t0 = time.perf_counter()
        lines += render(name, measure(name, args))
        print(f"[bench] {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    text = "\n".join([f"# fxdebug per-call costs, paired (CPU, {args.threads} thread(s))", "",
                      f"Machine: {machine()}. {args.pairs} alternating pairs per repeat, {args.repeats} repeats; "
                      "timed by perf_counter_ns.", "", *lines, ""])
    print(text)
    Path(args.out).write_text(text + "\n")
    return text


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="fxdebug's paired per-call microbenchmarks")
    p.add_argument("--models", default="", help=f"comma-separated subset of {', '.join(DEBUG_MODELS)} "
                                                f"(default: {', '.join(DEFAULT_MODELS)})")
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench-calls.md")
    return p.parse_args(argv)
