"""fxdebug.gradcheck: custom ops' backwards checked per node on their captured inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import StatCollector


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * x


class WrongSquare(Square):
    @staticmethod
    def backward(ctx, g):  # forgot the factor 2
        (x,) = ctx.saved_tensors
        return g * x


class FirstOrderOnlySquare(Square):
    @staticmethod
    def backward(ctx, g):  # right value, but detached: second derivatives come out zero
        (x,) = ctx.saved_tensors
        return 2 * g * x.detach()


class Net(nn.Module):
    def __init__(self, fn: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.fn = fn
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.fn.apply(self.fc(x)))


class WrongLeaf(nn.Module):
    """A user module (kept as a leaf) whose forward applies the wrong Function."""

    def forward(self, x):
        return WrongSquare.apply(x) + 1


class TwoCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.leaf = WrongLeaf()

    def forward(self, x):
        h = self.fc(x)
        return Square.apply(h) + self.leaf(h)


def _x():
    torch.manual_seed(0)
    return torch.randn(2, 4)


def test_wrong_backward_is_named_and_right_one_passes():
    x = _x()
    good = fxdebug.gradcheck(fxdebug.instrument(Net(Square), [StatCollector()], example_inputs=(x,)), example_inputs=(x,))
    assert good.ok and [r.op for r in good.rows] == ["Square.apply"]
    assert good.rows[0].max_diff < 1e-6
    bad = fxdebug.gradcheck(fxdebug.trace(Net(WrongSquare), (x,)), example_inputs=(x,))
    assert not bad.ok
    (row,) = bad.failures
    assert row.op == "WrongSquare.apply" and row.order == 1
    assert row.max_diff > 0.1
    text = str(bad)
    assert "FAILED (gradcheck)" in text and row.node in text and "1 of 1 nodes fail" in text


def test_max_diff_is_the_jacobian_difference():
    """WrongSquare's Jacobian is diag(h) where diag(2h) is right: the largest difference is max |h|."""
    x = _x()
    model = Net(WrongSquare)
    result = fxdebug.gradcheck(fxdebug.trace(model, (x,)), example_inputs=(x,))
    with torch.no_grad():
        h = model.fc(x).double()
    assert result.failures[0].max_diff == pytest.approx(float(h.abs().max()), rel=1e-4)


def test_leaf_module_and_default_selection():
    x = _x()
    dbg = fxdebug.trace(TwoCustom(), (x,), leaf_modules=[WrongLeaf])
    result = fxdebug.gradcheck(dbg, example_inputs=(x,))
    by_op = {r.op: r for r in result.rows}
    assert set(by_op) == {"Square.apply", "WrongLeaf"}  # torch's own Linear and add are not selected
    assert by_op["Square.apply"].passed and by_op["WrongLeaf"].passed is False
    assert [r.node for r in result.failures] == ["leaf"]


def test_where_selects_standard_ops_with_parameters():
    x = _x()
    dbg = fxdebug.trace(Net(Square), (x,))
    result = fxdebug.gradcheck(dbg, "head", example_inputs=(x,), double=True)
    assert [r.node for r in result.rows] == ["head"] and result.ok


def test_double_backward():
    x = _x()
    dbg = fxdebug.trace(Net(FirstOrderOnlySquare), (x,))
    assert fxdebug.gradcheck(dbg, example_inputs=(x,)).ok
    second = fxdebug.gradcheck(dbg, example_inputs=(x,), double=True)
    (row,) = second.failures
    assert row.order == 2 and row.max_diff > 0.1 and "gradgradcheck" in str(second)
    assert fxdebug.gradcheck(fxdebug.trace(Net(Square), (x,)), example_inputs=(x,), double=True).ok


def test_defaults_to_the_instrumented_example_inputs():
    x = _x()
    dbg = fxdebug.instrument(Net(WrongSquare), [StatCollector()], example_inputs=(x,))
    result = fxdebug.gradcheck(dbg)
    assert [r.op for r in result.failures] == ["WrongSquare.apply"]


def test_needs_inputs_and_a_graph_module():
    with pytest.raises(fxdebug.UsageError, match="example_inputs"):
        fxdebug.gradcheck(fxdebug.trace(Net(Square)))
    with pytest.raises(fxdebug.UsageError, match="instrumented"):
        fxdebug.gradcheck(Net(Square), example_inputs=(_x(),))
