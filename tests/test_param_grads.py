"""``ParamGrads``: per-module parameter-gradient statistics, against ``.grad`` computed by hand."""

from __future__ import annotations

import pytest
import torch

import fxdebug
from fxdebug.passes import Freeze, ParamGrads
from zoo import ZOO


def _expected(grads):
    flat = torch.cat([g.reshape(-1) for g in grads]).double()
    return float(flat.abs().mean()), float(flat.abs().max()), float(flat.norm())


@pytest.mark.parametrize("name", ["residual_cnn", "transformer_block", "lstm", "get_attr_params", "shared_module"])
def test_statistics_equal_the_gradients_of_one_backward(name):
    model, (x,) = ZOO[name]()
    dbg = fxdebug.instrument(model, [ParamGrads()], example_inputs=(x,))
    model.zero_grad(set_to_none=True)
    dbg(x).sum().backward()
    report = dbg.report()
    rows = [r for r in report.rows if r.get("param_grad_calls")]
    assert rows
    covered = 0
    for r in rows:
        owner = model.get_submodule(r["param_module"]) if r["param_module"] else model
        if r["param_module"]:
            grads = [p.grad for p in owner.parameters()]
        else:  # parameters read directly: the row of the node that uses them
            used = {n.target for part in dbg.parts().values() for n in part.graph.nodes
                    if n.op == "get_attr" and r["node"] in {u.name for u in n.users}}
            grads = [getattr(model, t).grad for t in used]
        mean_abs, max_abs, norm = _expected(grads)
        assert r["param_grad_mean_abs"] == pytest.approx(mean_abs, rel=1e-5)
        assert r["param_grad_max_abs"] == pytest.approx(max_abs, rel=1e-6)
        assert r["param_grad_norm"] == pytest.approx(norm, rel=1e-5)
        covered += sum(g.numel() for g in grads)
    assert covered == sum(p.numel() for p in model.parameters())  # every parameter counted once


def test_accumulates_over_backwards_and_skips_forwards_without_backward():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [ParamGrads()], example_inputs=(x,))
    norms = []
    for scale in (1.0, 2.0):
        model.zero_grad(set_to_none=True)
        (scale * dbg(x).sum()).backward()
        norms.append(float(model.fc.weight.grad.double().pow(2).sum() + model.fc.bias.grad.double().pow(2).sum()))
    dbg(x)  # a forward with no backward after it: its hooks are dropped at the next forward
    with torch.no_grad():
        dbg(x)
    row = dbg.report().row("fc")
    assert row["param_grad_calls"] == 2
    assert row["param_grad_norm"] == pytest.approx(((norms[0] + norms[1]) / 2) ** 0.5, rel=1e-5)
    assert all(len(p._backward_hooks or {}) <= 1 for p in model.parameters())  # no hooks pile up


def test_frozen_modules_have_no_parameter_gradients():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [Freeze("layer1"), ParamGrads()], example_inputs=(x,))
    dbg(x).sum().backward()
    report = dbg.report()
    assert report.row("layer1_0_conv1")["param_grad_calls"] == 0 and "param_grad_norm" not in report.row("layer1_0_conv1")
    assert report.row("stem_0")["param_grad_calls"] == 1


def test_a_leaf_whose_first_parameter_is_unused_still_counts_its_backward():
    model, (x,) = ZOO["control_flow"]()  # gate is an auto-leaf; one of its two branches runs
    # auto-leafing is symbolic tracing's (Dynamo sees gate's ops, not a leaf): the subject pins the frontend
    dbg = fxdebug.instrument(model, [ParamGrads()], example_inputs=(x,), frontend="symbolic")
    model.zero_grad(set_to_none=True)
    dbg(x).sum().backward()
    row = dbg.report().row("gate")
    used = [p.grad for p in model.gate.parameters() if p.grad is not None]
    assert row["param_grad_calls"] == 1 and 0 < len(used) < 4
    assert row["param_grad_max_abs"] == pytest.approx(max(float(g.abs().max()) for g in used))


def test_keeps_recording_after_the_documented_re_instrument_step():
    """B4: ``instrument(dbg, [SwapActivation(only_dead=...)])`` copies fxdebug's modules; ParamGrads'
    hooks must land on the model's live parameters, not on copies nothing computes with."""
    from fxdebug.passes import StatCollector, SwapActivation

    torch.manual_seed(0)
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector(), ParamGrads()], example_inputs=(x,))
    dbg(x).sum().backward()
    fixed = fxdebug.instrument(dbg, [SwapActivation(only_dead=0.0)], example_inputs=(x,))
    fixed.reset()
    model.zero_grad(set_to_none=True)
    fixed(x).sum().backward()
    row = fixed.report().row("layer1_0_conv1")
    assert row["param_grad_calls"] == 1
    assert row["param_grad_max_abs"] == pytest.approx(float(model.layer1[0].conv1.weight.grad.abs().max()), rel=1e-6)
