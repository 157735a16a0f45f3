"""Peak memory of ``instrument()`` with a big example batch, against the model's own forward.

Issue 35 B16: a batch that trains fine must not run out of memory at ``instrument()``. Each figure
is one fresh process (``python tools/bench_instrument_memory.py`` spawns them): the resident-memory
high-water mark of one call above the resident size before it (``bench_models._cpu_peak_delta``:
Linux's ``clear_refs`` resets the mark, ``malloc_trim`` hands freed heap back first), for

* ``forward`` — the model's call with grad (the activations autograd keeps, then the output dropped);
* ``instrument`` — ``fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()],
  example_inputs=...)`` (the README's first example) after a tiny model was instrumented in the same
  process (Dynamo's own start-up not counted);
* ``instrumented call`` — the first call of the instrumented module after that;
* ``compile`` (live rows) — ``torch.compile(model, backend="eager")``'s first call: what Dynamo's own
  capture of the same model holds at its peak, for scale.

Models (``--models``): ``mlp`` (activations dominate; ``--batch`` rows of width ``--width``, the input an
eighth of that wide), ``conv`` (conv + batch-norm blocks, 64x64 images), ``gpt2`` (2-layer HF GPT-2 with
``labels=input_ids``; its snapshot row is export). The ratio columns are the figure over ``forward``'s.
Torch's CPU allocator returns big blocks to the system, so the high-water mark follows the tensors that
were alive together.

    python tools/bench_instrument_memory.py [--batch 16384] [--width 2048] [--frontends dynamo symbolic]
        [--models mlp conv gpt2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from bench_proc import load_average, run_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _model(kind: str, batch: int, width: int) -> tuple[Any, dict[str, Any]]:
    """The model and its call keywords: ``mlp`` (activations dominate, the input an eighth as wide),
    ``conv`` (conv + batch-norm blocks on 64x64 images: the saved activations of a CNN's training step) or
    ``gpt2`` (a 2-layer Hugging Face GPT-2 called with ``labels=input_ids``, one tensor twice)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(width // 8, width), nn.ReLU(), nn.Linear(width, width), nn.GELU(),
                              nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 16))
        return model, {"input": torch.randn(batch, width // 8)}
    if kind == "conv":
        def block() -> nn.Module:
            return nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), *[block() for _ in range(4)],
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
        return model, {"input": torch.randn(batch, 3, 64, 64)}
    import transformers  # the test extra

    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128)
    ids = torch.randint(0, 1000, (batch, 128))
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def _one(frontend: str, kind: str, batch: int, width: int) -> dict[str, Any]:
    sys.path[:0] = [HERE, ROOT]
    import torch
    from torch import nn

    torch.set_num_threads(1)
    import fxdebug
    from bench_models import _cpu_peak_delta
    from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector

    def passes() -> list:  # type: ignore[type-arg]
        return [ShapeAssert(), NaNCheck(), StatCollector()]  # the README's first example

    tiny = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    fxdebug.instrument(tiny, passes(), example_inputs=(torch.randn(2, 3),), frontend=frontend)(torch.randn(2, 3))
    model, call = _model(kind, batch, width)
    small = {k: v[:2] for k, v in call.items()}
    model(**small) if kind == "gpt2" else model(small["input"])  # the model's own first-call allocations
    run = (lambda m: m(**call)) if kind == "gpt2" else (lambda m: m(call["input"]))
    example: Any = call if kind == "gpt2" else (call["input"],)
    out: dict[str, Any] = {"input_mib": sum(v.numel() * v.element_size() for v in {id(v): v for v in call.values()}.values()) / 2**20}
    out["forward"] = _cpu_peak_delta(lambda: run(model))
    box: dict[str, Any] = {}

    def capture() -> None:
        box["dbg"] = fxdebug.instrument(model, passes(), example_inputs=example, frontend=frontend)

    out["instrument"] = _cpu_peak_delta(capture)
    dbg = box["dbg"]
    out["instrumented call"] = _cpu_peak_delta(lambda: run(dbg))
    out["frontend"] = dbg.trace_info.frontend
    if frontend == "dynamo":  # torch.compile's own first call on the same model, for scale: Dynamo's bookkeeping
        out["compile"] = _cpu_peak_delta(lambda: run(torch.compile(model, backend="eager")))
    return out


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--one":
        print(json.dumps(_one(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=None, help="default: mlp 16384, conv 64, gpt2 64")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--frontends", nargs="*", default=["dynamo", "symbolic"])
    ap.add_argument("--models", nargs="*", default=["mlp"], choices=["mlp", "conv", "gpt2"])
    args = ap.parse_args()
    print(f"ShapeAssert + NaNCheck + StatCollector: peak RSS above the start of each call, MiB "
          f"(load average {load_average()})")
    print(f"{'model':5} {'batch':>6} {'frontend':9} {'input':>7} {'forward':>8} {'instrument':>11} {'ratio':>6} {'first call':>11} "
          f"{'ratio':>6} {'compile':>8} {'ratio':>6}")
    for kind, fe in ((k, f) for k in args.models for f in args.frontends):
        if kind == "gpt2" and fe == "symbolic":  # GPT-2's forward does not trace symbolically: export is its snapshot
            fe = "export"
        batch = args.batch or {"mlp": 16384, "conv": 64, "gpt2": 64}[kind]
        r = run_json(__file__, ["--one", fe, kind, str(batch), str(args.width)])
        if "error" in r:
            print(f"{kind:5} {batch:6} {fe:9} failed: {r['error']}")
            continue
        fwd = r["forward"] or float("nan")
        comp = r.get("compile")
        tail = f" {comp:8.0f} {comp / fwd:6.2f}" if comp is not None else ""
        print(f"{kind:5} {batch:6} {r['frontend']:9} {r['input_mib']:7.0f} {fwd:8.0f} {r['instrument']:11.0f} {r['instrument'] / fwd:6.2f} "
              f"{r['instrumented call']:11.0f} {r['instrumented call'] / fwd:6.2f}{tail}", flush=True)


if __name__ == "__main__":
    main()
