"""fxdebug's overhead, measured: ``python tools/bench.py [--quick]``.

Every variant of a model is timed in the same loop, round-robin with a rotating start, so machine
noise (other processes on shared cores) lands on all of them alike; each figure is the median of
``--runs`` timed calls after ``--warmup`` untimed ones, and is reported as a ratio to the plain
model measured in that same loop. Variants (numbering follows the performance issue):

1. plain model; 2. a forward hook on every leaf module computing mean/std/min/max/any-NaN with
``.item()`` (what people write by hand; one host sync per statistic); 3. the same hooks writing
into a preallocated tensor (no sync); 4. ``fxdebug.instrument`` with ``NaNCheck(mode="record")``
and ``StatCollector()`` on every op; 5. the same with ``grads=True``, forward + backward, against
plain forward + backward; 6. variant 4 under ``torch.compile`` against the compiled plain model
(compile times and graph breaks reported separately); 7. the physical-limit proxy: the plain
graph plus exactly one ``sum`` over every activation variant 4 observes — the least any
collector can do. Also: trace and instrument time and peak memory on the ~2,000-node graph, and
render time and SVG size at the default depth.

``--suite debug`` runs the debugging-size suite instead (``tools/bench_debug.py``: ≥10 real
architectures at batch 1–2, one thread, side by side with seed-style and one-sum hooks).
``--suite calls`` runs paired per-call microbenchmarks of the instrumented forward's fixed costs
(``tools/bench_calls.py``: the clock, the call wrappers), for loaded machines where whole-model
ratios move by more than those costs.

The table is printed and written to ``--out``. ``--quick`` shrinks the models and runs so the
whole thing finishes in well under a minute; it skips ``torch.compile`` unless ``--compile``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fxdebug  # noqa: E402
from bench_models import (  # noqa: E402
    MODELS,
    collector_passes,
    count_graph_breaks,
    hooked_copy,
    limit_proxy,
    passes_available,
    peak_delta_mib,
    synchronize,
)

Fn = Callable[[], Any]


def interleaved(fns: dict[str, Fn], runs: int, warmup: int, sync: Fn) -> dict[str, float]:
    """Median seconds per call of each fn, calling them round-robin (start rotated every round)."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(runs):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            sync()
            t0 = time.perf_counter()
            fns[n]()
            sync()
            times[n].append(time.perf_counter() - t0)
    spread = {f"{n}:spread": (statistics.quantiles(v, n=4)[2] - statistics.quantiles(v, n=4)[0]) / statistics.median(v)
              for n, v in times.items() if len(v) >= 4}
    return {**{n: statistics.median(v) for n, v in times.items()}, **spread}


def _no_grad(m: nn.Module, x: tuple[Any, ...]) -> Fn:
    def run() -> Any:
        with torch.no_grad():
            return m(*x)

    return run


def _fwd_bwd(m: nn.Module, x: tuple[Any, ...], params: list[Tensor]) -> Fn:
    def run() -> None:
        for p in params:
            p.grad = None
        out = m(*x)
        out.float().sum().backward()

    return run


