"""The bundled demo: a small CNN with two real problems planted, and the main job run over it.

``DemoNet`` is an ordinary conv net except that

* ``stage2``'s conv has a large negative bias on 12 of its 16 output channels, so the ReLU after
  it (``stage2.act``) never lets them through: a stage of dead ReLUs (75% dead channels);
* ``head`` computes a temperature as ``torch.log`` of a 4-way linear projection, one column of
  which is negative (about -0.3), so ``log`` turns part of its finite input into NaN, which the
  sum then spreads to every output.

``run_demo`` instruments it with ``NaNCheck`` and ``StatCollector``, runs a few batches, prints
the report and what it found, writes the annotated SVG, and suggests the fix.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

import torch
from torch import Tensor, nn

from fxdebug.errors import FxDebugError

__all__ = ["DemoNet", "demo_batches", "demo_model", "run_demo"]

DEAD_CHANNELS = 12


class Stage(nn.Module):
    """conv → batch-norm-free ReLU, the unit the demo stacks."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.act(self.conv(x))
        return y


class Head(nn.Module):
    """Classifier with a learned temperature; ``log`` of the projection is the planted NaN."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, classes)
        self.temperature = nn.Linear(features, 4)

    def forward(self, x: Tensor) -> Tensor:
        t = torch.log(self.temperature(x))  # one projection is negative → NaN in that column
        logits: Tensor = self.fc(x)
        return logits / t.sum(dim=1, keepdim=True)


class DemoNet(nn.Module):
    """stem → stage1 → stage2 (dead ReLUs) → pool → head (NaN from log)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.stage1 = Stage(8, 16)
        self.stage2 = Stage(16, 16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = Head(16, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stage2(self.stage1(self.stem(x)))
        y: Tensor = self.head(torch.flatten(self.pool(x), 1))
        return y


def demo_model() -> DemoNet:
    """A ``DemoNet`` with its problems planted, the same on every call (seeded, RNG restored)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DemoNet()
    bias = model.stage2.conv.bias
    assert bias is not None
    with torch.no_grad():
        bias[:DEAD_CHANNELS] = -50.0  # these channels never become positive
        bias[DEAD_CHANNELS:] = 0.5  # the others stay alive
        model.head.temperature.bias.copy_(torch.tensor([1.0, 0.5, -0.3, 2.0]))  # log(-0.3...) is NaN
    return model.eval()


def demo_batches(n: int = 4, batch: int = 8, size: int = 16) -> list[Tensor]:
    """``n`` seeded input batches of shape ``(batch, 3, size, size)``."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 3, size, size, generator=gen) for _ in range(n)]


def run_demo(out: str = "demo.svg", *, batches: int = 4, stream: TextIO | None = None) -> int:
    """Instrument ``DemoNet``, run ``batches`` batches, print the findings, draw ``out``.

    Returns the exit status for the CLI: 0 when the picture was written (finding the planted
    problems is the point), 2 when it could not be drawn (e.g. graphviz missing).
    """
    import fxdebug
    from fxdebug.passes import NaNCheck, StatCollector  # lazily: the core never imports passes

    from fxdebug.cli.support import findings

    stream = stream if stream is not None else sys.stdout
    model = demo_model()
    data = demo_batches(batches)
    sink: TextIO = stream

    def say(text: str = "") -> None:
        print(text, file=sink)

    say(f"fxdebug demo: {type(model).__name__} with two planted problems, {batches} batches of {tuple(data[0].shape)}")
    dbg = fxdebug.instrument(model, passes=[NaNCheck(mode="record"), StatCollector()], example_inputs=(data[0],))
    with torch.no_grad():
        for x in data:
            dbg(x)
    report = dbg.report()
    say()
    say(str(report))
    say()
    say("What fxdebug found:")
    found = findings(report, dbg)
    for line in found or ["nothing unusual."]:
        say(f"  - {line}")
    say()
    say("Suggested fixes:")
    if any(f.kind == "dead_activations" for f in report.findings()):
        say("  - dead ReLUs: swap exactly those for LeakyReLU, using this report:")
        say("      from fxdebug.passes import SwapActivation")
        say("      fixed = fxdebug.instrument(dbg, passes=[SwapActivation(only_dead=0.5)], example_inputs=(x,))")
    if report.first_nonfinite:
        say(f"  - NaN from '{report.first_nonfinite}': keep its input in the op's domain, "
            "e.g. torch.log(t.clamp_min(1e-6)) or softplus before the log.")
    try:
        path = dbg.render(out)
    except FxDebugError as exc:
        say()
        say(f"error: {exc}")
        return 2
    dot = os.path.splitext(path)[0] + ".dot"
    say()
    say(f"wrote {path} (graph source: {dot}); open it in a browser and hover a node for every number.")
    return 0
