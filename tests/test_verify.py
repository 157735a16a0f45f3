"""``fxdebug.verify`` and ``instrument(..., verify=True)``: equal when faithful, the first node when not,
and the model, the RNG and every gradient exactly as they were afterwards."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fxdebug
from fxdebug.capture.faithful import apply_function
from fxdebug.passes import NaNCheck, StatCollector, SwapActivation
from test_faithful import ModeBranches, Regions, WithFunctions


class Counting(ModeBranches):
    """Mode branches, batch-norm statistics and a Python counter in a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.tail = _Tail()

    def forward(self, x: Tensor) -> Tensor:
        return self.tail(super().forward(x))


class _Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("frontend", ("symbolic", "export", "subtrees"))
def test_verify_passes_and_restores_everything(frontend: str) -> None:
    model = Counting().eval()
    x = torch.randn(5, 8)
    opts = {"frontend": frontend} if frontend != "export" else {"frontend": "subtrees"}
    if frontend == "export":  # the counter keeps export away from the root; its parts are exported
        model = ModeBranches().eval()
        opts = {"frontend": "export"}
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector(grads=True)], example_inputs=(x,), **opts)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = copy.deepcopy(model.state_dict())
    grads = [p.grad for p in model.parameters()]
    rng = torch.get_rng_state()
    calls = getattr(getattr(model, "tail", None), "calls", None)
    result = fxdebug.verify(dbg, (x,))
    assert result.ok, str(result)
    assert result.modes == ("train", "eval") and result.compared > 10
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is g and torch.equal(g, torch.full_like(g, 0.5)) for p, g in zip(model.parameters(), grads))
    assert not model.training and not dbg.training and not model.bn.training
    assert getattr(getattr(model, "tail", None), "calls", None) == calls
    assert dbg.report().calls == 0, "verify's runs are not the user's statistics"


def test_verify_names_the_node_where_gradients_part() -> None:
    """The pre-fix symbolic capture, rebuilt by hand: the Function's forward inlined, its backward lost."""
    model = WithFunctions()
    x = torch.randn(3, 4)
    dbg = fxdebug.trace(model, (x,), frontend="symbolic")
    node = next(n for n in dbg.graph.nodes if n.target is apply_function and "WrongSin" in n.args[0])
    with dbg.graph.inserting_before(node):
        inlined = dbg.graph.call_function(torch.sin, (node.args[1],))
    node.replace_all_uses_with(inlined)
    dbg.graph.erase_node(node)
    dbg.recompile()
    result = fxdebug.verify(dbg, (x,))
    assert not result.ok
    assert any("gradient of 'a.weight' differs" in m for m in result.mismatches)
    assert not any("output" in m for m in result.mismatches), "the forward is the same"
    assert result.first_node == "a" and "sin" in (result.where or "")
    with pytest.raises(fxdebug.VerificationError) as info:
        result.raise_if_failed()
    assert info.value.node == "a" and isinstance(info.value, AssertionError)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.b = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.act(self.a(x)))


def test_instrument_verify_refuses_a_transform_that_changes_the_numbers() -> None:
    model = Gated()
    x = torch.randn(6, 4)
    assert fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,), verify=True) is not None
    with pytest.raises(fxdebug.VerificationError, match="output 0 differs"):  # the live default (Dynamo)
        fxdebug.instrument(model, [SwapActivation(negative_slope=0.3)], example_inputs=(x,), verify=True)
    # naming the node where the runs part reads one whole graph: a snapshot's (the live capture's is not located yet)
    with pytest.raises(fxdebug.VerificationError, match="output 0 differs") as info:
        fxdebug.instrument(model, [SwapActivation(negative_slope=0.3)], example_inputs=(x,), verify=True,
                           frontend="symbolic")
    assert info.value.node is not None and "act" in info.value.message
    loose = fxdebug.verify(fxdebug.instrument(model, [SwapActivation(negative_slope=0.3)], example_inputs=(x,)),
                           (x,), rtol=10.0, atol=10.0)
    assert loose.ok