class Bench:
    """One model's measurements; each method fills ``self.row`` with figures (seconds, ratios)."""

    def __init__(self, name: str, quick: bool, args: argparse.Namespace, device: torch.device) -> None:
        self.name, self.args, self.device = name, args, device
        model, inputs = MODELS[name](quick)
        self.model = model.to(device)
        self.x = tuple(t.to(device) for t in inputs)
        if args.dtype != "float32":
            dt = getattr(torch, args.dtype)
            self.model = self.model.to(dt)
            self.x = tuple(t.to(dt) for t in self.x)
        self.sync = lambda: synchronize(device)
        self.row: dict[str, Any] = {"model": name}
        self.inst: nn.Module | None = None
        if passes_available():
            self.inst = fxdebug.instrument(self.model, passes=collector_passes(grads=False), example_inputs=self.x)
            self.row["observed"] = len(self.inst.observers())
        self.row["nodes"] = len(fxdebug.trace(self.model, self.x).graph.nodes)

    def eager(self) -> None:
        a, x = self.args, self.x
        fns = {"plain": _no_grad(self.model, x), "hooks_item": _no_grad(hooked_copy(self.model, sync=True), x),
               "hooks_buffer": _no_grad(hooked_copy(self.model, sync=False), x)}
        observed = list(self.inst.observers()) if self.inst is not None else None
        fns["limit"] = _no_grad(limit_proxy(self.model, x, observed), x)
        if self.inst is not None:
            fns["fxdebug"] = _no_grad(self.inst, x)
        med = interleaved(fns, a.runs, a.warmup, self.sync)
        self.row["plain_ms"] = med["plain"] * 1e3
        for k in fns:
            self.row[k] = med[k] / med["plain"]
        self.row["spread"] = med.get("plain:spread")
        if "fxdebug" in med:
            self.row["fxdebug_vs_limit"] = med["fxdebug"] / med["limit"]
            self.row["fxdebug_vs_hooks_item"] = med["fxdebug"] / med["hooks_item"]
        if self.device.type == "cuda" and self.inst is not None:
            torch.cuda.set_sync_debug_mode("error")  # record mode must never sync with the host
            try:
                fns["fxdebug"]()
                self.row["cuda_sync_free"] = "yes"
            except RuntimeError as exc:
                self.row["cuda_sync_free"] = f"no: {str(exc).splitlines()[0][:80]}"
            finally:
                torch.cuda.set_sync_debug_mode(0)

    def backward(self) -> None:
        if not passes_available():
            return
        inst = fxdebug.instrument(self.model, passes=collector_passes(grads=True), example_inputs=self.x)
        params = [p for p in self.model.parameters() if p.requires_grad]
        fns = {"plain_fb": _fwd_bwd(self.model, self.x, params), "fxdebug_fb": _fwd_bwd(inst, self.x, params)}
        med = interleaved(fns, self.args.runs, self.args.warmup, self.sync)
        self.row["plain_fb_ms"] = med["plain_fb"] * 1e3
        self.row["fxdebug_fb"] = med["fxdebug_fb"] / med["plain_fb"]
        rep = inst.report()
        self.row["grad_rows"] = sum(1 for r in rep.rows if any(str(k).startswith("grad_") for k in r))
        for p in params:
            p.grad = None

    def compiled(self) -> None:
        if self.inst is None:
            return
        torch._dynamo.reset()
        self.row["breaks_plain"] = count_graph_breaks(self.model, self.x)
        self.row["breaks_fxdebug"] = count_graph_breaks(self.inst, self.x)
        torch._dynamo.reset()
        fns: dict[str, Fn] = {}
        graphs = torch._dynamo.utils.counters["stats"]
        for key, mod in (("plain", self.model), ("fxdebug", self.inst)):
            fn = _no_grad(torch.compile(mod), self.x)
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            self.row[f"compile_s_{key}"] = time.perf_counter() - t0
            before = graphs["unique_graphs"]
            fn()
            if graphs["unique_graphs"] > before:  # guards fail on every call: timing it would time compiles
                self.row["compiled_ratio"] = "recompiles every call (see TORCH_LOGS=recompiles)"
                return
            fns[key] = fn
        med = interleaved(fns, self.args.runs, self.args.warmup, self.sync)
        self.row["compiled_plain_ms"] = med["plain"] * 1e3
        self.row["compiled_ratio"] = med["fxdebug"] / med["plain"]
        self.row["compile_time_ratio"] = self.row["compile_s_fxdebug"] / self.row["compile_s_plain"]

    def memory(self) -> None:
        plain = _no_grad(self.model, self.x)
        self.row["peak_plain_mib"] = peak_delta_mib(plain, self.device)
        if self.inst is not None:
            self.row["peak_fxdebug_mib"] = peak_delta_mib(_no_grad(self.inst, self.x), self.device)
            plain, inst = self.row["peak_plain_mib"], self.row["peak_fxdebug_mib"]
            if plain is not None and inst is not None and plain >= 1.0:  # below 1 MiB the ratio is noise
                self.row["peak_ratio"] = inst / plain


