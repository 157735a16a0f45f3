"""Cost of fxdebug's training tools on a training loop.

``probes``: ``fxdebug.collect`` with each training probe set vs a plain loop — 20 forward+backward
batches (8 x 3 x 16 x 16) of the zoo's residual CNN, interleaved with the plain loop ``--repeats``
times; the median time and the ratio to the plain loop with its min/max.

``aids``: ``fxdebug.guard`` and ``ParamUpdates`` on an optimizer loop (forward + loss + backward +
``step()`` + ``zero_grad()`` of a small transformer-style MLP stack, plain PyTorch, so only the aid
differs). Each variant runs ``--steps`` steps per round; rounds of all variants interleave (machine
load drifts evenly over them); the figure is the median per-step time over ``--rounds`` rounds and
the spread (min..max of the per-round ratios).

    OMP_NUM_THREADS=1 python tools/bench_training.py [--what probes|aids|all] [--repeats 5] [--rounds 15] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxdebug  # noqa: E402
from fxdebug.passes import ParamGrads, ParamUpdates, Profile, StatCollector  # noqa: E402
from zoo import ZOO  # noqa: E402

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "Adam (for-loop)": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False),
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, 10))


def loop(variant: str, make_opt: Callable[[Any], torch.optim.Optimizer], width: int, depth: int,
         batch: int) -> Callable[[int], float]:
    net = model(width, depth)
    opt: Any = make_opt(net.parameters())
    if variant == "guard":
        opt = fxdebug.guard(opt)
    elif variant == "param_updates":
        ParamUpdates(opt)  # hooks the optimizer's step; the model itself stays plain
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 16, width, generator=gen)
    y = torch.randint(0, 10, (batch, 16), generator=gen)

    def run(steps: int) -> float:
        t0 = time.process_time()  # CPU time of this process: steadier than wall time on a shared machine
        for _ in range(steps):
            out = net(x)
            torch.nn.functional.cross_entropy(out.reshape(-1, 10), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        return (time.process_time() - t0) / steps

    run(3)  # warm-up (lazy optimizer state, allocator)
    return run


def probes(args: argparse.Namespace) -> None:
    """The training probes through ``fxdebug.collect`` vs a plain forward+backward loop."""
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


def aids(args: argparse.Namespace) -> None:
    """``fxdebug.guard`` and ``ParamUpdates`` on an optimizer loop vs the same loop without them."""
    torch.set_num_threads(args.threads)
    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); model: {args.depth} blocks of width "
          f"{args.width} ({params / 1e6:.2f}M parameters), batch {args.batch}x16 tokens; {args.rounds} rounds x "
          f"{args.steps} steps; median (min..max over rounds)")
    print(f"{'optimizer':<24} {'plain ms/step':>14} {'guard ratio':>22} {'ParamUpdates ratio':>22} {'ParamUpdates us/step':>21}")
    for name, make in OPTIMIZERS.items():
        runs = {v: loop(v, make, args.width, args.depth, args.batch) for v in ("plain", "guard", "param_updates")}
        times: dict[str, list[float]] = {v: [] for v in runs}
        for _ in range(args.rounds):
            for v, run in runs.items():
                times[v].append(run(args.steps))
        plain = times["plain"]
        g = [a / b for a, b in zip(times["guard"], plain)]
        u = [a / b for a, b in zip(times["param_updates"], plain)]
        cost = [(a - b) * 1e6 for a, b in zip(times["param_updates"], plain)]
        print(f"{name:<24} {statistics.median(plain) * 1e3:>14.2f} "
              f"{statistics.median(g):>8.3f} ({min(g):.3f}..{max(g):.3f}) "
              f"{statistics.median(u):>8.3f} ({min(u):.3f}..{max(u):.3f}) "
              f"{statistics.median(cost):>12.0f} ({min(cost):.0f}..{max(cost):.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("probes", "aids", "all"), default="all")
    ap.add_argument("--repeats", type=int, default=5, help="probes: interleaved repeats")
    ap.add_argument("--rounds", type=int, default=15, help="aids: interleaved rounds")
    ap.add_argument("--steps", type=int, default=20, help="aids: steps per round")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.what in ("probes", "all"):
        probes(args)
    if args.what in ("aids", "all"):
        aids(args)


if __name__ == "__main__":
    main()
