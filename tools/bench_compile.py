"""``torch.compile(dbg)`` against ``torch.compile(model)`` (issue 32 item 4): steady-state per call and cold compile.

For each model (debugging sizes, ``bench_models.DEBUG_MODELS``), CPU, one thread:

* cold compile: the first call of ``torch.compile(model)`` and, in another process, of
  ``torch.compile(dbg)`` (``--cold`` pairs, alternating which goes first; median of each; on a shared
  machine one pair varies 2x either way) (``dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs)``,
  its instrument() time given apart). Each process has a fresh Inductor cache directory and the FX-graph
  and autograd caches off (a kernel compiled for one would be found by the other), and compiles a tiny
  unrelated function first, so that neither pays Inductor's one-time start-up;
* steady state: in one process, both compiled modules called in interleaved rounds (``--rounds`` x
  ``--calls``), per-call medians per round; the ratio is the median of the per-round ratios, with its
  spread (min..max) across rounds.

Bars (docs/performance.md): steady <= 1.30x median, cold <= 1.5x. Dynamo's counters give the graphs and graph
breaks of each first call (the live module's: its model graph compiled for the outer backend, and the
instrumented graph Inductor compiles; graph breaks beyond the model's own would show in the last column).

    python tools/bench_compile.py                  # the four models of the issue
    python tools/bench_compile.py --models "hf gpt2 2L d64 2x16" --rounds 5
    python tools/bench_compile.py --cold 0         # steady state only
    python tools/bench_compile.py --stats inline   # the observation as reductions Inductor fuses into the producers
    python tools/bench_compile.py --cold 0 --baseline /tmp/base   # steady state here and in another checkout

``--baseline DIR``: a checkout of an earlier tree (``git archive <commit> | tar -x -C DIR``); its steady state is
measured by its own ``tools/bench_compile.py`` in processes alternating with this tree's (``--pairs`` each), so a
before/after pair shares the machine's load; the table gives both, each the median over its processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["resnet18-style 1x3x64x64", "hf gpt2 2L d64 2x16", "hf llama 2L d64 2x16", "vit-s-style 2 blocks 1x3x64x64"]


def _setup() -> Any:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tools"))
    import torch

    torch.set_num_threads(1)
    return torch


def _build(name: str) -> tuple[Any, tuple[Any, ...]]:
    from bench_models import DEBUG_MODELS

    return DEBUG_MODELS[name](False)


def _warm_inductor(torch: Any) -> None:
    """Inductor's one-time start-up (imports, compiler checks) paid before anything is timed."""
    f = torch.compile(lambda t: (t * 2).relu().sum())
    f(torch.randn(8))


def _instrumented(model: Any, inputs: tuple[Any, ...]) -> tuple[Any, float]:
    import fxdebug
    from bench_models import collector_passes

    t0 = time.perf_counter()
    dbg = fxdebug.instrument(model, collector_passes(False), example_inputs=inputs)
    return dbg, time.perf_counter() - t0


