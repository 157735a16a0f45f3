"""NaNCheck: the reported NaN/Inf origin is right for every node of real models, forward and
backward; raise mode names the node, its counts and its inputs' ranges."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck
from zoo import ZOO

PROOF_MODELS = ["residual_cnn", "transformer_block", "functional_ops", "inplace_ops", "shared_module",
                "tuple_outputs", "lstm"]


def poison(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its first element replaced by NaN (works for any strides and for 0-d tensors)."""
    mask = torch.zeros_like(x)
    mask[(0,) * x.dim()] = math.nan
    return x + mask


class NaNGrad(torch.autograd.Function):
    """Identity forward; its backward returns NaN: a gradient that goes bad at a known point."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, math.nan)


def nan_grad(x: torch.Tensor) -> torch.Tensor:
    return NaNGrad.apply(x)


def float_outputs(y):
    if isinstance(y, torch.Tensor):
        return [y] if y.is_floating_point() else []
    if isinstance(y, dict):
        y = list(y.values())
    return [t for v in y for t in float_outputs(v)]


def _insert(dbg: fxdebug.Instrumented, node, fn, *, include_observer: bool):
    with dbg.graph.inserting_after(node):
        new = dbg.graph.call_function(fn, (node,))
    def watches(u) -> bool:  # an observation of `node`: its own op call, or a batched call holding it
        meta = fxdebug.authoring.fx_meta(u)
        return meta.get("observes") == node.name or any(o == node.name for o, _ in meta.get("batch", ()))

    node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new and (include_observer or not watches(u)))
    dbg.recompile()
    return new


def _remove(dbg: fxdebug.Instrumented, node, new) -> None:
    new.replace_all_uses_with(node)
    dbg.graph.erase_node(new)
    dbg.recompile()
    dbg.reset()


@pytest.mark.parametrize("name", PROOF_MODELS)
def test_forward_origin_is_each_injected_node(name):
    model, inputs = ZOO[name]()
    # the proof edits the captured graph (a poison node after each target): a snapshot graph by subject; under
    # the live frontend a guard (no_grad) recaptures from the model and the edit would not be run
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=inputs, frontend="symbolic")
    dbg(*inputs)
    assert dbg.report().first_nonfinite is None
    nodes = {n.name: n for n in dbg.graph.nodes}
    observed = [r["node"] for r in dbg.report().rows]
    assert len(observed) >= 4
    for target in observed:
        dbg.reset()
        node = nodes[target]
        new = _insert(dbg, node, poison, include_observer=True)
        with torch.no_grad():
            dbg(*inputs)
        report = dbg.report()
        assert report.first_nonfinite == target, (name, target, report.nonfinite_nodes)
        assert report[target]["nonfinite_calls"] == 1
        _remove(dbg, node, new)


@pytest.mark.parametrize("name", PROOF_MODELS)
def test_backward_origin_is_each_injected_node(name):
    model, inputs = ZOO[name]()
    # edits the captured graph, as above: a snapshot graph by subject
    dbg = fxdebug.instrument(model, [NaNCheck(backward=True)], example_inputs=inputs, frontend="symbolic")
    sum(t.sum() for t in float_outputs(dbg(*inputs))).backward()
    clean = dbg.report()
    assert clean.first_nonfinite_grad is None and clean.ok
    nodes = {n.name: n for n in dbg.graph.nodes}
    # In-place nodes such as `h.relu_()` whose value is read through `h` have no users of their
    # own: an injection after them would change nothing, so they are not targets.
    with_grads = [r["node"] for r in clean.rows if r.get("grad_nonfinite_calls") == 0
                  and any(not fxdebug.authoring.is_instrumentation(u) for u in nodes[r["node"]].users)]
    assert len(with_grads) >= 3
    for target in with_grads:
        dbg.reset()
        model.zero_grad()
        node = nodes[target]
        new = _insert(dbg, node, nan_grad, include_observer=False)
        sum(t.sum() for t in float_outputs(dbg(*inputs))).backward()
        report = dbg.report()
        assert report.first_nonfinite is None
        assert report.first_nonfinite_grad == target, (name, target)
        assert report[target]["grad_nonfinite_first_call"] == 0
        _remove(dbg, node, new)


class LogHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.log(h).sum(-1)


def _log_model():
    torch.manual_seed(0)
    model = LogHead()
    with torch.no_grad():
        model.fc.weight.copy_(torch.eye(4))
        model.fc.bias.zero_()
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, -0.3, 2.0, 0.5]])
    return model, x


def test_record_mode_names_log_with_counts_and_keeps_running():
    model, x = _log_model()
    dbg = fxdebug.instrument(model, [NaNCheck(counts=True)], example_inputs=(x.abs(),))
    good = dbg(x.abs())
    bad = dbg(x)
    torch.testing.assert_close(bad, model(x), equal_nan=True)
    assert torch.isfinite(good).all()
    report = dbg.report()
    assert report.first_nonfinite == "log"
    row = report["log"]
    assert row["nonfinite_first_call"] == 1 and row["nonfinite_calls"] == 1 and row["nan"] == 1 and row["inf"] == 0
    assert report["fc"]["nonfinite_calls"] == 0
    assert report["sum_1"]["nonfinite_calls"] == 1 and report["sum_1"]["nonfinite_first_call"] == 1
    assert "NaN/Inf origin (forward): 'log'" in str(report)


def test_raise_mode_message():
    model, x = _log_model()
    dbg = fxdebug.instrument(model, [NaNCheck(mode="raise")], example_inputs=(x.abs(),))
    dbg(x.abs())
    with pytest.raises(fxdebug.NonFiniteError) as info:
        dbg(x)
    err = info.value
    assert (err.node, err.op) == ("log", "torch.log")
    assert isinstance(err, FloatingPointError)
    msg = str(err)
    assert "node 'log'" in msg and "1 NaN and 0 Inf of 8 values" in msg
    assert "'fc' (2, 4): min -0.3, max 4" in msg and "inputs were finite" in msg
    assert "test_nan_check.py" in msg and "torch.log(h)" in msg


def test_raise_mode_blames_non_finite_weights():
    model, x = _log_model()
    dbg = fxdebug.instrument(model, [NaNCheck(mode="raise")], example_inputs=(x.abs(),))
    with torch.no_grad():
        model.fc.weight[0, 0] = math.inf
    with pytest.raises(fxdebug.NonFiniteError, match=r"node 'fc'.*parameter\(s\) fc.weight are not finite"):
        dbg(x.abs())


class SqrtModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return torch.sqrt(torch.relu(self.fc(x))).sum()


def test_backward_sqrt_at_zero_reports_entry_and_producer():
    torch.manual_seed(0)
    model = SqrtModel()
    x = torch.randn(4, 3)
    dbg = fxdebug.instrument(model, [NaNCheck(backward=True)], example_inputs=(x,))
    dbg(x).backward()
    report = dbg.report()
    assert report.first_nonfinite is None
    assert report.first_nonfinite_grad == "relu"
    assert report.nonfinite_grad_from == ["sqrt"]
    assert "from the backward of sqrt" in str(report)


def test_backward_raise_mode_names_users():
    torch.manual_seed(0)
    model = SqrtModel()
    x = torch.randn(4, 3)
    dbg = fxdebug.instrument(model, [NaNCheck(mode="raise", backward=True)], example_inputs=(x,))
    loss = dbg(x)
    with pytest.raises(fxdebug.NonFiniteError, match=r"gradient flowing back into the output of node 'relu'.*user\(s\) 'sqrt'"):
        loss.backward()


def test_fold_over_many_calls_and_where():
    model, x = _log_model()
    dbg = fxdebug.instrument(model, [NaNCheck(where="fc")], example_inputs=(x,))
    assert [r["node"] for r in dbg.report().rows] == ["fc"]
    for i in range(150):
        dbg(x if i != 97 else x * math.inf)
    row = dbg.report()["fc"]
    assert row["nonfinite_calls"] == 1 and row["nonfinite_first_call"] == 97
    assert dbg.report().first_nonfinite == "fc"


def test_bad_mode_is_a_usage_error():
    with pytest.raises(fxdebug.UsageError, match="mode is 'record'"):
        NaNCheck(mode="loud")
