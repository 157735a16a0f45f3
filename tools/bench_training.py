"""Cost of the training tools: ``fxdebug.collect`` with each probe set vs a plain training-step loop.

Runs 20 forward+backward batches (8 x 3 x 16 x 16) of the zoo's residual CNN, one thread, each
configuration interleaved with the plain loop ``--repeats`` times; prints the median time and the
ratio to the plain loop with its min/max. Usage: ``python tools/bench_training.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fxdebug  # noqa: E402
from fxdebug.passes import ParamGrads, Profile, StatCollector  # noqa: E402
from zoo import ZOO  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, (x,) = ZOO["residual_cnn"]()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(20)]

    def loss(out, batch):
        return F.cross_entropy(out, batch[1])

    def plain() -> None:
        for xb, yb in batches:
            model.zero_grad(set_to_none=True)
            loss(model(xb), (xb, yb)).backward()

    configs = {
        "StatCollector(grads=True)": [StatCollector(grads=True)],
        "+ ParamGrads()": [StatCollector(grads=True), ParamGrads()],
        "StatCollector(grads, histograms)": [StatCollector(grads=True, histograms=True)],
        "Profile(time=True)": [Profile(time=True)],
    }
    dbgs = {k: fxdebug.instrument(model, v, example_inputs=(x,)) for k, v in configs.items()}
    times: dict[str, list[float]] = {"plain loop": [], **{k: [] for k in configs}}
    for _ in range(args.repeats):
        start = time.perf_counter()
        plain()
        times["plain loop"].append(time.perf_counter() - start)
        for k, dbg in dbgs.items():
            start = time.perf_counter()
            fxdebug.collect(dbg, batches, loss_fn=loss, progress=False)
            times[k].append(time.perf_counter() - start)
    base = statistics.median(times["plain loop"])
    for k, v in times.items():
        print(f"{k:34s} {statistics.median(v) * 1e3:8.1f} ms  x{statistics.median(v) / base:5.2f} "
              f"(min x{min(v) / base:.2f}, max x{max(v) / base:.2f})")


if __name__ == "__main__":
    main()
