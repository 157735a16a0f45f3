"""InplaceCheck: in-place writes into tensors saved for backward, named before backward runs."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import InplaceCheck
from zoo import ZOO


class SigmoidMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        y = torch.sigmoid(self.fc(x))
        y.mul_(2)
        return self.out(y)


class ConvReluInplace(nn.Module):
    """relu_ after a conv: the conv saved its input and weight, not its output — no conflict."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.act = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3)

    def forward(self, x):
        h = self.conv(x)
        h.relu_()
        return self.act(self.conv2(h)).sum(dim=(2, 3))


class ExpThenInplaceModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(torch.exp(self.fc(x)))


class ExpThenSetitem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        y = torch.tanh(self.fc(x))
        y[:, 0] = 0.0
        return y * 3


def _plain_backward_fails(model: nn.Module, x: torch.Tensor) -> bool:
    try:
        model(x).sum().backward()
    except RuntimeError as exc:
        assert "modified by an inplace operation" in str(exc)
        return True
    finally:
        model.zero_grad(set_to_none=True)
    return False


def test_sigmoid_mul_named_before_backward():
    torch.manual_seed(0)
    model, x = SigmoidMul(), torch.randn(4, 8)
    assert _plain_backward_fails(model, x)  # the bug is real: plain autograd fails in backward
    check = InplaceCheck()
    dbg = fxdebug.instrument(model, [check], example_inputs=(x,))
    graphs = [part.graph for part in dbg.parts().values()]  # one for a snapshot capture; Dynamo's captures
    for g in graphs:
        g.lint()
    assert [(f.saved_by, f.modified_by, f.tensor) for f in check.findings] == [("sigmoid", "mul_", "its output")]
    finding = check.findings[0]
    assert "torch.sigmoid(self.fc(x))" in finding.saved_by_line and "y.mul_(2)" in finding.modified_by_line
    guards = [n for g in graphs for n in g.nodes if fxdebug.authoring.fx_meta(n).get("role") == "guard"]
    assert len(guards) == 1 and guards[0].next.name == "mul_"
    with pytest.raises(fxdebug.InplaceError) as info:
        dbg(x)
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, fxdebug.FxDebugError)
    assert err.node == "mul_" and err.saved_by == "sigmoid"
    assert "sigmoid" in str(err) and "mul_" in str(err) and ".mul(...)" in str(err) and "clone()" in str(err)
    assert model.fc.weight.grad is None  # raised in the forward, nothing ran backward
    restored = pickle.loads(pickle.dumps(err))
    assert type(restored) is fxdebug.InplaceError and restored.saved_by == "sigmoid" and restored.node == "mul_"
    assert any("mul_" in n for n in dbg.report().notes)


def test_free_and_bitwise_when_grad_is_off():
    torch.manual_seed(0)
    model, x = SigmoidMul(), torch.randn(4, 8)
    dbg = fxdebug.instrument(model, [InplaceCheck()], example_inputs=(x,))
    with torch.no_grad():
        assert torch.equal(dbg(x), model(x))
    with torch.inference_mode():
        assert torch.equal(dbg(x), model(x))


def test_no_alarm_when_nothing_is_recorded():
    """Frozen parameters and an input without grad: autograd saves nothing, the guard stays quiet."""
    torch.manual_seed(0)
    model, x = SigmoidMul(), torch.randn(4, 8)
    dbg = fxdebug.instrument(model, [InplaceCheck()], example_inputs=(x,))
    for p in model.parameters():
        p.requires_grad_(False)
    assert torch.equal(dbg(x), model(x))


def test_relu_inplace_after_conv_is_fine():
    torch.manual_seed(0)
    model, x = ConvReluInplace(), torch.randn(2, 3, 9, 9)
    assert not _plain_backward_fails(model, x)
    check = InplaceCheck()
    dbg = fxdebug.instrument(model, [check], example_inputs=(x,))
    assert check.findings == []
    assert dbg.parts() and not any(fxdebug.authoring.fx_meta(n).get("role") == "guard"
                                   for part in dbg.parts().values() for n in part.graph.nodes)
    y = dbg(x)
    assert torch.equal(y, model(x))
    y.sum().backward()
    assert model.conv.weight.grad is not None


@pytest.mark.parametrize("cls, line, saver, fix", [
    (ExpThenInplaceModule, "act", "exp", "inplace=False"),
    (ExpThenSetitem, "y[:, 0] = 0.0", "tanh", "clone()"),
])
def test_inplace_module_and_index_assignment(cls, line, saver, fix):
    torch.manual_seed(0)
    model, x = cls(), torch.randn(3, 6)
    assert _plain_backward_fails(model, x)
    check = InplaceCheck()
    dbg = fxdebug.instrument(model, [check], example_inputs=(x,))
    assert [f.saved_by for f in check.findings] == [saver]
    modifier = check.findings[0].modified_by
    assert fix in check.findings[0].fix
    assert modifier == line or line in check.findings[0].modified_by_line
    with pytest.raises(fxdebug.InplaceError, match=modifier):
        dbg(x)
    with torch.no_grad():
        assert torch.equal(dbg(x), model(x))


class ExpPlusEquals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.exp(self.fc(x))
        y += 1
        return y


def test_augmented_assignment_under_export():
    """`y += 1` stays in place in export graphs (aten.add_), where InplaceCheck names it."""
    torch.manual_seed(0)
    model, x = ExpPlusEquals(), torch.randn(2, 4)
    assert _plain_backward_fails(model, x)
    check = InplaceCheck()
    dbg = fxdebug.instrument(model, [check], example_inputs=(x,), frontend="export")
    (finding,) = check.findings
    assert (finding.saved_by, finding.modified_by) == ("exp", "add_") and "y += 1" in finding.modified_by_line
    assert "out-of-place add" in finding.fix
    with pytest.raises(fxdebug.InplaceError, match="add_"):
        dbg(x)


def test_where_limits_guards_not_findings():
    torch.manual_seed(0)
    model, x = SigmoidMul(), torch.randn(4, 8)
    check = InplaceCheck(where="out*")
    dbg = fxdebug.instrument(model, [check], example_inputs=(x,))
    assert len(check.findings) == 1
    dbg(x)  # no guard on mul_, so the forward runs (and backward would fail as in plain torch)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_agrees_with_autograd(name):
    """Every zoo model: a finding exactly when plain autograd fails in backward; outputs bitwise."""
    model, inputs = ZOO[name]()
    x = inputs[0]
    out = model(*inputs)
    fails = False
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    try:
        sum(t.float().sum() for t in leaves).backward()
    except RuntimeError:
        fails = True
    model.zero_grad(set_to_none=True)
    check = InplaceCheck()
    dbg = fxdebug.instrument(model, [check], example_inputs=inputs)
    assert bool(check.findings) == fails, [str(f) for f in check.findings]
    with torch.no_grad():  # same seed for both: some zoo models use dropout
        torch.manual_seed(1)
        got = dbg(*inputs)
        torch.manual_seed(1)
        torch.testing.assert_close(got, model(*inputs), rtol=0, atol=0)
    del x
