"""``dbg.graph`` of a live (Dynamo) module (issue 32 item 3): the captured graph when there is exactly one,
otherwise a typed error naming ``dbg.parts()`` (it was an empty ``return None`` graph)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.errors import FxDebugError, UsageError
from fxdebug.passes import StatCollector


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y)


def test_graph_is_the_one_captured_graph() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(torch.randn(2, 4),))
    (part,) = dbg.parts().values()
    assert dbg.graph is part.graph
    ops = {getattr(n.target, "__name__", "") for n in dbg.graph.nodes if n.op == "call_function"}
    assert {"linear", "relu"} <= ops  # the model's ops, not an empty graph


def test_graph_of_several_or_no_captures_names_the_parts() -> None:
    dbg = fxdebug.instrument(_Breaks(), [StatCollector()], example_inputs=(torch.randn(2, 4),))
    assert len(dbg.parts()) == 2
    with pytest.raises(UsageError, match=r"2 graphs.*dbg\.parts\(\)") as info:
        dbg.graph
    assert isinstance(info.value, FxDebugError) and all(key in str(info.value) for key in dbg.parts())
    fresh = fxdebug.instrument(nn.Linear(4, 4), [StatCollector()], frontend="dynamo")
    with pytest.raises(UsageError, match="nothing of Linear is captured yet"):
        fresh.graph