@pytest.mark.parametrize("model", [Regions(), ModeBranches()], ids=["regions", "mode-branches"])
def test_verify_in_one_mode(model: nn.Module) -> None:
    x = torch.randn(4, 8) if isinstance(model, ModeBranches) else torch.randn(4, 4)
    dbg = fxdebug.instrument(model.train(), [NaNCheck()], example_inputs=(x,))
    result = fxdebug.verify(dbg, x, modes=("train",))
    assert result.ok and result.modes == ("train",)


def test_verify_needs_an_fxdebug_module() -> None:
    with pytest.raises(fxdebug.UsageError, match="made by fxdebug"):
        fxdebug.verify(nn.Linear(2, 2), torch.randn(1, 2))


def test_dropout_functional_in_both_modes_verified() -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return F.dropout(self.a(x), 0.3, training=self.training)

    model = Drop().eval()
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(torch.randn(8, 4),), frontend="symbolic")
    assert fxdebug.verify(dbg, torch.randn(8, 4)).ok


# -- issue 23: input gradients, numpy/Python random streams, modes switched on the model ---------------
class _NegateGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:  # type: ignore[override]
        return -g


def _negate_grad(x: Tensor) -> Tensor:
    return _NegateGrad.apply(x)


def test_verify_compares_input_gradients() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, [StatCollector()], x, frontend="symbolic")
    assert fxdebug.verify(dbg, x), "faithful before the edit"
    # identity forward, negated gradient on the input only: outputs and parameter gradients stay equal
    graph = dbg.graph
    ph = next(n for n in graph.nodes if n.op == "placeholder")
    with graph.inserting_after(ph):
        neg = graph.call_function(_negate_grad, (ph,))
    ph.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)
    dbg.recompile()
    result = fxdebug.verify(dbg, x)
    assert not result
    assert any("gradient of 'input 0' differs" in m for m in result.mismatches), result.mismatches


class _DrawsNumpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        import random

        import numpy as np

        return self.lin(x) * float(np.random.rand()) + random.random()


def test_verify_forks_numpy_and_python_random_streams() -> None:
    import random

    import numpy as np

    model = nn.Sequential(_DrawsNumpy())
    x = torch.randn(3, 4)
    np.random.seed(0)
    random.seed(0)
    np_before, py_before = np.random.get_state()[1].copy(), random.getstate()
    dbg = fxdebug.instrument(model, [StatCollector()], x, frontend="subtrees")  # the drawing root stays eager
    result = fxdebug.verify(dbg, x)
    assert result, result.mismatches  # both runs draw the same numbers: no false alarm
    assert (np.random.get_state()[1] == np_before).all() and random.getstate() == py_before
    # symbolic tracing no longer folds the draw into a constant: the drawing module stays eager (issue 34)
    kept = fxdebug.instrument(model, [StatCollector()], x, frontend="symbolic")
    assert "0" in kept.trace_info.auto_leaves and "random" in str(kept.trace_info.auto_leaves["0"])
    np.random.rand()  # the stream moves on, and the module draws from it at every call
    assert fxdebug.verify(kept, x)


def test_verify_switches_modes_on_the_model_and_the_instrumented_module_follows() -> None:
    model = Counting().eval()
    x = torch.randn(4, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], x, frontend="symbolic")
    result = fxdebug.verify(dbg, x)
    assert result, result.mismatches
    assert not model.training and not dbg.training
    twin = copy.deepcopy(model).train()
    model.train()  # as a Trainer does; dbg is not told
    torch.manual_seed(0)
    got = dbg(x)
    torch.manual_seed(0)
    torch.testing.assert_close(got, twin(x), rtol=0, atol=0)
    assert fxdebug.verify(dbg, x, modes=("train",))
