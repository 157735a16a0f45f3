"""Augmented assignment under symbolic tracing: ``y += 1`` writes into ``y``, as in the model.

Plain FX records it as ``y = y + 1`` (a new tensor), so a write through a view or slice of a
tensor the model returns was silently lost: the instrumented output differed from the model's.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import InplaceCheck, NaNCheck, StatCollector


class SliceWrite(nn.Module):
    """Writes into a slice of an intermediate tensor through ``+=``, then returns the whole tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        head = h[:, :3]
        head *= 2
        head += 1
        return h.tanh()


class NumberAugment(nn.Module):
    """``+=`` on a traced Python number (a size) must still work as plain addition."""

    def forward(self, x):
        n = x.size(1)
        n += 1
        return x * n


@pytest.mark.parametrize("passes", [[], [NaNCheck(), StatCollector()]], ids=["bare", "observed"])
def test_write_through_a_slice_is_kept(passes):
    torch.manual_seed(0)
    model = SliceWrite()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes=passes, example_inputs=(x,), frontend="symbolic")
    targets = [n.target for n in dbg.graph.nodes if n.op == "call_function"]
    assert operator.imul in targets and operator.iadd in targets
    torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)


def test_gradients_through_the_in_place_write_match_the_model():
    torch.manual_seed(0)
    model = SliceWrite()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes=[NaNCheck()], example_inputs=(x,), frontend="symbolic")
    model(x).square().sum().backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    dbg(x).square().sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k], rtol=0, atol=0, msg=k)
    assert fxdebug.verify(dbg, (x,)).ok


def test_augmented_assignment_on_a_number_is_addition():
    x = torch.randn(2, 3)
    dbg = fxdebug.instrument(NumberAugment(), passes=[NaNCheck()], example_inputs=(x,), frontend="symbolic")
    torch.testing.assert_close(dbg(torch.ones(2, 5)), torch.full((2, 5), 6.0), rtol=0, atol=0)


def test_to_module_keeps_an_unread_in_place_write():
    torch.manual_seed(0)
    model = SliceWrite()
    x = torch.randn(3, 4)
    plain = fxdebug.instrument(model, passes=[NaNCheck()], example_inputs=(x,), frontend="symbolic").to_module()
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=0)


class SavedThenAugmented(nn.Module):
    """sigmoid saves its output for backward; ``+=`` then writes into it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.sigmoid(self.fc(x))
        y += 1
        return y


def test_inplace_check_sees_augmented_assignment_under_symbolic_tracing():
    x = torch.randn(4, 4)
    dbg = fxdebug.instrument(SavedThenAugmented(), passes=[InplaceCheck()], example_inputs=(x,),
                             frontend="symbolic")
    with pytest.raises(fxdebug.InplaceError, match="sigmoid") as caught:
        dbg(x)
    assert "iadd" in str(caught.value) or "+=" in str(caught.value)
    with torch.no_grad():  # free when grad is off: the model's own behaviour
        torch.testing.assert_close(dbg(x), SavedThenAugmented.forward(dbg, x), rtol=0, atol=0)
