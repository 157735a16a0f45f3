"""instrument() wall time, live (Dynamo) vs snapshot (symbolic / export chain), cold and warm.

Each measurement runs in a fresh process (``python tools/bench_live_instrument.py`` spawns them):

* ``cold`` — the first ``instrument()`` in the process (for Dynamo: its initialisation included);
* ``warm`` — after another model was instrumented and called in the same process;
* ``again`` — a second instance of the same class right after (Dynamo's cache for that code is warm).

Passes: ``NaNCheck()`` and ``StatCollector()``; models from ``tools/bench_models.DEBUG_MODELS``.
Single thread. A benchmark, not a test: the numbers go into docs/frontends.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ["mlp 20x256 batch 2", "zoo residual_cnn", "resnet18-style 1x3x64x64", "hf gpt2 2L d64 2x16"]


def _one(name: str, frontend: str, mode: str) -> dict[str, object]:
    sys.path[:0] = [HERE, os.path.dirname(HERE)]
    import torch

    torch.set_num_threads(1)
    import fxdebug
    from fxdebug.passes import NaNCheck, StatCollector
    from bench_models import DEBUG_MODELS

    fe = {"dynamo": "dynamo", "snapshot": "auto"}[frontend]  # the parent sets FXDEBUG_AUTO=snapshot for "snapshot"
    if mode == "warm":
        m0 = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
        fxdebug.instrument(m0, [NaNCheck(), StatCollector()], example_inputs=(torch.randn(1, 3),), frontend=fe)(
            torch.randn(1, 3))
    model, inputs = DEBUG_MODELS[name](True)
    t, c = time.perf_counter(), time.process_time()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=inputs, frontend=fe)
    first, first_cpu = time.perf_counter() - t, time.process_time() - c
    model2, inputs2 = DEBUG_MODELS[name](True)
    t = time.perf_counter()
    fxdebug.instrument(model2, [NaNCheck(), StatCollector()], example_inputs=inputs2, frontend=fe)
    again = time.perf_counter() - t
    return {"model": name, "frontend": dbg.trace_info.frontend, "mode": mode, "instrument_s": round(first, 3),
            "cpu_s": round(first_cpu, 3), "again_s": round(again, 3)}


def main() -> None:
    if len(sys.argv) == 4:
        print(json.dumps(_one(*sys.argv[1:])))
        return
    models = sys.argv[1:] or MODELS
    print(f"{'model':28} {'frontend':9} {'mode':5} {'instrument s':>12} {'cpu s':>7} {'again s':>8}")
    for name in models:
        for frontend in ("snapshot", "dynamo"):
            # "auto" is the live capture by default: the snapshot chain (the second release's "auto") by FXDEBUG_AUTO
            env = {**os.environ, "OMP_NUM_THREADS": "1", "FXDEBUG_AUTO": "snapshot" if frontend == "snapshot" else "dynamo"}
            for mode in ("cold", "warm"):
                out = subprocess.run([sys.executable, __file__, name, frontend, mode], capture_output=True, text=True,
                                     env=env, check=True).stdout.strip().splitlines()[-1]
                r = json.loads(out)
                print(f"{r['model']:28} {r['frontend']:9} {r['mode']:5} {r['instrument_s']:12.3f} {r['cpu_s']:7.3f} "
                      f"{r['again_s']:8.3f}", flush=True)


if __name__ == "__main__":
    main()
