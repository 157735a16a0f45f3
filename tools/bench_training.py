"""Cost of fxdebug's training tools on a training loop.

``probes``: ``fxdebug.collect`` with each training probe set vs a plain loop — 20 forward+backward
batches (8 x 3 x 16 x 16) of the zoo's residual CNN, interleaved with the plain loop ``--repeats``
times; the median time and the ratio to the plain loop with its min/max.

``aids``: ``fxdebug.guard`` and ``ParamUpdates`` on an optimizer loop (forward + loss + backward +
``step()`` + ``zero_grad()`` of a small transformer-style MLP stack, plain PyTorch, so only the aid
differs). The variants' training steps interleave one by one (rotating order), ``--rounds`` x
``--steps`` steps each, so each step pairs with the plain loop's step next to it in time; the figure
is 1 + the median (and quartiles) of those paired differences over the plain loop's median step; a
second plain loop (``plain again``) shows the noise of the figure itself. Each round also times
``step()`` alone on one batch's gradients kept (``hot``: the aid's own work with warm caches).

    OMP_NUM_THREADS=1 python tools/bench_training.py [--what probes|aids|all] [--repeats 5] [--rounds 25] [--steps 20]
        [--batch 8 32] [--only SGD AdamW] [--norm layer|batch] [--guard-model]

``--guard-model`` adds a variant that passes the model to the guard (``dbg=model``: a skipped step
also takes back its buffers, a good one copies them; ``--norm batch`` gives the blocks running
statistics to copy), paired in the same rounds as ``guard(opt)``: the difference is that cost.
"""

from __future__ import annotations

import argparse
import os
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


