"""Smoke test of an installed fxdebug wheel (run by tools/wheel_smoke.sh from outside the checkout).

Imports every module the wheel ships, then runs the three frontends and a render end to end."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector

venv = Path(sys.argv[1]).resolve()
where = Path(fxdebug.__file__).resolve()
assert venv in where.parents, f"fxdebug imported from {where}, not from the wheel installed in {venv}"

modules = [m.name for m in pkgutil.walk_packages(fxdebug.__path__, "fxdebug.")]
for name in modules:
    importlib.import_module(name)


class ShapeBranch(nn.Module):
    """The root branches on a shape: symbolic tracing fails, torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        if x.dim() == 2:
            return self.body(x)
        return x


class ValueBranch(ShapeBranch):
    """The root branches on a tensor value: only the subtrees frontend captures its parts."""

    def forward(self, x):
        if x.sum() > -1e9:
            return self.body(x)
        return x


x = torch.randn(2, 4)
for frontend in ("symbolic", "export", "subtrees"):
    model = {"symbolic": lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU()), "export": ShapeBranch,
             "subtrees": ValueBranch}[frontend]()
    dbg = fxdebug.instrument(model, passes=[NaNCheck(), StatCollector()], example_inputs=(x,),
                             frontend=frontend)
    assert torch.equal(dbg(x), model(x)), frontend
    assert dbg.report().rows, f"{frontend}: empty report"

out = Path("smoke.svg")
fxdebug.render(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), str(out), example_inputs=(x,))
assert out.stat().st_size > 0
print(f"wheel smoke: {len(modules)} modules import; symbolic, export, subtrees and render work")
