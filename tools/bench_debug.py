"""The debugging-size suite: ``python tools/bench.py --suite debug`` (one thread, batch 1–2).

Real architectures at the sizes people debug with (``bench_models.DEBUG_MODELS``: ResNet-50- and
ResNet-18-style CNNs, a ViT-style encoder, tiny Hugging Face BERT, GPT-2, LLaMA, T5 and ViT from
configs, an MLP and the in-repo zoo), each measured side by side in one loop against:

* ``plain``: the model itself (eval, ``no_grad``);
* ``hooks .item()``: the seed-style forward hook on every leaf module computing mean, std, min,
  max and any-NaN with ``.item()`` (five host syncs per module);
* ``hooks sum``: one ``sum`` per leaf module in a forward hook, no sync — the cheapest hook;
* ``fxdebug``: ``NaNCheck() + StatCollector()`` on every op;

then forward + backward (``NaNCheck(backward=True) + StatCollector(grads=True)`` against plain
forward + backward), the ~2,000-node graph of tiny ops (per-node fixed cost in µs),
``torch.compile`` (ratio to the compiled plain model, cold compile times, graph breaks), peak
memory and instrument time at 2,000 nodes. Every ratio is taken per repeat (each repeat: the
median of ``--runs`` interleaved calls) and given as min / median / max over ``--repeats``.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fxdebug  # noqa: E402
from bench_models import (  # noqa: E402
    DEBUG_MODELS,
    MODELS,
    collector_passes,
    count_graph_breaks,
    hooked_copy,
    peak_delta_mib,
    sum_hooked_copy,
)

Fn = Callable[[], Any]
COMPILED = ("resnet50-style 2x3x112x112", "resnet18-style 1x3x64x64", "vit-s-style 2 blocks 1x3x64x64",
            "hf gpt2 2L d64 2x16", "hf llama 2L d64 2x16", "mlp 20x256 batch 2", "graph-2000")  # issue 27: ResNet, ViT, GPT-2, LLaMA


def _frontend(name: str) -> str:
    return "export" if name.startswith("hf ") else "auto"  # HF models need torch.export to be seen op by op


def _build(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    if name == "graph-2000":
        return MODELS["graph-2000"](False)
    return DEBUG_MODELS[name](False)


CLOCK: Callable[[], float] = time.process_time
SYNC: Callable[[], None] = lambda: None  # noqa: E731 - torch.cuda.synchronize on a GPU
DEVICE = torch.device("cpu")


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def kernels_per_call(fn: Fn) -> int:
    """Device kernels one call of ``fn`` launches (CUDA), or aten ops it dispatches (CPU), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    SYNC()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        SYNC()
    events = prof.events()
    if DEVICE.type == "cuda":
        return sum(1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    # an aten op dispatched by Python, not from inside another op: a live module's graphs run inside Dynamo's
    # "Torch-Compiled Region" range, which is a parent event but not an op
    return sum(1 for e in events if e.name.startswith("aten::") and (e.cpu_parent is None or "::" not in e.cpu_parent.name))


def _timed(fns: dict[str, Fn], runs: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each fn, interleaved round-robin with a rotating start.

    The clock is this process's CPU time by default (``--clock cpu``): with one thread it is the
    work the call does, and waiting for a core that other processes hold does not count, which
    keeps the ratios meaningful on a loaded machine; ``--clock wall`` uses ``perf_counter``."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    SYNC()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(runs):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            t0 = CLOCK()
            fns[n]()
            SYNC()
            times[n].append(CLOCK() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def _spread(fns: dict[str, Fn], args: argparse.Namespace, base: str) -> dict[str, tuple[float, float, float]]:
    """Per variant ``(min, median, max)`` over repeats of its ratio to ``base`` (``base``: ms)."""
    reps = [_timed(fns, args.runs, args.warmup) for _ in range(args.repeats)]
    out: dict[str, tuple[float, float, float]] = {}
    for n in fns:
        vals = [r[base] * 1e3 for r in reps] if n == base else [r[n] / r[base] for r in reps]
        out[n] = (min(vals), statistics.median(vals), max(vals))
    return out


def _no_grad(m: nn.Module, x: tuple[Any, ...]) -> Fn:
    def run() -> Any:
        with torch.no_grad():
            return m(*x)

    return run


def _fwd_bwd(m: nn.Module, x: tuple[Any, ...], params: list[torch.Tensor]) -> Fn:
    def run() -> None:
        for p in params:
            p.grad = None
        m(*x).float().sum().backward()

    return run


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, x = _build(name)
    model, x = model.to(DEVICE), _to(x, DEVICE)
    fe = _frontend(name) if args.frontend == "default" else args.frontend
    row: dict[str, Any] = {"model": name}
    t0 = time.perf_counter()
    inst = fxdebug.instrument(model, collector_passes(False), example_inputs=x, frontend=fe)
    row["instrument_s"] = time.perf_counter() - t0
    row["observed"] = len(inst.observers())
    row["frontend"] = inst.report().frontend
    fns = {"plain": _no_grad(model, x), "hooks_item": _no_grad(hooked_copy(model, sync=True), x),
           "hooks_sum": _no_grad(sum_hooked_copy(model), x), "fxdebug": _no_grad(inst, x)}
    row["fwd"] = _spread(fns, args, "plain")
    plain_ms = row["fwd"]["plain"][1]
    row["per_node_us"] = (row["fwd"]["fxdebug"][1] - 1) * plain_ms * 1e3 / max(row["observed"], 1)
    row["kernels_per_node"] = (kernels_per_call(fns["fxdebug"]) - kernels_per_call(fns["plain"])) / max(row["observed"], 1)
    if not args.no_backward:
        grads = fxdebug.instrument(model, collector_passes(True), example_inputs=x, frontend=fe)
        params = [p for p in model.parameters() if p.requires_grad]
        fb = {"plain": _fwd_bwd(model, x, params), "hooks_item": _fwd_bwd(hooked_copy(model, sync=True), x, params),
              "fxdebug": _fwd_bwd(grads, x, params)}
        row["fwd_bwd"] = _spread(fb, args, "plain")
        row["bwd_kernels_per_node"] = (kernels_per_call(fb["fxdebug"]) - kernels_per_call(fb["plain"])) / max(row["observed"], 1)
        for p in params:
            p.grad = None
    plain_peak = peak_delta_mib(fns["plain"], DEVICE)
    inst_peak = peak_delta_mib(fns["fxdebug"], DEVICE)
    row["peak"] = (plain_peak, inst_peak)
    if args.compile and name in COMPILED:
        row.update(compiled(model, inst, x, args))
    return row


def _cold_compile(m: nn.Module, x: tuple[Any, ...]) -> tuple[Fn, float]:
    torch._dynamo.reset()
    fn = _no_grad(torch.compile(m), x)
    t0 = time.perf_counter()
    fn()
    SYNC()
    return fn, time.perf_counter() - t0


def compiled(model: nn.Module, inst: nn.Module, x: tuple[Any, ...], args: argparse.Namespace) -> dict[str, Any]:
    """Compiled ratio (interleaved, like eager), cold compile times (caches off), graph breaks."""
    import torch._inductor.config as inductor_config

    out: dict[str, Any] = {"breaks": (count_graph_breaks(model, x), count_graph_breaks(inst, x))}
    saved = inductor_config.fx_graph_cache, getattr(inductor_config, "autotune_local_cache", None)
    inductor_config.fx_graph_cache = False  # cold compiles for both, so the times compare
    def too_long(*_: Any) -> None:
        raise TimeoutError(f"compile took over {args.compile_timeout} s")

    old_handler = signal.signal(signal.SIGALRM, too_long)
    try:
        signal.alarm(args.compile_timeout)
        fn_plain, out["compile_s_plain"] = _cold_compile(model, x)
        fn_inst, out["compile_s_fxdebug"] = _cold_compile(inst, x)
        signal.alarm(0)
        out["compiled"] = _spread({"plain": fn_plain, "fxdebug": fn_inst}, args, "plain")
    except Exception as exc:  # noqa: BLE001 - the table says what failed instead of dying
        out["compiled_error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        inductor_config.fx_graph_cache = saved[0]
        torch._dynamo.reset()
    return out


def _mmm(t: tuple[float, float, float] | None, fmt: str = "{:.2f}") -> str:
    if t is None:
        return "–"
    lo, mid, hi = t
    return f"**{fmt.format(mid)}** ({fmt.format(lo)}–{fmt.format(hi)})"


def render(rows: list[dict[str, Any]], args: argparse.Namespace, machine: str, scale: dict[str, Any]) -> str:
    what = "kernels" if DEVICE.type == "cuda" else "aten ops"
    out = [f"# fxdebug debugging-size suite ({DEVICE.type.upper()}, float32)", "",
           f"Machine: {machine}. One command: `python tools/bench.py --suite debug"
           + (" --compile" if args.compile else "") + "`. "
           f"Ratios to the plain model: **median** (min–max) over {args.repeats} repeats, each the median of "
           f"{args.runs} interleaved calls after {args.warmup} warm-up; {args.threads} thread(s); timed by "
           + ("process CPU time" if args.clock == "cpu" else "wall clock") + ".", ""]
    head = ["model", "frontend", "observed", "plain ms", "hooks .item()", "hooks sum", "fxdebug", "µs/node",
            "instrument s", f"{what}/node fwd", f"{what}/node fwd+bwd"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        f = r["fwd"]
        lines.append("| " + " | ".join([r["model"], r["frontend"], str(r["observed"]), _mmm(f["plain"], "{:.1f}"),
                                        _mmm(f["hooks_item"]), _mmm(f["hooks_sum"]), _mmm(f["fxdebug"]),
                                        f"{r['per_node_us']:.1f}", f"{r['instrument_s']:.2f}",
                                        f"{r.get('kernels_per_node', float('nan')):.2f}",
                                        f"{r.get('bwd_kernels_per_node', float('nan')):.2f}"]) + " |")
    ratios = [r["fwd"]["fxdebug"][1] for r in rows if r["model"] != "graph-2000"]
    hooks = [r["fwd"]["hooks_item"][1] for r in rows if r["model"] != "graph-2000"]
    out += ["## Forward, no_grad (ratio to plain)", "", *lines, ""]
    if ratios:
        out += [f"Median over the {len(ratios)} real architectures: fxdebug **{statistics.median(ratios):.2f}×**, "
                f"seed-style hooks {statistics.median(hooks):.2f}×; fxdebug below the hooks on "
                f"{sum(1 for r in rows if r['model'] != 'graph-2000' and r['fwd']['fxdebug'][1] < r['fwd']['hooks_item'][1])}"
                f" of {len(ratios)}.", ""]
    if any("fwd_bwd" in r for r in rows):
        head = ["model", "plain fwd+bwd ms", "hooks .item()", "fxdebug grads"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            if "fwd_bwd" in r:
                f = r["fwd_bwd"]
                lines.append(f"| {r['model']} | {_mmm(f['plain'], '{:.1f}')} | {_mmm(f['hooks_item'])} | {_mmm(f['fxdebug'])} |")
        fb = [r["fwd_bwd"]["fxdebug"][1] for r in rows if "fwd_bwd" in r and r["model"] != "graph-2000"]
        out += ["## Forward + backward, gradient statistics (ratio to plain forward + backward)", "", *lines, ""]
        if fb:
            out += [f"Median over the real architectures: **{statistics.median(fb):.2f}×**.", ""]
    comp = [r for r in rows if "compiled" in r or "compiled_error" in r]
    if comp:
        head = ["model", "compiled plain ms", "fxdebug / compiled plain", "cold compile s plain", "cold compile s fxdebug",
                "graph breaks plain / fxdebug"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in comp:
            c = r.get("compiled")
            lines.append("| " + " | ".join([
                r["model"], _mmm(c["plain"], "{:.2f}") if c else r.get("compiled_error", "–"), _mmm(c["fxdebug"]) if c else "–",
                f"{r.get('compile_s_plain', float('nan')):.1f}", f"{r.get('compile_s_fxdebug', float('nan')):.1f}"
                + (f" ({r['compile_s_fxdebug'] / r['compile_s_plain']:.2f}×)" if "compile_s_fxdebug" in r else ""),
                "{} / {}".format(*r["breaks"])]) + " |")
        out += ["## torch.compile (inductor, caches off for the compile times)", "", *lines, ""]
    head = ["model", "plain peak MiB", "fxdebug peak MiB", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        a, b = r["peak"]
        ratio = f"{b / a:.2f}" if a and b is not None and a >= 1.0 else "– (below 1 MiB)"
        lines.append(f"| {r['model']} | {a if a is None else f'{a:.1f}'} | {b if b is None else f'{b:.1f}'} | {ratio} |")
    out += ["## Peak memory of one forward above the resting state", "", *lines, ""]
    out += ["## Graph scale", "", "| measure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in scale.items()] + [""]
    return "\n".join(out)


def graph_scale() -> dict[str, Any]:
    model, x = MODELS["graph-2000"](False)
    wall, cpu = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        inst = fxdebug.instrument(model, collector_passes(False), example_inputs=x)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    observed = len(inst.observers())
    return {"model nodes observed": observed,
            "instrument s, CPU (median of 3, trace + passes + example run)": f"{statistics.median(cpu):.3f}",
            "instrument s, wall": f"{statistics.median(wall):.3f}", "runtime kernel": fxdebug.runtime.backend()}


def run(args: argparse.Namespace, machine: Callable[[], str]) -> str:
    global CLOCK, SYNC, DEVICE
    torch.set_num_threads(args.threads)
    DEVICE = torch.device(args.device)
    CLOCK = time.process_time if (args.clock == "cpu" and DEVICE.type == "cpu") else time.perf_counter
    if DEVICE.type == "cuda":
        SYNC = torch.cuda.synchronize
    names = [n for n in (args.models.split(",") if args.models else [*DEBUG_MODELS, "graph-2000"])]
    rows = []
    for name in names:
        t0 = time.perf_counter()
        rows.append(measure(name, args))
        print(f"[bench] {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        Path(args.out).write_text(render(rows, args, machine(), {"(partial)": f"{len(rows)} of {len(names)} models"}) + "\n")
    text = render(rows, args, machine(), graph_scale())
    print(text)
    Path(args.out).write_text(text + "\n")
    print(f"[bench] table written to {args.out}", file=sys.stderr)
    return text


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="fxdebug's debugging-size suite")
    p.add_argument("--models", default="", help=f"comma-separated subset of {', '.join([*DEBUG_MODELS, 'graph-2000'])}")
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="also torch.compile (cold compiles: minutes)")
    p.add_argument("--compile-timeout", type=int, default=900, help="seconds for both cold compiles of one model")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="time calls by this process's CPU time (default; robust on a loaded machine) or wall clock")
    p.add_argument("--device", default="cpu", help="cpu or cuda (on cuda: wall clock with synchronize, kernels per "
                                                  "node from the profiler)")
    p.add_argument("--out", default="bench-debug.md")
    p.add_argument("--frontend", default="default",
                   help="capture every model with this frontend (dynamo, symbolic, export, auto); default: export for "
                        "the HF models, auto for the rest")
    return p.parse_args(argv)
