"""``Report.findings()``: typed findings naming node, module, figure and fix, on real runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.report.findings import (CheckFailed, ExplodingGradients, FindingRules, NonFiniteOrigin,
                              VanishingGradients, activation_row)
from fxdebug.passes import NaNCheck, ParamGrads, StatCollector
from zoo import ZOO


def _deep(act, depth, scale, width=16):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        lin = nn.Linear(width, width)
        with torch.no_grad():
            lin.weight.normal_(0, scale / width ** 0.5)
            lin.bias.zero_()
        layers += [lin, act()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _run(model, passes, x, loss=True):
    dbg = fxdebug.instrument(model, passes, example_inputs=(x,))
    return fxdebug.collect(dbg, [x], loss_fn=(lambda o, b: o.sum()) if loss else None, progress=False)


def test_vanishing_gradients_name_the_layer_below_which_nothing_learns():
    model = _deep(nn.Sigmoid, 10, 0.5)
    x = torch.randn(8, 16)
    report = _run(model, [StatCollector(grads=True), ParamGrads()], x)
    (f,) = [f for f in report.findings() if isinstance(f, VanishingGradients)]
    grads = {str(i): model[i].weight.grad for i in range(0, 21, 2)}  # collect put .grad back: recompute by hand
    assert all(g is None for g in grads.values())
    model(x).sum().backward()
    below = [name for name in ("0", "2", "4") if max(float(p.grad.abs().max()) for p in model[int(name)].parameters())
             < FindingRules.vanishing]
    assert f.nodes == tuple(f"_{n}" for n in below) and f.node == f"_{below[-1]}" and f.module == below[-1]
    assert f.figure == pytest.approx(report.row(f.node)["param_grad_max_abs"])
    assert f"at and below {below[-1]}" in f.message and "Fix:" in str(f) and f.kind == "vanishing_gradients"
    # the threshold is an override: stricter finds nothing, looser finds a longer run
    assert not [f for f in report.findings(vanishing=1e-10) if isinstance(f, VanishingGradients)]
    (loose,) = [f for f in report.findings(vanishing=1e-3) if isinstance(f, VanishingGradients)]
    assert len(loose.nodes) > len(f.nodes)


def test_exploding_gradients_and_activation_gradients_without_param_grads():
    model = _deep(nn.Identity, 6, 4.0)
    x = torch.randn(8, 16)
    with_params = _run(model, [StatCollector(grads=True), ParamGrads()], x).findings()
    (f,) = [f for f in with_params if isinstance(f, ExplodingGradients)]
    assert "parameter gradients explode" in f.message and f.figure > FindingRules.exploding
    only_acts = _run(model, [StatCollector(grads=True)], x).findings(exploding=10.0)
    (g,) = [f for f in only_acts if isinstance(f, ExplodingGradients)]
    assert g.message.startswith("gradients explode") and g.figure > 10
    assert not _run(model, [StatCollector(grads=True)], x).findings(exploding=1e9)


class _DeadHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc.bias[:6] = -100.0  # six of eight units never fire
        self.act = nn.ReLU()
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


def test_dead_activations_only_on_activations_with_a_fix():
    torch.manual_seed(0)
    report = _run(_DeadHead(), [StatCollector()], torch.randn(16, 8), loss=False)
    dead = [f for f in report.findings() if f.kind == "dead_activations"]
    assert [(f.node, f.module, f.figure) for f in dead] == [("act", "act", 0.75)]
    assert "75% of its 8 channels never positive" in dead[0].message and "SwapActivation" in dead[0].fix
    assert report.row("fc")["dead_frac"] >= 0.75  # the linear's row has the number too, but it is no finding
    assert not [f for f in report.findings(dead=0.9) if f.kind == "dead_activations"]


class _LogModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.fc(x)).sum(-1)


def test_nonfinite_origin_forward_and_backward_with_op_specific_fix():
    torch.manual_seed(0)
    report = _run(_LogModel(), [NaNCheck(backward=True)], torch.randn(8, 4))
    kinds = [f for f in report.findings() if isinstance(f, NonFiniteOrigin)]
    assert kinds[0].node == "log" and "turned finite inputs into NaN/Inf" in kinds[0].message
    assert "clamp" in kinds[0].fix and kinds[0].severity == "error"
    assert kinds[0].figure == 0  # first seen in call 0


def test_shape_failure_in_collect_is_the_first_finding():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    report = fxdebug.collect(dbg, [x, torch.randn(2, 1, 16, 16)], progress=False)
    first = report.findings()[0]
    assert isinstance(first, CheckFailed) and first.node == "stem_0" and first.module == "stem.0"
    assert first.to_dict()["kind"] == "check_failed" and "input shape" in first.fix


def test_a_healthy_run_has_no_findings_and_bad_thresholds_are_refused():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    report = _run(model, [NaNCheck(), StatCollector(grads=True), ParamGrads()], x)
    assert report.findings() == []
    with pytest.raises(fxdebug.UsageError, match="vanishing < exploding"):
        report.findings(vanishing=10.0, exploding=1.0)


@pytest.mark.parametrize("op,expected", [("ReLU", True), ("F.relu", True), (".relu_", True), ("aten.gelu.default", True),
                                         ("Conv2d", False), ("operator.add", False), ("BatchNorm2d", False)])
def test_activation_rows(op, expected):
    assert activation_row({"op": op}) is expected
