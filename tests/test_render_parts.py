"""Pictures of per-subtree captures: the eager parent as clusters, with the data edges between parts."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.capture.part_flow import part_flow
from fxdebug.passes import NaNCheck, StatCollector

pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        with torch.no_grad():
            self.fc.bias.fill_(100.0)  # positive while captured; the test makes it negative

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return torch.log(self.fc(f.mean((2, 3))))  # NaN where the projection is negative


class Gate(nn.Module):
    """Untraceable on its own (branches on a value): its ``proj`` is captured instead."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y * 0 if float(y.sum()) > 1e9 else y


class Pipeline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.head = Head()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.backbone(x * 2)  # an eager op before the first part
        if float(f.sum()) < -1e9:  # the root cannot be captured
            f = -f
        return self.gate(self.head(f))


def test_part_flow_matches_outputs_to_later_inputs() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    calls = {"p": ((a,), {}, b), "q": ((b,), {}, a + 1), "r": ((a * 5,), {"k": a + 1}, None)}
    assert part_flow(calls) == [("p", "q", (2, 3)), ("q", "r", (2, 3))]


def test_subtrees_picture_joins_the_parts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Pipeline().eval()
    x = torch.randn(2, 3, 6, 6)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="subtrees")
    assert set(dbg.parts()) == {"backbone", "head", "gate.proj"}
    with torch.no_grad():
        model.head.fc.bias.fill_(-100.0)
        dbg(x)
    origin = dbg.report().first_nonfinite
    assert origin == "head/log"
    path = dbg.render(str(tmp_path / "parts.svg"), depth=99)
    dot = (tmp_path / "parts.dot").read_text(encoding="utf-8")
    assert {"cluster/backbone", "cluster/head", "cluster/gate"} <= set(re.findall(r'id="(cluster/[\w.]+)"', dot))
    assert "gate : Gate (eager)" in dot and "forward runs eagerly" in dot
    edges = set(re.findall(r'^\s*"?([\w/.]+)"? -> "?([\w/.]+)"?', dot, re.M))
    assert ("backbone/relu", "head/mean") in edges  # backbone's output is head's input
    assert ("head/log", "gate_proj/gate_proj") in edges or any(a == "head/log" and b.startswith("gate.proj/")
                                                               for a, b in edges)
    assert '"head/f"' not in dot  # a matched input is not drawn as an input of its own
    assert "comes from the eager forward around backbone" in dot  # x * 2 was computed eagerly
    assert Path(path).read_text(encoding="utf-8").count("NaN/Inf ORIGIN") >= 1
    html = dbg.render(str(tmp_path / "parts.html"))
    assert '"name":"head/log"' in Path(html).read_text(encoding="utf-8")
