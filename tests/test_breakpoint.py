"""Breakpoint and fxdebug.when: stop at a node, with its tensors, only when a condition holds."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import Breakpoint, NaNCheck
from zoo import ZOO


class LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        return self.out(torch.log(h.abs() + 1) * torch.sqrt(h))  # sqrt of a negative: NaN


def _model():
    torch.manual_seed(0)
    return LogNet()


def test_fires_once_with_the_nodes_tensors_when_a_nan_is_planted():
    model = _model()
    x = torch.ones(2, 4)
    with torch.no_grad():  # make fc's output positive: sqrt is finite on the example run
        model.fc.weight.abs_()
        model.fc.bias.fill_(0.1)
    hits = []
    bp = Breakpoint(None, when=fxdebug.when.new_nonfinite, action=hits.append)
    dbg = fxdebug.instrument(model, [bp], example_inputs=(x,))
    assert torch.equal(dbg(x), model(x)) and hits == []
    bad = x.clone()
    bad[1] = -1.0  # negative fc outputs on row 1: sqrt makes the NaN, downstream nodes only carry it
    y = dbg(bad)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
    (hit,) = hits
    assert hit.node == "sqrt" and hit.module == "" and hit.op == "torch.sqrt"
    assert "torch.sqrt(h)" in hit.source_line
    assert hit.input_names == ("fc",)
    assert torch.isfinite(hit.inputs[0]).all() and torch.isnan(hit.outputs[1]).all()
    torch.testing.assert_close(hit.outputs, torch.sqrt(model.fc(bad)), equal_nan=True)
    assert bp.hits == [hit] and hit.call == 1


def test_where_limits_and_plain_nonfinite_fires_at_each_selected_node():
    model = _model()
    hits = []
    dbg = fxdebug.instrument(model, [Breakpoint(["sqrt", "out"], when=fxdebug.when.nonfinite, action=hits.append)],
                             example_inputs=(torch.ones(2, 4),))
    dbg(-torch.ones(2, 4) * 5)
    assert [h.node for h in hits] == ["sqrt", "out"]


def test_lambda_condition_once_and_threshold():
    model = _model()
    x = torch.randn(3, 4)
    hits = []
    dbg = fxdebug.instrument(model, [Breakpoint("fc", when=lambda y: y.abs().max() > 100, action=hits.append, once=True)],
                             example_inputs=(x,))
    dbg(x)
    assert hits == []
    dbg(x * 1e4)
    dbg(x * 1e4)
    assert len(hits) == 1 and hits[0].node == "fc"
    limit = []
    dbg2 = fxdebug.instrument(model, [Breakpoint("fc", when=fxdebug.when.abs_above(100), action=limit.append)],
                              example_inputs=(x,))
    dbg2(x)
    dbg2(x * 1e4)
    assert [h.call for h in limit] == [1]


def test_default_action_is_breakpoint_with_locals(monkeypatch):
    seen = {}

    def hook(*args, **kwargs):
        seen.update(sys._getframe(1).f_locals)

    monkeypatch.setattr(sys, "breakpointhook", hook)
    model = _model()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [Breakpoint("out")], example_inputs=(x,))
    y = dbg(x)
    assert seen["node"] == "out" and seen["outputs"] is y and seen["module"] == "out"
    assert seen["inputs"][0].shape == (2, 4) and "source_line" in seen


@pytest.mark.parametrize("name", ["residual_cnn", "transformer_block", "inplace_ops"])
def test_bitwise_and_quiet_on_zoo(name):
    model, inputs = ZOO[name]()
    model.eval()
    hits = []
    dbg = fxdebug.instrument(model, [Breakpoint(None, when=fxdebug.when.nonfinite, action=hits.append), NaNCheck()],
                             example_inputs=inputs)
    torch.testing.assert_close(dbg(*inputs), model(*inputs), rtol=0, atol=0)
    assert hits == []
    assert dbg.report().rows  # the breakpoint's nodes do not disturb the report


def test_usage_errors():
    with pytest.raises(fxdebug.UsageError, match="when"):
        Breakpoint("fc", when=3)
    with pytest.raises(fxdebug.UsageError, match="(selects|matches) no node"):
        fxdebug.instrument(_model(), [Breakpoint("nothing_here")], example_inputs=(torch.randn(2, 4),))


def test_when_conditions_on_containers():
    t = torch.tensor([1.0, float("inf")])
    assert bool(fxdebug.when.inf((torch.ones(2), t))) and not bool(fxdebug.when.nan({"a": t}))
    assert bool(fxdebug.when.nonfinite([t])) and not fxdebug.when.nonfinite(torch.zeros(0))
    both = fxdebug.when.all_of(fxdebug.when.inf, fxdebug.when.abs_above(0.5))
    assert bool(fxdebug.when.evaluate(both, t, ()))
    assert not fxdebug.when.evaluate(fxdebug.when.any_of(fxdebug.when.nan), t, ())