def cold(name: str, variant: str) -> dict[str, Any]:
    """One process: the first call of the compiled plain model or of the compiled instrumented one."""
    torch = _setup()
    model, inputs = _build(name)
    _warm_inductor(torch)
    out: dict[str, Any] = {}
    subject = model
    if variant == "fxdebug":
        subject, out["instrument_s"] = _instrumented(model, inputs)
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(subject)
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled(*inputs)
        out["compile_s"] = time.perf_counter() - t0
    out["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    out["breaks"] = int(sum(torch._dynamo.utils.counters["graph_break"].values()))
    if variant == "fxdebug":
        out["notes"] = [n for n in subject.report().notes if n.startswith(("backend:", "dynamo:"))]
    return out


def steady(name: str, rounds: int, calls: int) -> dict[str, Any]:
    """One process: both compiled modules, interleaved rounds; per-call medians."""
    torch = _setup()
    model, inputs = _build(name)
    plain = torch.compile(model)
    dbg, _ = _instrumented(model, inputs)
    instrumented = torch.compile(dbg)
    fns = {"plain": plain, "fxdebug": instrumented}
    per: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(3):
                fn(*inputs)
        for _ in range(rounds):
            for key, fn in fns.items():
                times = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    fn(*inputs)
                    times.append(time.perf_counter() - t0)
                per[key].append(statistics.median(times))
    ratios = [f / p for f, p in zip(per["fxdebug"], per["plain"])]
    return {"plain_ms": statistics.median(per["plain"]) * 1e3, "fxdebug_ms": statistics.median(per["fxdebug"]) * 1e3,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "rows": len(dbg.report().rows)}


def _child(args: list[str], cache: bool = False, stats: str = "extern", root: str | None = None) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", FXDEBUG_COMPILE_STATS=stats)
    if not cache:
        env.update(TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="fxdebug_bench_compile_"),
                   TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    script = str(Path(root) / "tools" / "bench_compile.py") if root else __file__
    done = subprocess.run([sys.executable, script, "--child", json.dumps(args)], capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{args}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=MODELS)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--stats", choices=("extern", "inline"), default="extern",
                   help="the observation in compiled graphs: one extern op call per node, or inlined reductions")
    p.add_argument("--cold", type=int, default=3, help="cold-compile processes per variant (alternating order); 0: steady state only")
    p.add_argument("--baseline", help="another checkout whose steady state is measured alongside (before/after)")
    p.add_argument("--pairs", type=int, default=2, help="with --baseline: processes per tree, alternating")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, *rest = json.loads(a.child)
        print(json.dumps(cold(*rest) if kind == "cold" else steady(rest[0], int(rest[1]), int(rest[2]))))
        return
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} CPUs); observation: {a.stats}")
    if a.baseline:
        _compare(a)
        return
    print("| model | plain ms | fxdebug ms | steady ratio (min..max) | compile s plain | compile s fxdebug | "
          "cold ratio | instrument s | graphs plain / fxdebug | graph breaks plain / fxdebug |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in a.models:
        if a.cold == 0:  # steady state only (a loaded machine: the cold pairs take minutes)
            st = _child(["steady", name, a.rounds, a.calls], cache=a.stats == "extern", stats=a.stats)
            print(f"| {name} | {st['plain_ms']:.2f} | {st['fxdebug_ms']:.2f} | {st['ratio']:.2f}x "
                  f"({st['ratio_min']:.2f}..{st['ratio_max']:.2f}) | - | - | - | - | - | - |", flush=True)
            continue
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "fxdebug": []}
        for i in range(a.cold):
            for variant in (("plain", "fxdebug") if i % 2 == 0 else ("fxdebug", "plain")):
                runs[variant].append(_child(["cold", name, variant], stats=a.stats))
        cp = {"compile_s": statistics.median(r["compile_s"] for r in runs["plain"]), "graphs": runs["plain"][0]["graphs"],
              "breaks": runs["plain"][0]["breaks"]}
        cf = {"compile_s": statistics.median(r["compile_s"] for r in runs["fxdebug"]), "graphs": runs["fxdebug"][0]["graphs"],
              "breaks": runs["fxdebug"][0]["breaks"], "instrument_s": statistics.median(r["instrument_s"] for r in runs["fxdebug"]),
              "notes": runs["fxdebug"][0].get("notes", []),
              "spread": [round(r["compile_s"], 1) for r in runs["fxdebug"]],
              "plain_spread": [round(r["compile_s"], 1) for r in runs["plain"]]}
        # the FX graph cache does not key on the inline registration: a fresh one for it
        st = _child(["steady", name, a.rounds, a.calls], cache=a.stats == "extern", stats=a.stats)
        print(f"| {name} | {st['plain_ms']:.2f} | {st['fxdebug_ms']:.2f} | {st['ratio']:.2f}x "
              f"({st['ratio_min']:.2f}..{st['ratio_max']:.2f}) | {cp['compile_s']:.1f} | {cf['compile_s']:.1f} | "
              f"{cf['compile_s'] / cp['compile_s']:.2f}x | {cf['instrument_s']:.1f} | {cp['graphs']} / {cf['graphs']} | "
              f"{cp['breaks']} / {cf['breaks']} |",
              flush=True)
        print(f"  {name}: cold compile s, each run: plain {cf['plain_spread']}, fxdebug {cf['spread']}")
        for note in cf.get("notes", []):
            print(f"  {name}: {note}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


def _compare(a: argparse.Namespace) -> None:
    """Steady state of ``a.baseline`` and of this tree, in alternating processes (``a.pairs`` each), per model."""
    print(f"baseline: {a.baseline}")
    print("| model | plain ms | fxdebug ms before | fxdebug ms after | ratio before (min..max) | ratio after (min..max) |")
    print("|---|---|---|---|---|---|")
    for name in a.models:
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for i in range(a.pairs):
            for which in (("before", "after") if i % 2 == 0 else ("after", "before")):
                root = a.baseline if which == "before" else None
                runs[which].append(_child(["steady", name, a.rounds, a.calls], cache=True, stats=a.stats, root=root))
        med = {k: {f: statistics.median(r[f] for r in v) for f in ("plain_ms", "fxdebug_ms", "ratio")} for k, v in runs.items()}
        spread = {k: (min(r["ratio_min"] for r in v), max(r["ratio_max"] for r in v)) for k, v in runs.items()}
        plain = statistics.median([r["plain_ms"] for v in runs.values() for r in v])
        print(f"| {name} | {plain:.2f} | {med['before']['fxdebug_ms']:.2f} | {med['after']['fxdebug_ms']:.2f} | "
              f"{med['before']['ratio']:.2f}x ({spread['before'][0]:.2f}..{spread['before'][1]:.2f}) | "
              f"**{med['after']['ratio']:.2f}x** ({spread['after'][0]:.2f}..{spread['after'][1]:.2f}) |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
