"""Issue 35 B6: example inputs that alias (Hugging Face's ``labels=input_ids``) stay aliased when
``instrument()`` clones them, so the capture on them is the graph the user's own calls reuse."""

from __future__ import annotations

import subprocess
import sys

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


def test_inputs_loaded_by_torch_load_clone_twice(tmp_path) -> None:
    # a copy-on-write clone (torch._lazy_clone) of a tensor torch.load made crashed the process (SIGSEGV) at
    # the next clone's storage read: the CLI's `check --data batches.pt` died in instrument(). Plain clones only.
    torch.save([torch.randn(2, 4)], tmp_path / "b.pt")
    code = ("import torch; from fxdebug.graph.inputs import clone_inputs; "
            f"(x,) = torch.load({str(tmp_path / 'b.pt')!r}); (a,) = clone_inputs((x,)); (b,) = clone_inputs((a,)); "
            "assert torch.equal(b, x) and b.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])
