"""SwapActivation: every ReLU form is caught, only negative pre-activations change, nothing else is touched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdebug
from fxdebug.passes import StatCollector, SwapActivation
from zoo import ZOO



FORMS = ["module", "module_inplace", "F", "F_inplace", "torch", "torch_", "method", "method_"]


class AllForms(nn.Module):
    """One linear branch per ReLU form, concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(6, 5) for _ in FORMS)
        self.relu = nn.ReLU()
        self.relu_inplace = nn.ReLU(inplace=True)

    def pre(self, x):
        return [lin(x) for lin in self.lins]

    def forward(self, x):
        p = self.pre(x)
        outs = [self.relu(p[0]), self.relu_inplace(p[1]), F.relu(p[2]), F.relu(p[3], inplace=True),
                torch.relu(p[4]), torch.relu_(p[5]), p[6].relu(), p[7].relu_()]
        return torch.cat(outs, dim=1)


def _nodes(dbg):
    """``(graph, node)`` of every captured graph: the live default's parts (a recompile adds one), a snapshot's one."""
    return [(part, n) for part in dbg.parts().values() for n in part.graph.nodes]


def _lint(dbg):
    for part in dbg.parts().values():
        part.graph.lint()


def test_every_relu_form_is_swapped_and_only_negatives_change():
    model, x = AllForms(), torch.randn(7, 6)
    dbg = fxdebug.instrument(model, [SwapActivation(negative_slope=0.1)], example_inputs=(x,))
    assert not any(fxdebug.authoring.is_relu(n, part) for part, n in _nodes(dbg))
    assert len(dbg.pass_results[0].replaced) == len(FORMS)
    with torch.no_grad():
        pre = torch.cat(model.pre(x), dim=1)
        out, ref = dbg(x), model(x)
    torch.testing.assert_close(out, F.leaky_relu(pre, 0.1))
    assert torch.equal(out[pre >= 0], ref[pre >= 0])
    assert (out[pre < 0] != ref[pre < 0]).all()
    assert not any(fxdebug.authoring.is_relu(n, part) for part, n in _nodes(dbg))  # the no_grad call's graph too
    _lint(dbg)


def test_nothing_else_is_touched_and_model_is_not_mutated():
    model, (x,) = ZOO["residual_cnn"]()
    before = fxdebug.trace(model, (x,))
    others = [(n.name, n.op, str(n.target)) for n in before.graph.nodes if not fxdebug.authoring.is_relu(n, before)]
    # the subject is the snapshot graph's nodes beside the symbolic trace's (the live capture's are Dynamo's)
    dbg = fxdebug.instrument(model, [SwapActivation()], example_inputs=(x,), frontend="symbolic")
    after = {(n.name, n.op, str(n.target)) for n in dbg.graph.nodes}
    assert set(others) <= after
    assert isinstance(model.layer1[0].relu, nn.ReLU) and isinstance(model.stem[2], nn.ReLU)
    swapped = [n for n in dbg.graph.nodes if "swap-activation" in fxdebug.authoring.node_meta(n).transforms]
    assert len(swapped) == 9
    meta = fxdebug.authoring.fx_meta(swapped[0])
    assert meta["changed_by"] == ["swap-activation"] and meta["transforms"]["swap-activation"]["to"] == "LeakyReLU"
    assert meta["module"] == "stem.2"


def _inplace_reference(model, x, act):
    h = model.fc1(x) + x
    h = act(h)  # h.relu_() activates h in place; fc2 sees the activated h
    g = model.fc2(h) * 0.5
    g = act(g)
    return act(g - 0.1)


@pytest.mark.parametrize("to", [None, nn.GELU])
def test_inplace_semantics_are_kept(to):
    model, (x,) = ZOO["inplace_ops"]()
    dbg = fxdebug.instrument(model, [SwapActivation(to=to)], example_inputs=(x,))
    act = nn.GELU() if to else nn.LeakyReLU(0.01)
    with torch.no_grad():
        torch.testing.assert_close(dbg(x.clone()), _inplace_reference(model, x, act))
    assert not any(fxdebug.authoring.is_relu(n, part) for part, n in _nodes(dbg))


def test_to_factory_replaces_with_any_activation():
    model, (x,) = ZOO["control_flow"]()
    dbg = fxdebug.instrument(model, [SwapActivation(to=lambda: nn.ELU(0.5))], example_inputs=(x,))
    mods = {type(fxdebug.authoring.get_module(part, n)) for part, n in _nodes(dbg)
            if n.op == "call_module" and "swap-activation" in fxdebug.authoring.node_meta(n).transforms}
    assert mods == {nn.ELU}


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 6)
        self.act_a, self.act_b = nn.ReLU(), nn.ReLU()
        with torch.no_grad():
            self.b.bias[:4] = -100.0  # 4 of 6 channels after act_b never fire

    def forward(self, x):
        return self.act_b(self.b(self.act_a(self.a(x))))


def test_only_dead_swaps_where_the_report_saw_dead_channels():
    model, x = TwoLayers(), torch.randn(32, 4)
    observed = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    observed(x)
    report = observed.report()
    assert report.row("act_b")["dead_frac"] >= 4 / 6 and report.row("act_a")["dead_frac"] < 0.5
    via_prior = fxdebug.instrument(observed, [SwapActivation(only_dead=0.5)], example_inputs=(x,))
    via_arg = fxdebug.instrument(model, [SwapActivation(only_dead=0.5, report=report)], example_inputs=(x,))
    for dbg in (via_prior, via_arg):
        assert list(dbg.pass_results[-1].replaced) == ["act_b"]
        assert any("dead fraction" in n for n in dbg.pass_results[-1].notes)


def test_only_dead_without_a_report_says_what_to_do():
    model, x = TwoLayers(), torch.randn(4, 4)
    with pytest.raises(fxdebug.PassError, match="StatCollector"):
        fxdebug.instrument(model, [SwapActivation(only_dead=0.5)], example_inputs=(x,))
    with pytest.raises(fxdebug.UsageError):
        SwapActivation(only_dead=2.0)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_runs_and_matches_leaky_reference_where_no_relu(name):
    model, inputs = ZOO[name]()
    dbg = fxdebug.instrument(model, [SwapActivation()], example_inputs=inputs)
    _lint(dbg)
    relus = [n for n in fxdebug.trace(model, inputs).graph.nodes if fxdebug.authoring.is_relu(n)]
    swapped = [r for part in dbg.parts().values() for r in fxdebug.authoring.graph_record(part).passes
               if r.pass_name == "swap-activation"]  # one record per captured graph
    assert sum(len(r.replaced) for r in swapped) == len(relus)
    if not relus:
        model.eval(), dbg.eval()
        with torch.no_grad():
            a, b = dbg(*inputs), model(*inputs)
        torch.testing.assert_close(a, b)