def graph_scale(quick: bool, device: torch.device, out_dir: Path) -> dict[str, Any]:
    """Trace, instrument and render time (and instrument peak memory) on the ~2,000-node graph."""
    model, inputs = MODELS["graph-2000"](quick)
    model, x = model.to(device), tuple(t.to(device) for t in inputs)
    res: dict[str, Any] = {}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gm = fxdebug.trace(model, x)
        times.append(time.perf_counter() - t0)
    res["nodes"], res["trace_s"] = len(gm.graph.nodes), statistics.median(times)
    if not passes_available():
        res["instrument"] = "NaNCheck/StatCollector not importable yet"
        return res
    times, inst = [], None
    for _ in range(3):
        t0 = time.perf_counter()
        inst = fxdebug.instrument(model, passes=collector_passes(grads=False), example_inputs=x)
        times.append(time.perf_counter() - t0)
    res["instrument_s"] = statistics.median(times)
    res["instrument_peak_mib"] = peak_delta_mib(
        lambda: fxdebug.instrument(model, passes=collector_passes(grads=False), example_inputs=x), device)
    with torch.no_grad():
        inst(*x)
    if not hasattr(fxdebug, "render"):
        res["render"] = "fxdebug.render does not exist yet"
        return res
    svg = out_dir / "bench-graph-2000.svg"
    t0 = time.perf_counter()
    try:
        fxdebug.render(inst, str(svg))
    except fxdebug.FxDebugError as exc:
        res["render"] = f"failed: {exc}"
        return res
    res["render_s"] = time.perf_counter() - t0
    res["svg_kib"] = svg.stat().st_size / 1024
    return res


# -- output -----------------------------------------------------------------------------------------
def _f(v: Any, fmt: str = "{:.2f}") -> str:
    if v is None:
        return "–"
    return fmt.format(v) if isinstance(v, (int, float)) else str(v)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}; {os.cpu_count()} logical CPUs visible, torch threads {torch.get_num_threads()}; "
            f"torch {torch.__version__}; Python {platform.python_version()}")


