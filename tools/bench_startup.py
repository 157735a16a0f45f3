"""Start-up cost, measured from outside: ``import fxdebug`` and ``instrument()`` + the first call.

Every figure comes from a fresh process (``python tools/bench_startup.py`` spawns them), single
thread, CPU time of that process (``time.process_time``: steadier than wall time on a shared
machine; wall time is printed beside it):

* **imports** — ``import torch``; ``import torch, fxdebug``; ``import torch`` then the first use of
  ``fxdebug.instrument`` (what loads Dynamo's tracer); ``from fxdebug.passes import NaNCheck,
  StatCollector``. ``--runs`` processes each (interleaved), median and min..max. Issue 33's bar:
  ``import fxdebug`` <= ``import torch`` + 0.5 s.
* **models** — ``instrument(model, [NaNCheck(), StatCollector()], example_inputs=...)`` and the first
  call on the same inputs, live (``frontend="dynamo"``) vs the snapshot chain (``"auto"`` with
  ``FXDEBUG_AUTO=snapshot``: symbolic tracing, then export), on in-repo models: a
  torchvision-style ResNet-50 (``tools/bench_models.ResNetStyle``, 1x3x64x64), Hugging Face GPT-2
  12 layers (d 256) and LLaMA 16 layers (d 256, GQA 4/2 heads) with random weights (tiny configs,
  no downloads; skipped without ``transformers``), and a 2,000-layer chain of ``Linear(4, 4)`` /
  ``ReLU``. The imports are outside the timed region (the first table has them). ``regions`` is the live
  capture with ``FXDEBUG_REGIONS=1`` (each repeated block traced once, its instances copies of the first), ``plain``
  plain Dynamo with a backend that does nothing (the floor); ``new batch`` is the CPU time of a call with batch 3
  after the first call (a recompile).

    python tools/bench_startup.py [--runs 7] [--what imports|models|all] [--models resnet50 gpt2-12 ...]

A benchmark, not a test: the figures go into the issue's closing note and docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from bench_proc import load_average, run_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

IMPORTS = {
    "import torch": "import torch",
    "import torch, fxdebug": "import torch, fxdebug",
    "import fxdebug (alone)": "import fxdebug",
    "+ fxdebug.instrument (first use)": "import torch, fxdebug\nfxdebug.instrument",
    "from fxdebug.passes import ...": "import torch\nfrom fxdebug.passes import NaNCheck, StatCollector",
}
MODELS = ("resnet50", "gpt2-12", "llama-16", "chain-2000")


def _build(name: str):  # type: ignore[no-untyped-def]
    """``(model, example_inputs)`` for one of ``MODELS`` (seeded; train mode, as a debugging session)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "resnet50":
        from bench_models import ResNetStyle

        return ResNetStyle(), (torch.randn(1, 3, 64, 64),)
    if name == "chain-2000":
        return nn.Sequential(*[nn.Linear(4, 4) if i % 2 == 0 else nn.ReLU() for i in range(2000)]), (torch.randn(2, 4),)
    import warnings

    import transformers as tr
    from bench_models import _Logits

    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "gpt2-12":
            cfg = tr.GPT2Config(vocab_size=1000, n_positions=64, n_embd=256, n_layer=12, n_head=4, use_cache=False)
            return _Logits(tr.GPT2LMHeadModel(cfg), "logits"), (tokens,)
        if name == "llama-16":
            cfg = tr.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 use_cache=False)
            return _Logits(tr.LlamaForCausalLM(cfg), "logits"), (tokens,)
    raise KeyError(name)


def _one_import(code: str) -> dict[str, float]:
    c, t = time.process_time(), time.perf_counter()
    exec(compile(code, "<bench>", "exec"), {})
    return {"cpu_s": time.process_time() - c, "wall_s": time.perf_counter() - t}


def _one_model(name: str, frontend: str) -> dict[str, object]:
    sys.path[:0] = [HERE, ROOT]
    import torch

    torch.set_num_threads(1)
    import fxdebug
    from fxdebug.passes import NaNCheck, StatCollector

    fxdebug.instrument  # the lazy API loaded here, outside the timed region (the imports table has it)
    model, inputs = _build(name)
    fe = "dynamo" if frontend == "live" else "auto"  # the parent sets FXDEBUG_AUTO=snapshot for "snapshot"
    c, t = time.process_time(), time.perf_counter()
    if frontend == "plain":  # plain Dynamo, a backend that does nothing: the floor, and its own recompile
        def nothing(gm: Any, example: Any) -> Any:
            return gm.forward

        dbg = torch.compile(model, backend=nothing)
    else:
        dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=inputs, frontend=fe)
    inst_cpu, inst_wall = time.process_time() - c, time.perf_counter() - t
    c, t = time.process_time(), time.perf_counter()
    dbg(*inputs)
    call_cpu, call_wall = time.process_time() - c, time.perf_counter() - t
    c = time.process_time()
    dbg(_resized(inputs[0]))  # another batch size: a recompile for Dynamo
    recompile_cpu = time.process_time() - c
    return {"model": name, "frontend": "plain" if frontend == "plain" else dbg.trace_info.frontend,
            "instrument_cpu_s": inst_cpu, "instrument_wall_s": inst_wall, "call_cpu_s": call_cpu,
            "call_wall_s": call_wall, "recompile_cpu_s": recompile_cpu,
            "parts": len(dbg.parts()) if hasattr(dbg, "parts") else 0}


