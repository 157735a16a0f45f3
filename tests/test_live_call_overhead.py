"""A live module's call after the first sets nothing around itself; Dynamo's settings for a live capture, and the
recorders of skips and graph breaks, are entered only while Dynamo compiles (``live_skips.compile_scope``), and still
take effect then: a recompile at a later call guards on hooks, and a graph break met there is noted."""

from __future__ import annotations

import torch
from torch import nn

import fxdebug
from fxdebug.capture import dynamo_settings
from fxdebug.passes import StatCollector


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.chatty = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.chatty:
            print("", end="")  # a graph break only this branch has
        return self.fc2(h)


def _entered(monkeypatch) -> list[bool]:
    calls: list[bool] = []
    enter = dynamo_settings.dynamo_config.__enter__

    def counted(self):
        calls.append(True)
        return enter(self)

    monkeypatch.setattr(dynamo_settings.dynamo_config, "__enter__", counted)
    return calls


def test_steady_calls_set_no_dynamo_settings(monkeypatch) -> None:
    model = Net()
    x = torch.randn(2, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="dynamo")
    dbg(x)
    entered = _entered(monkeypatch)
    for _ in range(5):
        torch.testing.assert_close(dbg(x), model(x))
    assert entered == []  # every guard held: nothing compiled, nothing set
    dbg(torch.randn(3, 8))  # another shape: Dynamo compiles, with the live capture's settings
    assert entered
    row = next(r for r in dbg.report().rows if r["node"].endswith("fc2"))
    assert row["calls"] == 7  # (instrument()'s example call is not counted)


def test_a_recompile_after_the_first_call_still_guards_on_hooks() -> None:
    model = Net()
    x, y = torch.randn(2, 8), torch.randn(3, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="dynamo")
    dbg(x)
    dbg(y)  # compiled on a later call: its guards must include the hook guards (skip_nnmodule_hook_guards=False)
    seen: list[int] = []
    model.fc1.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    out = dbg(y)
    assert seen == [3]  # the hook added later runs: the guard saw it
    torch.testing.assert_close(out, model.fc2(torch.relu(model.fc1(y))))


def test_a_graph_break_met_at_a_later_call_is_noted() -> None:
    model = Net()
    x = torch.randn(2, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="dynamo")
    dbg(x)
    assert not [n for n in dbg.report().notes if "graph break" in n]
    model.chatty = True  # Dynamo's guard on the attribute fails: it captures again, and breaks at the print
    dbg(x)
    notes = [n for n in dbg.report().notes if "graph break" in n]
    assert notes and "print" in notes[0], dbg.report().notes
