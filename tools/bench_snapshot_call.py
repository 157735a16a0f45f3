"""Per-call cost of a snapshot module's "does this graph still hold?" check (issue 32 item 6).

Times ``dbg(x)`` of a small MLP instrumented by the symbolic and the export frontends (no passes,
so the graph is the model's and the difference to the plain call is fxdebug's per-call work), and
the plain ``model(x)``, one thread, many calls. Run: ``OMP_NUM_THREADS=1 python tools/bench_snapshot_call.py``.
"""

from __future__ import annotations

import argparse
import timeit

import torch
from torch import nn

import fxdebug


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(2, 16)
    subjects = {"plain": model}
    for frontend in ("symbolic", "export"):
        subjects[frontend] = fxdebug.instrument(model, [], example_inputs=(x,), frontend=frontend)
    with torch.no_grad():
        for name, fn in subjects.items():
            fn(x)
            best = min(timeit.repeat(lambda: fn(x), number=args.calls, repeat=args.repeat)) / args.calls
            print(f"{name:9s} {best * 1e6:7.2f} us/call")


if __name__ == "__main__":
    main()