class TokenBatchNorm(nn.BatchNorm1d):
    """Batch norm over the feature dim of ``(batch, tokens, width)`` (``--norm batch``: a model with
    running statistics, the buffers ``fxdebug.guard(opt, dbg=model)`` takes back on a skipped step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(0, 1)).view_as(x)


NORM = {"layer": nn.LayerNorm, "batch": TokenBatchNorm}
SETTINGS = {"norm": "layer"}  # set from the command line


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = NORM[SETTINGS["norm"]](width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.Linear(width, 10))


def loop(variant: str, make_opt: Callable[[Any], torch.optim.Optimizer], width: int, depth: int,
         batch: int) -> tuple[Callable[[int], tuple[float, float]], Callable[[int], float]]:
    """``(run, hot)``: ``run(steps)`` times the loop, ``hot(steps)`` times ``step()`` alone on one
    batch's gradients kept (caches warm: the aid's own work, with the least noise)."""
    net = model(width, depth)
    opt: Any = make_opt(net.parameters())
    if variant in ("guard", "guard_model"):
        opt = fxdebug.guard(opt, dbg=net if variant == "guard_model" else None)
    elif variant == "param_updates":
        ParamUpdates(opt)  # hooks the optimizer's step; the model itself stays plain
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 16, width, generator=gen)
    y = torch.randint(0, 10, (batch, 16), generator=gen)
    clock = time.process_time  # CPU time of this process (steadier than wall time on a shared machine)

    def run(steps: int) -> tuple[float, float]:
        """(loop time, ``step()`` time) per step."""
        in_step = 0.0
        t0 = clock()
        for _ in range(steps):
            out = net(x)
            torch.nn.functional.cross_entropy(out.reshape(-1, 10), y.reshape(-1)).backward()
            s0 = clock()
            opt.step()
            in_step += clock() - s0
            opt.zero_grad()
        return (clock() - t0) / steps, in_step / steps

    def hot(steps: int) -> float:
        """``step()`` time per step, ``steps`` steps on the same gradients."""
        torch.nn.functional.cross_entropy(net(x).reshape(-1, 10), y.reshape(-1)).backward()
        t0 = clock()
        for _ in range(steps):
            opt.step()
        took = (clock() - t0) / steps
        opt.zero_grad()
        return took

    run(3)  # warm-up (lazy optimizer state, allocator)
    hot(2)
    return run, hot


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
    """``fxdebug.guard`` and ``ParamUpdates`` on an optimizer loop vs the same loop without them.

    The variants' training steps interleave one by one (CPU time of the process, rotating order):
    each of a variant's steps is paired with the plain loop's step next to it in time. ``loop`` is
    1 + the median (quartiles) of those paired differences over the plain loop's median step.
    ``plain again`` is a second, separately built plain loop: its figure is the noise of the
    measurement itself (what 1.00 looks like on this machine, now).

    ``step +us`` times ``step()`` alone (the aid's own work) in the same steps: the median (quartiles)
    of the paired differences to the plain loop's ``step()``; ``-> ratio`` is 1 + that median over
    the plain loop's time per step — free of the forward/backward's noise, which dominates the
    whole loop's figure on a loaded machine. ``hot +us``: ``step()`` alone, ``--steps`` steps on one
    batch's gradients kept, once per round (warm caches: the least the aid costs)    whole loop's ratio on a loaded machine."""
    torch.set_num_threads(args.threads)
    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} CPU(s), load average "
          f"{load}; model: {args.depth} blocks of width {args.width} ({params / 1e6:.2f}M parameters), 16 tokens per "
          f"sample; {args.rounds} rounds x {args.steps} steps, the variants' steps interleaved one by one; loop: 1 + the "
          f"median (quartiles) of each step's paired difference to the plain loop's over its time; step +us: the same "
          f"for step() alone in the loop; hot +us: step() alone, {args.steps} steps on kept gradients, per round")
    variants: tuple[str, ...] = ("plain", "plain again", "guard", "param_updates")
    if args.guard_model:  # the guard given the model too (its buffers taken back), paired in the same rounds
        variants = ("plain", "plain again", "guard", "guard_model", "param_updates")
    print(f"{'optimizer':<16} {'batch':>5} {'plain ms':>8} {'plain again (noise)':>20} {'guard loop':>20} "
          f"{'guard step +us':>18} {'-> ratio':>8} {'hot +us':>14} {'-> ratio':>8} {'ParamUpdates loop':>20} "
          f"{'PU step +us':>18} {'-> ratio':>8} {'hot +us':>14} {'-> ratio':>8}")
    for batch in args.batch:
        for name, make in OPTIMIZERS.items():
            if args.only and not any(o.lower() in name.lower() for o in args.only):
                continue
            runs = {v: loop("plain" if v == "plain again" else v, make, args.width, args.depth, batch) for v in variants}
            times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
            hots: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(args.rounds):
                # one training step of each variant in turn (rotating order): pairs a step with the plain
                # loop's step next to it in time, so load that drifts over seconds cancels out
                for i in range(args.steps):
                    k = (r * args.steps + i) % len(variants)
                    for v in variants[k:] + variants[:k]:
                        times[v].append(runs[v][0](1))
                for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                    hots[v].append(runs[v][1](args.steps))
            plain = [t for t, _ in times["plain"]]
            plain_s = statistics.median(plain)

            def quart(xs: list[float]) -> tuple[float, float, float]:
                xs = sorted(xs)
                return xs[len(xs) // 4], statistics.median(xs), xs[(3 * len(xs)) // 4]

            def ratio(v: str) -> str:
                lo, mid, hi = quart([(a - b) / plain_s for (a, _), b in zip(times[v], plain)])
                return f"{1 + mid:.3f} ({1 + lo:.2f}..{1 + hi:.2f})"

            def cost(us: list[float]) -> str:
                lo, mid, hi = quart(us)
                return f"{mid:6.0f} ({lo:.0f}..{hi:.0f}) {1 + mid / 1e6 / plain_s:8.3f}"

            def step_cost(v: str) -> str:
                return cost([(a - b) * 1e6 for (_, a), (_, b) in zip(times[v], times["plain"])])

            def hot_cost(v: str) -> str:
                return cost([(a - b) * 1e6 for a, b in zip(hots[v], hots["plain"])])

            print(f"{name:<16} {batch:>5} {plain_s * 1e3:>8.2f} {ratio('plain again'):>20} {ratio('guard'):>20} "
                  f"{step_cost('guard'):>27} {hot_cost('guard'):>23} {ratio('param_updates'):>20} "
                  f"{step_cost('param_updates'):>27} {hot_cost('param_updates'):>23}", flush=True)
            if "guard_model" in times:
                print(f"{'  guard(opt, dbg=model)':<22} {ratio('guard_model'):>20} step {step_cost('guard_model'):>27} "
                      f"hot {hot_cost('guard_model'):>23}", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("probes", "aids", "all"), default="all")
    ap.add_argument("--repeats", type=int, default=5, help="probes: interleaved repeats")
    ap.add_argument("--rounds", type=int, default=25, help="aids: interleaved rounds")
    ap.add_argument("--steps", type=int, default=20, help="aids: steps per round")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32], help="aids: batch sizes (samples of 16 tokens)")
    ap.add_argument("--only", nargs="*", default=[], help="aids: optimizers whose name contains one of these")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--norm", choices=sorted(NORM), default="layer",
                    help="aids: the blocks' norm (batch: running statistics, buffers written in forward)")
    ap.add_argument("--guard-model", action="store_true",
                    help="aids: also fxdebug.guard(opt, dbg=model), which takes back the model's buffers too")
    args = ap.parse_args()
    SETTINGS.update(norm=args.norm)
    if args.what in ("probes", "all"):
        probes(args)
    if args.what in ("aids", "all"):
        aids(args)


if __name__ == "__main__":
    main()
