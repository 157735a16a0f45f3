"""Live capture: the instrumented module is the model as it is at every call (issue 23).

Each test changes the model after ``instrument()`` the way real workflows do, and checks on the
default frontend that the instrumented run equals a plain copy of the model — outputs, parameter
gradients and buffers — at every call.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from zoo import GraphBreakPair

FRONTEND: dict = {"frontend": "dynamo"}


def _passes():
    return [NaNCheck(mode="record"), StatCollector()]


def _same(dbg, ref, dbg_model, *args, **kwargs):
    for m in (dbg_model, ref):
        m.zero_grad(set_to_none=True)
    out, want = dbg(*args, **kwargs), ref(*args, **kwargs)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)  # bitwise
    if out.requires_grad and torch.isfinite(out).all():
        out.sum().backward()
        want.sum().backward()
        for (name, p), q in zip(dbg_model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(dbg_model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), name
    return out


def _pair(model, *example, **kw):
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, _passes(), example_inputs=example if example else None, **FRONTEND)
    return dbg, ref


class FrozenBN(nn.Module):
    """torchvision's FrozenBatchNorm2d: arithmetic over buffers in forward."""

    def __init__(self, n):
        super().__init__()
        for name, init in (("weight", torch.ones), ("bias", torch.zeros), ("running_mean", torch.zeros),
                           ("running_var", torch.ones)):
            self.register_buffer(name, init(n))

    def forward(self, x):
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale + bias


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = FrozenBN(8)
        self.head = nn.Linear(8, 3)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.scale_up = False

    def forward(self, x, labels=None):
        self.step.add_(1)
        h = torch.relu(self.bn(self.fc(x)))
        if self.training:
            h = h * 2
        if self.scale_up:
            h = h * 10
        if torch.is_grad_enabled():
            h = h + 1
        if x.shape[0] > 8:
            h = h - 1
        out = self.head(h)
        if labels is not None:
            out = out + labels
        return out


def test_buffer_arithmetic_follows_load_state_dict():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 4)
    dbg, ref = _pair(model, x)
    _same(dbg, ref, model, x)
    state = copy.deepcopy(model.state_dict())
    state["bn.running_var"] = torch.rand(8) * 10
    state["bn.running_mean"] = torch.randn(8)
    model.load_state_dict(state)
    ref.load_state_dict(state)
    _same(dbg, ref, model, x)


def test_buffer_counter_counts_every_call_and_not_instrument():
    model, x = Net(), torch.randn(2, 4)
    dbg, ref = _pair(model, x)
    assert int(model.step) == 0  # instrument() itself ran no step
    for _ in range(3):
        _same(dbg, ref, model, x)
    assert int(model.step) == 3 == int(ref.step)


def test_replaced_submodule_runs():
    model, x = Net(), torch.randn(2, 4)
    dbg, ref = _pair(model, x)
    _same(dbg, ref, model, x)
    model.head = nn.Linear(8, 3)
    ref.head = copy.deepcopy(model.head)
    _same(dbg, ref, model, x)
    model.head = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))
    ref.head = copy.deepcopy(model.head)
    _same(dbg, ref, model, x)
    assert any(r["module"].startswith("head.") for r in dbg.report().rows)


def test_train_on_the_model_is_seen():
    model, x = Net().eval(), torch.randn(2, 4)
    dbg, ref = _pair(model, x)
    _same(dbg, ref, model, x)
    model.train()
    ref.train()
    _same(dbg, ref, model, x)
    model.eval()
    ref.eval()
    _same(dbg, ref, model, x)


def test_config_attribute_flip_is_seen():
    model, x = Net(), torch.randn(2, 4)
    dbg, ref = _pair(model, x)
    _same(dbg, ref, model, x)
    model.scale_up = ref.scale_up = True
    _same(dbg, ref, model, x)


def test_hook_added_after_instrument_runs():
    model, x = Net(), torch.randn(2, 4)
    dbg, ref = _pair(model, x)
    _same(dbg, ref, model, x)
    for m in (model, ref):
        m.fc.register_forward_hook(lambda mod, inp, out: out * 3)
    out = _same(dbg, ref, model, x)
    unhooked = copy.deepcopy(ref)
    unhooked.fc._forward_hooks.clear()
    assert not torch.equal(out, unhooked(x))  # the hook changed the output, and the live module ran it


def test_grad_mode_branch():
    model, x = Net(), torch.randn(2, 4)
    dbg, ref = _pair(model, x)
    _same(dbg, ref, model, x)
    with torch.no_grad():
        _same(dbg, ref, model, x)


def test_dynamic_dim_branch():
    model = Net()
    dbg, ref = _pair(model, torch.randn(2, 4))
    for n in (2, 12, 3, 16):
        _same(dbg, ref, model, torch.randn(n, 4))


def test_kwargs_signature_change_is_reported():
    model, x = Net(), torch.randn(2, 4)
    dbg, ref = _pair(model, x)
    _same(dbg, ref, model, x, labels=torch.randn(2, 3))
    _same(dbg, ref, model, x)
    _same(dbg, ref, model, x, labels=torch.full((2, 3), float("nan")))
    report = dbg.report()
    assert report.calls == 3
    assert all(r["calls"] > 0 for r in report.rows)
    assert report.row("fc")["calls"] == 3  # one row over every capture
    assert report.first_nonfinite == "labels"  # the NaN input of the third call, in its own capture
    assert any("recompile" in n for n in report.notes)


