"""Issue 35, the pass library's items: what a new user with real models and the docs met.

B10 NaN already in the data; B8 ShapeAssert after a replaced head; B5 Fuse on an instrumented model;
B13 structured pruning of a BERT's FFN channels. (B11/B12, the option rule: tests/test_pass_options.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxdebug
from fxdebug.passes import NaNCheck


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# -- B10: NaN in the data ------------------------------------------------------------------------
@pytest.mark.parametrize("frontend", ["auto", "symbolic"])
def test_nan_in_the_batch_is_blamed_on_the_data_not_on_an_op(frontend):
    model, x = _mlp(), torch.randn(3, 4)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,), frontend=frontend)
    bad = x.clone()
    bad[1, 2] = float("nan")
    dbg(bad)
    report = dbg.report()
    origin = report.row(report.first_nonfinite)
    assert origin["op"] == "placeholder"  # first_nonfinite keeps its meaning: the first non-finite node
    finding = next(f for f in report.findings() if f.kind == "nonfinite_origin")
    assert "turned finite inputs" not in finding.message
    assert "already carried NaN/Inf when it came in" in finding.message
    assert "check the data" in finding.fix and "origin_samples" in finding.fix
    assert "log" not in finding.fix.split("(")[0]  # not an op's domain advice first

    raising = fxdebug.instrument(model, [NaNCheck(mode="raise")], example_inputs=(x,), frontend=frontend)
    with pytest.raises(fxdebug.NonFiniteError) as info:
        raising(bad)
    message = str(info.value)
    assert "an input of the model's graph" in message and "Check the data" in message
    assert "check its domain" not in message and "this op made them" not in message
    assert info.value.node == report.first_nonfinite


def test_nan_made_by_an_op_is_still_blamed_on_the_op():
    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x - 10)

    x = torch.rand(3, 4)
    dbg = fxdebug.instrument(Log(), [NaNCheck()], example_inputs=(x,), frontend="symbolic")
    dbg(x)
    finding = next(f for f in dbg.report().findings() if f.kind == "nonfinite_origin")
    assert "turned finite inputs into NaN/Inf" in finding.message and "clamp" in finding.fix
