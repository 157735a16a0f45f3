"""Peak memory of ``instrument()`` with a big example batch, against the model's own forward.

Issue 35 B16: a batch that trains fine must not run out of memory at ``instrument()``. Each figure
is one fresh process (``python tools/bench_instrument_memory.py`` spawns them): the resident-memory
high-water mark of one call above the resident size before it (``bench_models._cpu_peak_delta``:
Linux's ``clear_refs`` resets the mark, ``malloc_trim`` hands freed heap back first), for

* ``forward`` — ``model(x)`` with grad (the activations autograd keeps, then the output dropped);
* ``instrument`` — ``fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,))``
  after a tiny model was instrumented in the same process (Dynamo's own start-up not counted);
* ``instrumented call`` — the first ``dbg(x)`` after that.

The model is an MLP whose activations dominate (``--batch`` rows of width ``--width``; the input an
eighth of that wide); the ratio
column is the figure over ``forward``'s. Torch's CPU allocator returns big blocks to the system, so
the high-water mark follows the tensors that were alive together.

    python tools/bench_instrument_memory.py [--batch 16384] [--width 2048] [--frontends dynamo symbolic]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _one(frontend: str, batch: int, width: int) -> dict[str, float | None]:
    sys.path[:0] = [HERE, ROOT]
    import torch
    from torch import nn

    torch.set_num_threads(1)
    import fxdebug
    from bench_models import _cpu_peak_delta
    from fxdebug.passes import NaNCheck, StatCollector

    def passes() -> list:  # type: ignore[type-arg]
        return [NaNCheck(), StatCollector()]

    tiny = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    fxdebug.instrument(tiny, passes(), example_inputs=(torch.randn(2, 3),), frontend=frontend)(torch.randn(2, 3))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width // 8, width), nn.ReLU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 16))
    x = torch.randn(batch, width // 8)  # an eighth of an activation: the input's copy and the activations tell apart
    model(x[:2])  # the model's own first-call allocations (weights' grads stay None: no backward)
    out: dict[str, float | None] = {"input_mib": x.numel() * 4 / 2**20}
    out["forward"] = _cpu_peak_delta(lambda: model(x))
    box: dict[str, object] = {}

    def capture() -> None:
        box["dbg"] = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend=frontend)

    out["instrument"] = _cpu_peak_delta(capture)
    dbg = box["dbg"]
    out["instrumented call"] = _cpu_peak_delta(lambda: dbg(x))  # type: ignore[operator]
    out["frontend"] = dbg.trace_info.frontend  # type: ignore[attr-defined,assignment]
    return out


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(json.dumps(_one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--frontends", nargs="*", default=["dynamo", "symbolic"])
    args = ap.parse_args()
    print(f"MLP Linear({args.width // 8}, {args.width}) + 3 x Linear({args.width}), batch {args.batch}: peak RSS above the start of each call, MiB "
          f"(load average {' '.join(f'{v:.2f}' for v in os.getloadavg())})")
    print(f"{'frontend':9} {'input':>7} {'forward':>8} {'instrument':>11} {'ratio':>6} {'first call':>11} {'ratio':>6}")
    for fe in args.frontends:
        done = subprocess.run([sys.executable, __file__, "--one", fe, str(args.batch), str(args.width)],
                              capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            print(f"{fe:9} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        fwd = r["forward"] or float("nan")
        print(f"{r['frontend']:9} {r['input_mib']:7.0f} {fwd:8.0f} {r['instrument']:11.0f} {r['instrument'] / fwd:6.2f} "
              f"{r['instrumented call']:11.0f} {r['instrumented call'] / fwd:6.2f}", flush=True)


if __name__ == "__main__":
    main()
