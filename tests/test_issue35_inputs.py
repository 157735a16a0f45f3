"""Issue 35 B6: example inputs that alias (Hugging Face's ``labels=input_ids``) stay aliased when
``instrument()`` clones them, so the capture on them is the graph the user's own calls reuse."""

from __future__ import annotations

import torch
from torch import nn

import fxdebug
from fxdebug.graph.inputs import clone_inputs
from fxdebug.passes import NaNCheck


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) + b


def test_one_tensor_twice_is_one_clone_and_views_stay_views() -> None:
    x = torch.randn(4, 3)
    a, b, tail = clone_inputs((x, x, x[1:]))
    assert a is b and a.data_ptr() != x.data_ptr()
    assert tail.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()  # a view of the same copy
    tail.mul_(2)  # an in-place forward: writes the copy, as it would write the user's x
    assert torch.equal(a[1:], tail) and not torch.equal(x[1:], tail)
    args, kwargs = clone_inputs(((), {"input_ids": x, "labels": x}))
    assert kwargs["input_ids"] is kwargs["labels"]
    w = torch.randn(3, requires_grad=True)
    u, v = clone_inputs([w, w])
    assert u is v and u.grad_fn is not None  # the autograd link kept


def test_two_rows_of_a_large_tensor_are_not_a_copy_of_all_of_it() -> None:
    big = torch.randn(1000, 10)
    first, second = clone_inputs((big[0], big[1]))
    assert first.untyped_storage().nbytes() == 40 and torch.equal(second, big[1])


def test_live_call_with_one_tensor_twice_reuses_the_example_capture() -> None:
    torch.manual_seed(0)
    model = TwoInputs()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x, x))
    assert dbg.trace_info.frontend == "dynamo"
    captured = list(dbg.parts())
    y = dbg(x, x)
    assert list(dbg.parts()) == captured  # no second capture for the duplicate input
    torch.testing.assert_close(y, model(x, x), rtol=0, atol=0)


def test_a_lone_input_is_copied_on_write_only() -> None:
    # issue 35 B16: a big example batch is not held twice while instrument() captures
    x = torch.randn(64, 32)
    (copy,) = clone_inputs((x,))
    if not hasattr(torch._C, "_is_cow_tensor"):
        return
    assert torch._C._is_cow_tensor(copy)  # no memory of its own yet
    copy.mul_(0)  # a forward writing its input in place writes the copy, never the user's tensor
    assert not torch._C._is_cow_tensor(copy) and torch.count_nonzero(x) == x.numel()