def render_markdown(rows: list[dict[str, Any]], scale: dict[str, Any], args: argparse.Namespace, device: torch.device) -> str:
    g = rows and rows[0]
    out = [f"# fxdebug benchmark ({'quick' if args.quick else 'full'}, {device.type}, {args.dtype})", "",
           f"Machine: {machine()}. Medians of {args.runs} interleaved runs after {args.warmup} warm-up.", ""]
    if not passes_available():
        out += ["**NaNCheck/StatCollector are not importable: variants 4–6 are missing.**", ""]
    out += ["## Eager forward (ratio to plain)", "", _table(
        ["model", "nodes", "plain ms", "2 hooks .item()", "3 hooks buffers", "4 fxdebug", "7 one-pass limit",
         "4 / 7", "4 / 2", "plain IQR/median"],
        [[r["model"], _f(r.get("nodes"), "{}"), _f(r.get("plain_ms"), "{:.1f}"), _f(r.get("hooks_item")),
          _f(r.get("hooks_buffer")), _f(r.get("fxdebug")), _f(r.get("limit")), _f(r.get("fxdebug_vs_limit")),
          _f(r.get("fxdebug_vs_hooks_item")), _f(r.get("spread"))] for r in rows]), ""]
    if any("fxdebug_fb" in r for r in rows):
        out += ["## Forward + backward, grads=True (ratio to plain forward + backward)", "", _table(
            ["model", "plain fwd+bwd ms", "5 fxdebug grads", "nodes with grad stats"],
            [[r["model"], _f(r.get("plain_fb_ms"), "{:.1f}"), _f(r.get("fxdebug_fb")), _f(r.get("grad_rows"), "{}")]
             for r in rows]), ""]
    if any("compiled_ratio" in r for r in rows):
        out += ["## torch.compile (variant 6)", "", _table(
            ["model", "compiled plain ms", "6 ratio", "compile s plain", "compile s fxdebug", "compile ratio",
             "graph breaks plain", "graph breaks fxdebug"],
            [[r["model"], _f(r.get("compiled_plain_ms"), "{:.1f}"), _f(r.get("compiled_ratio")),
              _f(r.get("compile_s_plain"), "{:.1f}"), _f(r.get("compile_s_fxdebug"), "{:.1f}"),
              _f(r.get("compile_time_ratio")), _f(r.get("breaks_plain"), "{}"), _f(r.get("breaks_fxdebug"), "{}")]
             for r in rows]), ""]
    elif not args.compile:
        out += ["torch.compile (variant 6) skipped; pass --compile (always on in full runs unless --no-compile).", ""]
    if any("peak_plain_mib" in r for r in rows):
        out += ["## Peak memory of one forward above the resting state", "", _table(
            ["model", "plain MiB", "fxdebug MiB", "ratio"],
            [[r["model"], _f(r.get("peak_plain_mib"), "{:.1f}"), _f(r.get("peak_fxdebug_mib"), "{:.1f}"),
              _f(r.get("peak_ratio"))] for r in rows]), ""]
    if any("cuda_sync_free" in r for r in rows):
        out += ["CUDA record mode without host sync (set_sync_debug_mode('error')): "
                + ", ".join(f"{r['model']}: {r.get('cuda_sync_free')}" for r in rows), ""]
    out += ["## Graph scale (synthetic graph)", "", _table(["measure", "value"], [[k, _f(v, "{:.3f}")] for k, v in scale.items()]), ""]
    del g
    return "\n".join(out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small models, few runs, no torch.compile; well under a minute")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--runs", type=int, default=None, help="timed runs per variant (default 10; 5 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per variant first (default 2; 1 with --quick)")
    p.add_argument("--compile", action="store_true", help="measure torch.compile even with --quick")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile in a full run")
    p.add_argument("--no-backward", action="store_true", help="skip the forward + backward variant")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default="bench-results.md", help="where the markdown table goes")
    a = p.parse_args(argv)
    a.runs = a.runs or (5 if a.quick else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    a.compile = a.compile or not (a.quick or a.no_compile)
    unknown = set(a.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown model(s) {sorted(unknown)}; choose from {', '.join(MODELS)}")
    return a


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--suite" in argv:  # ``--suite debug``: the debugging-size suite (tools/bench_debug.py)
        i = argv.index("--suite")
        suite, rest = (argv[i + 1] if i + 1 < len(argv) else ""), argv[:i] + argv[i + 2:]
        if suite == "calls":  # paired per-call microbenchmarks (tools/bench_calls.py)
            import bench_calls

            return bench_calls.run(bench_calls.parse(rest), machine)
        if suite != "debug":
            raise SystemExit(f"bench.py: unknown suite {suite!r}; the suites are: debug, calls (or none: the full-size runs)")
        import bench_debug

        return bench_debug.run(bench_debug.parse(rest), machine)
    args = parse(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for name in args.models.split(","):
        b = Bench(name, args.quick, args, device)
        steps = [b.eager, b.memory] + ([] if args.no_backward else [b.backward]) + ([b.compiled] if args.compile else [])
        for step in steps:
            t0 = time.perf_counter()
            step()
            print(f"[bench] {name}: {step.__name__} took {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        rows.append(b.row)
    with tempfile.TemporaryDirectory() as tmp:
        scale = graph_scale(args.quick, device, Path(tmp))
    text = render_markdown(rows, scale, args, device)
    print(text)
    Path(args.out).write_text(text + "\n")
    print(f"[bench] table written to {args.out}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
