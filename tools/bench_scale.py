"""Start-up at scale, live vs snapshot side by side: ``python tools/bench_scale.py [--what ...]``.

Every figure comes from a fresh process (this script spawns them), one thread, CPU time of that
process (``time.process_time``; wall time beside it), with the README's passes — ``ShapeAssert(),
NaNCheck(), StatCollector()`` (``--passes cheap``: the last two only) — on these models:

* ``chain-N`` — one ``nn.Sequential`` of ``N`` leaf layers, ``Linear(16, 16)`` / ``ReLU`` alternating
  (no block: regional capture has nothing to share);
* ``blocks-N`` — ``N`` graph nodes as ``N / 4`` blocks ``nn.Sequential(Linear(4, 4), ReLU(), Linear(4, 4),
  Tanh())`` (issue 33's 10k / 100k model: 2,500 / 25,000 blocks);
* ``cblocks-N`` — the same blocks as a module class of their own (``Block``): what regional capture
  (``FXDEBUG_REGIONS=1``) shares, a container (``nn.Sequential``) being no block for it;
* ``llama-8b`` / ``llama-70b`` — Hugging Face ``LlamaForCausalLM`` with LLaMA-3-8B / 70B sizes (32 / 80
  layers, GQA, vocabulary 128,256) built on the ``meta`` device (no memory, no weights), 1x16 tokens.

Each model runs under ``--frontends`` (default ``live snapshot``): ``live`` is ``frontend="dynamo"``,
``regions`` the same with ``FXDEBUG_REGIONS=1``, ``snapshot`` the snapshot chain (``"auto"`` with
``FXDEBUG_AUTO=snapshot``: symbolic tracing, then export), ``plain`` plain Dynamo on the model with a
backend that does nothing (``torch.compile(model, backend=...)``, its first call: the floor a live
capture cannot go under). The columns: ``instrument()``, the first call, ``report()`` (CPU s, wall s
in brackets), how many parts and rows, the peak RSS, and ``dynamo`` — the wall seconds Dynamo's own
tracing took (``torch._dynamo.utils.compile_times``: ``_compile.compile_inner`` less the backend
calls) with its share of the ``instrument()`` + first call wall time.

    python tools/bench_scale.py                                    # chain-2000, blocks-10000, llama-8b
    python tools/bench_scale.py --models blocks-100000 llama-70b --frontends live regions snapshot

Issue 33's numbers: the README's passes at 10k nodes <= 3 s CPU, 100k <= 30 s, live; the LLaMA-3-8B-like
model on ``meta`` live <= 10 s, 70B-like <= 15 s; ``instrument()`` + first call live <= 2x the snapshot.
A benchmark, not a test: the figures go into docs/performance.md ("Start-up at scale").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn

from bench_proc import load_average, run_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_MODELS = ("chain-2000", "blocks-10000", "llama-8b")
FRONTENDS = ("live", "regions", "snapshot", "plain")
_LLAMA: dict[str, dict[str, Any]] = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model, example inputs)`` for one model name (see the module docstring), seeded."""
    torch.manual_seed(0)
    kind, _, size = name.partition("-")
    if kind == "chain":
        return nn.Sequential(*[nn.Linear(16, 16) if i % 2 == 0 else nn.ReLU() for i in range(int(size))]), \
            (torch.randn(2, 16),)
    if kind == "blocks":
        return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh())
                               for _ in range(int(size) // 4)]), (torch.randn(2, 4),)
    if kind == "cblocks":
        return nn.Sequential(*[Block() for _ in range(int(size) // 4)]), (torch.randn(2, 4),)
    if kind == "llama":
        import warnings

        import transformers

        cfg = transformers.LlamaConfig(**_LLAMA[size], num_key_value_heads=8, vocab_size=128256,
                                       max_position_embeddings=8192, use_cache=False)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = transformers.LlamaForCausalLM(cfg)
        return Logits(model), (torch.zeros(1, 16, dtype=torch.long, device="meta"),)
    raise KeyError(name)


class Block(nn.Module):
    """Four graph nodes, a class of its own (a repeated block for regional capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2, self.out = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc2(self.act(self.fc1(x))))


class Logits(nn.Module):
    """A causal LM's logits alone (no output object): what the passes see end to end."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


def _passes(which: str) -> list[Any]:
    from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector

    return [ShapeAssert(), NaNCheck(), StatCollector()] if which == "readme" else [NaNCheck(), StatCollector()]


def _dynamo_seconds() -> float:
    """Wall seconds inside Dynamo's frame compiles so far, less the backend calls (fxdebug's backend only hands
    the graph over; the live module instruments it when it runs)."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv")
        times = {str(k): float(v) for k, v in zip(names, values)}
    except Exception:  # noqa: BLE001 - another torch: no figure
        return float("nan")
    return times.get("_compile.compile_inner", 0.0) - times.get("OutputGraph.call_user_compiler", 0.0)


def _timed(fn: Any) -> tuple[Any, float, float]:
    c, t = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c, time.perf_counter() - t


def one(name: str, frontend: str, passes: str) -> dict[str, Any]:
    """One model under one frontend, in this process: the figures as a dict (printed as JSON by the child)."""
    import resource

    sys.path[:0] = [HERE, ROOT]
    torch.set_num_threads(1)
    import fxdebug

    fxdebug.instrument  # the lazy API loaded outside the timed region
    model, inputs = build(name)
    out: dict[str, Any] = {"model": name, "frontend": frontend}
    if frontend == "plain":
        compiled = torch.compile(model, backend=lambda gm, example: gm.forward)
        _, cpu, wall = _timed(lambda: compiled(*inputs))
        out.update(instrument=(0.0, 0.0), call=(cpu, wall), report=(0.0, 0.0), parts=0, rows=0, ran="plain dynamo")
    else:
        fe = "auto" if frontend == "snapshot" else "dynamo"  # the parent sets FXDEBUG_AUTO / FXDEBUG_REGIONS
        dbg, cpu, wall = _timed(lambda: fxdebug.instrument(model, _passes(passes), example_inputs=inputs, frontend=fe))
        out["instrument"] = (cpu, wall)
        _, cpu, wall = _timed(lambda: dbg(*inputs))
        out["call"] = (cpu, wall)
        report, cpu, wall = _timed(dbg.report)
        out.update(report=(cpu, wall), parts=len(dbg.parts()), rows=len(report.rows), ran=dbg.trace_info.frontend)
    out["dynamo_s"] = _dynamo_seconds()
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return out


def _spawn(name: str, frontend: str, passes: str, timeout: float) -> dict[str, Any]:
    env = {"FXDEBUG_AUTO": "snapshot" if frontend == "snapshot" else "dynamo",
           "FXDEBUG_REGIONS": "1" if frontend == "regions" else "0"}
    return run_json(__file__, ["--one", name, frontend, passes], env, timeout)


def _cell(pair: Any) -> str:
    cpu, wall = pair
    return f"{cpu:.2f} ({wall:.2f})"


def table(models: list[str], frontends: list[str], passes: str, timeout: float) -> None:
    print(f"## start-up at scale: fresh process each, one thread, CPU s (wall s); passes {passes}; "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPU(s); load average {load_average()}")
    print("| model | frontend | ran | parts | rows | instrument() | first call | report() | total CPU | dynamo wall "
          "(share) | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in models:
        for frontend in frontends:
            r: dict[str, Any] = _spawn(name, frontend, passes, timeout)
            if "error" in r:
                print(f"| {name} | {frontend} | failed: {r['error']} |||||||||", flush=True)
                continue
            total = sum(float(r[k][0]) for k in ("instrument", "call"))
            wall = sum(float(r[k][1]) for k in ("instrument", "call"))
            dyn = float(r["dynamo_s"])
            share = f"{dyn:.2f} ({dyn / wall:.0%})" if wall > 0 and dyn == dyn else "—"
            print(f"| {name} | {frontend} | {r['ran']} | {r['parts']} | {r['rows']} | {_cell(r['instrument'])} | "
                  f"{_cell(r['call'])} | {_cell(r['report'])} | {total:.2f} | {share} | {r['rss_mb']} |", flush=True)
    print(f"load average after: {load_average()}")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2], sys.argv[3], sys.argv[4])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS),
                    help="chain-N, blocks-N, cblocks-N (N: graph nodes), llama-8b, llama-70b")
    ap.add_argument("--frontends", nargs="*", default=["live", "snapshot"], choices=FRONTENDS)
    ap.add_argument("--passes", choices=("readme", "cheap"), default="readme")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per process")
    args = ap.parse_args()
    table(args.models, args.frontends, args.passes, args.timeout)


if __name__ == "__main__":
    main()
