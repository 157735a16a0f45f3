"""Per-part cost of a live capture (issue 33): the parts of one repeated block share one generated runner code
(``live_parts._RunnerModule``), and nothing that is observed changes: each instance keeps its own rows under its
own module path, outputs equal the plain model's bitwise, and each part's observers are its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.instrumented import live_parts
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector


@pytest.fixture(autouse=True)
def _regions_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXDEBUG_REGIONS", "1")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2, self.out = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc2(self.act(self.fc1(x))))


def _instrumented(n: int) -> tuple[nn.Module, torch.Tensor, fxdebug.Instrumented]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(n)])
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], example_inputs=(x,),
                             frontend="dynamo")
    return model, x, dbg


def test_parts_of_one_block_share_one_generated_code() -> None:
    model, x, dbg = _instrumented(12)
    runs = [found.run for found in dbg._live_state.parts.values()]
    assert len(runs) == 12
    forwards = {type(run.__self__).forward for run in runs}
    assert len(forwards) == 1  # generated once, not per instance
    owners = {id(run.__self__) for run in runs}
    assert len(owners) == 12  # each part still runs its own observers and clock
    slots = [run.__self__.__dict__["_fxdebug_slot0"] for run in runs]
    assert len({id(s) for s in slots}) == 12


def test_rows_and_outputs_per_instance() -> None:
    model, x, dbg = _instrumented(6)
    with torch.no_grad():
        want = model(x)
        got = dbg(x)
    assert torch.equal(got, want)
    rows = {(r["module"], r["op"]): r for r in dbg.report().rows}
    for i in range(6):
        assert (f"{i}.fc1", "torch.linear") in rows and rows[(f"{i}.fc1", "torch.linear")]["calls"] == 1
    # each instance's own statistics, not a shared row
    assert rows[("0.fc1", "torch.linear")]["mean"] != rows[("5.fc1", "torch.linear")]["mean"]


def test_an_unhashable_argument_falls_back_to_its_own_code() -> None:
    key = live_parts._keyed([1], _node_with_arg(torch.tensor(2.0)))  # a constant the key does not describe
    assert key is None
    assert live_parts._keyed([1], _node_with_arg((2, 3))) is not None
    assert live_parts._arg_key(1) != live_parts._arg_key(1.0) != live_parts._arg_key(True)
    assert live_parts._arg_key(0.0) != live_parts._arg_key(-0.0)


def _node_with_arg(arg: object) -> torch.fx.Node:
    graph = torch.fx.Graph()
    x = graph.placeholder("arg0")
    return graph.call_function(torch.reshape, (x, arg))  # type: ignore[arg-type]
