"""Bugs a new user hit (issue 28), each with the test that failed before its fix: findings that
blame the wrong thing, the report's dtype after ``.to()``, an unmet precision plan's summary."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("frontend", ["symbolic", "auto"])
def test_record_mode_names_the_non_finite_weight(frontend):
    """B7: with a NaN weight, the record-mode finding said 'turned finite inputs into NaN/Inf'."""
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(3, 4)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend=frontend)
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("nan")
    dbg(x)
    report = dbg.report()
    assert report.row(report.first_nonfinite)["module"] == "fc2"
    assert report.nonfinite_params == ["fc2.weight"]
    origin = next(f for f in report.findings() if f.kind == "nonfinite_origin")
    assert "non-finite parameter(s) fc2.weight" in origin.message and "finite inputs" not in origin.message
    assert "weights were already NaN/Inf" in origin.fix


def test_finite_weights_still_blame_the_op():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(1e38)  # large but finite: the op overflows
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(torch.randn(2, 4),), frontend="symbolic")
    dbg(torch.full((2, 4), 10.0))
    report = dbg.report()
    assert report.first_nonfinite is not None and report.nonfinite_params == []
    assert "turned finite inputs into NaN/Inf" in report.findings()[0].message


def test_backward_finding_does_not_advise_an_empty_list():
    """The backward origin's advice pointed at nonfinite_grad_from even when that list was empty."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    dbg = fxdebug.instrument(model, [NaNCheck(backward=True)], example_inputs=(torch.randn(2, 4),), frontend="symbolic")
    out = dbg(torch.randn(2, 4))
    (out.sum() * float("inf")).backward()
    report = dbg.report()
    assert report.first_nonfinite_grad is not None and report.nonfinite_grad_from == []
    back = next(f for f in report.findings() if f.kind == "nonfinite_origin" and "backward" in f.message)
    assert "nonfinite_grad_from" not in back.fix and "loss" in back.fix


def test_findings_with_a_misspelt_threshold_is_a_usage_error():
    dbg = fxdebug.instrument(Mlp(), [StatCollector()], example_inputs=(torch.randn(2, 4),), frontend="symbolic")
    dbg(torch.randn(2, 4))
    with pytest.raises(fxdebug.UsageError, match="vanishing") as info:
        dbg.report().findings(vanish=1e-9)
    assert "no such threshold" in str(info.value) and not isinstance(info.value, TypeError)


def test_flight_recorder_keeps_each_later_call_its_own_values():
    """After a NaN call every later call's history read NaN: the running sums were poisoned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    dbg = fxdebug.instrument(model, [NaNCheck(history=5)], example_inputs=(torch.randn(2, 4),), frontend="symbolic")
    xs = [torch.randn(2, 4) for _ in range(4)]
    xs[1][0, 0] = float("nan")
    outs = [model[0](x).detach() for x in xs]
    for x in xs:
        dbg(x)
    history = dict(dbg.report().history.node("_0"))
    assert history[1]["nonfinite"] and history[1]["nan"] == 4 and math.isnan(history[1]["norm"])
    for call in (0, 2, 3):  # before and after the bad call: that call's own numbers
        assert not history[call]["nonfinite"]
        assert history[call]["mean"] == pytest.approx(outs[call].double().mean().item(), rel=1e-6)
        assert history[call]["norm"] == pytest.approx(outs[call].double().norm().item(), rel=1e-6)
    assert dbg.report().row("_0")["nonfinite_calls"] == 1


def test_dtype_column_follows_the_model_after_to():
    """After ``.to(float64)`` the report's dtype column still said float32."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(torch.randn(2, 4),), frontend="symbolic")
    dbg.to(torch.float64)
    dbg(torch.randn(2, 4, dtype=torch.float64))
    report = dbg.report()
    assert [r["dtype"] for r in report.rows] == ["float64", "float64"]
    assert "float32" not in report.table(cols=["node", "dtype"])


def test_an_unmet_precision_plan_says_not_met():
    """An unmet plan's summary printed the numbers but never said the tolerance was not met."""
    from fxdebug.numerics.precision import PrecisionPlan

    unmet = PrecisionPlan(nodes=["log"], error_before=0.5, error_after=0.2, tol=1e-2, dtype=torch.bfloat16, runs=3)
    met = PrecisionPlan(nodes=["log"], error_before=0.5, error_after=1e-3, tol=1e-2, dtype=torch.bfloat16, runs=3)
    assert not unmet.ok and "NOT met" in str(unmet).splitlines()[0] and "tolerance not met" in str(unmet)
    assert met.ok and "not met" not in str(met).lower() and "tol 0.01: met" in str(met)