def test_report_has_module_paths_and_call_counts():
    model, x = Net(), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, _passes(), example_inputs=(x,), **FRONTEND)
    for _ in range(2):
        dbg(x)
    rows = {r["node"]: r for r in dbg.report().rows}
    assert rows["fc"]["module"] == "fc" and rows["head"]["module"] == "head"
    assert rows["fc"]["calls"] == 2


def test_graph_break_code_is_named_as_eager():
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            print("", end="")  # a graph break
            return self.b(x)

    model, x = Breaks(), torch.randn(2, 4)
    dbg, ref = _pair(model, x)
    _same(dbg, ref, model, x)
    report = dbg.report()
    assert {"a", "b"} <= {r["node"] for r in report.rows}
    assert len(dbg.parts()) == 2
    assert any("graph break" in n and "eagerly" in n for n in report.notes)


def test_first_nonfinite_is_first_in_time_across_captures():
    # graph A runs three calls, the third with a NaN input; graph B (labels=) runs later with a NaN:
    # each graph counts its own calls (B's first is its call 0), the report orders them in time
    model, x = Net(), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, _passes(), example_inputs=(x,), **FRONTEND)
    dbg(x)
    dbg(x)
    dbg(torch.full((2, 4), float("nan")))
    dbg(x, labels=torch.full((2, 3), float("nan")))
    report = dbg.report()
    assert report.first_nonfinite == "x"
    assert report.row("x")["nonfinite_first_call"] == 2 and report.row("labels")["nonfinite_first_call"] == 3


def test_verify_runs_on_a_live_module_and_leaves_its_report_alone():
    model = Net()
    x = torch.randn(4, 4)
    dbg = fxdebug.instrument(model, _passes(), example_inputs=(x,), **FRONTEND)
    dbg(x)
    before = {r["node"]: r["calls"] for r in dbg.report().rows}
    parts = list(dbg.parts())
    model.head = nn.Linear(8, 3)  # changed after instrument: verify compares against the model as it is now
    result = fxdebug.verify(dbg, (x,))  # was an ArgumentTypeError: no mode-switch record on a live module
    assert result.ok, result.mismatches
    assert result.compared > 0
    assert list(dbg.parts()) == parts  # the eval-mode graph verify captured is dropped again
    assert {r["node"]: r["calls"] for r in dbg.report().rows} == before
    assert dbg.report().calls == 1


def test_the_dynamo_column_of_docs_faithful():
    # docs/faithful.md's "dynamo" column, checked: instrument() leaves RNG and containers alone; Python/numpy draws,
    # a parametrization added later, a root full backward hook, a submodule hook set before are kept; dbg.modules()
    # are the model's own
    import random

    import numpy as np
    import torch.nn.utils.parametrize as parametrize

    class Draw(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.items = nn.Linear(4, 4), []

        def forward(self, x):
            self.items.append(1)
            return self.fc(x) * random.random() + float(np.random.rand())

    x = torch.randn(2, 4)
    model = Draw()
    random.seed(0)
    np.random.seed(0)
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,), frontend="dynamo")
    assert random.getstate() == state[0] and (np.random.get_state()[1] == state[1]).all()
    assert torch.equal(torch.get_rng_state(), state[2]) and model.items == []
    outs = []
    for seed in (5, 5, 6):
        random.seed(seed)
        np.random.seed(seed)
        outs.append((dbg if len(outs) != 1 else model)(x))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])  # drawn at every call, as the model

    class Sym(nn.Module):
        def forward(self, w):
            return (w + w.T) / 2

    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    seq[2].register_forward_hook(lambda m, i, o: o * 2)  # before instrument
    dbg = fxdebug.instrument(seq, [NaNCheck()], example_inputs=(x,), frontend="dynamo")
    assert any(m is seq[1] for m in dbg.modules())
    parametrize.register_parametrization(seq[0], "weight", Sym())  # after instrument
    seen = []
    seq.register_full_backward_hook(lambda m, gi, go: seen.append(gi[0].clone()))
    xi, xj = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = dbg(xi)
    assert torch.equal(out, seq(x))
    out.sum().backward()
    seq(xj).sum().backward()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1]) and torch.equal(xi.grad, xj.grad)


def test_a_graph_no_pass_observes_adds_no_rows_beside_observed_ones():
    # with where= selecting nodes of one graph, the other graphs (after a graph break, other block regions) listed
    # every node as a row of None: a report of 'layer1.0' rows only held the whole model's

    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(GraphBreakPair(), [StatCollector(where="b")], example_inputs=(x,), frontend="dynamo")
    dbg(x)
    assert len(dbg.parts()) == 2
    assert [r["module"] for r in dbg.report().rows] == ["b"] and dbg.report().rows[0]["calls"] == 1
    plain = fxdebug.instrument(GraphBreakPair(), [], example_inputs=(x,), frontend="dynamo")
    assert {"a", "b"} <= {r["module"] for r in plain.report().rows}  # nothing observed: the nodes are listed


def test_pass_results_of_a_capture_in_two_graphs_cover_both() -> None:
    """``dbg.pass_results`` says what each pass did over every graph: after a graph break it listed the first graph's
    nodes alone. The picture of the two graphs joins ``b`` to the ``relu`` of the first graph that fed it."""
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(GraphBreakPair(), [StatCollector()], example_inputs=(x,), frontend="dynamo")
    parts = list(dbg.parts().values())
    assert len(parts) == 2
    (result,) = dbg.pass_results
    assert result.added == ["fxdebug_obs_a", "fxdebug_obs_relu", "fxdebug_obs_b", "fxdebug_obs_tanh"]  # (before batching)
    fed = dbg._live_state.feeds
    assert len(fed) == 1 and next(iter(fed.values())) in {n.name for n in parts[0].graph.nodes}