def _resized(x: Any) -> Any:
    """``x`` with its batch dim 3 (the examples have 1 or 2): what a new batch size costs."""
    import torch

    if x.dtype == torch.long:
        return torch.randint(0, 1000, (3, *x.shape[1:]), generator=torch.Generator().manual_seed(1))
    return torch.randn(3, *x.shape[1:])


def _spawn(args: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> dict[str, object]:
    return run_json(__file__, args, env, timeout)


def imports(runs: int) -> None:
    print(f"## imports: {runs} fresh processes each (interleaved), CPU s median (min..max), wall s median; "
          f"load average {load_average()}")
    got: dict[str, list[dict[str, float]]] = {k: [] for k in IMPORTS}
    for _ in range(runs):
        for label, code in IMPORTS.items():
            r = _spawn(["--import", code])
            if "error" not in r:
                got[label].append(r)  # type: ignore[arg-type]
    torch_cpu = statistics.median(r["cpu_s"] for r in got["import torch"]) if got["import torch"] else float("nan")
    print(f"{'statement':34} {'cpu s':>7} {'(min..max)':>14} {'wall s':>7} {'- torch':>8}")
    for label, rs in got.items():
        if not rs:
            print(f"{label:34} failed")
            continue
        cpu = [r["cpu_s"] for r in rs]
        wall = statistics.median(r["wall_s"] for r in rs)
        print(f"{label:34} {statistics.median(cpu):7.2f} {f'({min(cpu):.2f}..{max(cpu):.2f})':>14} {wall:7.2f} "
              f"{statistics.median(cpu) - torch_cpu:+8.2f}", flush=True)
    print(f"load average after: {load_average()}")


def models(names: list[str], frontends: tuple[str, ...] = ("snapshot", "live", "regions", "plain")) -> None:
    print(f"## instrument() + first call, NaNCheck + StatCollector, fresh process each, CPU s (wall s); "
          f"load average {load_average()}")
    print(f"{'model':12} {'frontend':9} {'parts':>5} {'instrument':>16} {'first call':>16} {'total cpu':>9} {'vs snapshot':>11} "
          f"{'new batch':>9}")
    for name in names:
        totals: dict[str, float] = {}
        for frontend in frontends:
            env = {"FXDEBUG_AUTO": "snapshot" if frontend == "snapshot" else "dynamo",
                   "FXDEBUG_REGIONS": "1" if frontend == "regions" else "0"}
            r = _spawn(["--model", name, "live" if frontend == "regions" else frontend], env=env)
            if "error" in r:
                print(f"{name:12} {frontend:9} failed: {r['error']}", flush=True)
                continue
            total = float(r["instrument_cpu_s"]) + float(r["call_cpu_s"])  # type: ignore[arg-type]
            totals[frontend] = total
            ratio = f"{total / totals['snapshot']:.1f}x" if frontend != "snapshot" and "snapshot" in totals else ""
            print(f"{name:12} {frontend:9} {r['parts']:>5} "
                  f"{float(r['instrument_cpu_s']):7.2f} ({float(r['instrument_wall_s']):5.2f}) "  # type: ignore[arg-type]
                  f"{float(r['call_cpu_s']):7.2f} ({float(r['call_wall_s']):5.2f}) {total:9.2f} {ratio:>11} "  # type: ignore[arg-type]
                  f"{float(r['recompile_cpu_s']):9.2f}",  # type: ignore[arg-type]
                  flush=True)
    print(f"load average after: {load_average()}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--import":
        print(json.dumps(_one_import(sys.argv[2])))
        return
    if len(sys.argv) == 4 and sys.argv[1] == "--model":
        print(json.dumps(_one_model(sys.argv[2], sys.argv[3])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("imports", "models", "all"), default="all")
    ap.add_argument("--runs", type=int, default=7, help="imports: fresh processes per statement")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPU(s), one thread per process")
    if args.what in ("imports", "all"):
        imports(args.runs)
    if args.what in ("models", "all"):
        models(args.models)


if __name__ == "__main__":
    main()
