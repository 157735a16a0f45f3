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


def test_live_module_holds_the_model_by_composition() -> None:
    """Not a GraphModule: its parts are; ``code`` / ``print_readable()`` are the one part's; the state is the model's."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(torch.randn(2, 4),))
    assert isinstance(dbg, fxdebug.Instrumented) and isinstance(dbg, nn.Module)
    assert not isinstance(dbg, torch.fx.GraphModule)
    (part,) = dbg.parts().values()
    assert isinstance(part, torch.fx.GraphModule)
    assert dbg.code == part.code and "linear" in dbg.code
    assert dbg.print_readable(print_output=False) == part.print_readable(print_output=False)
    assert list(dbg.state_dict()) == list(model.state_dict())
    assert dict(dbg.named_parameters())["0.weight"] is model[0].weight
    broken = fxdebug.instrument(_Breaks(), [StatCollector()], example_inputs=(torch.randn(2, 4),))
    with pytest.raises(UsageError, match=r"dbg\.code: .*2 graphs"):
        broken.code
    x = torch.randn(3, 4)
    assert torch.equal(dbg(x), model(x)) and dbg.report().calls == 1


def test_model_names_the_model_unless_it_has_its_own_model() -> None:
    """``dbg.model`` is the model; a model with its own ``model`` submodule (Hugging Face's
    ``LlamaForCausalLM.model``) keeps that face, as every other attribute of the model."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x).relu()

    plain = nn.Linear(4, 4)
    assert fxdebug.instrument(plain, [StatCollector()], frontend="dynamo").model is plain
    outer = Outer()
    dbg = fxdebug.instrument(outer, [StatCollector()], example_inputs=(torch.randn(2, 4),))
    assert dbg.model is outer.model


def test_each_live_module_has_a_class_of_its_own() -> None:
    """The face may add the model's class as a further base of the module's class: never another module's."""

    class WithMethod(nn.Linear):
        def scaled(self, x: torch.Tensor) -> torch.Tensor:
            return self(x) * 2

    a = fxdebug.instrument(WithMethod(4, 4), [StatCollector()], example_inputs=(torch.randn(2, 4),))
    b = fxdebug.instrument(nn.Linear(4, 4), [StatCollector()], example_inputs=(torch.randn(2, 4),))
    assert type(a) is not type(b) and type(a).__name__ == "WithMethod"
    assert a.scaled(torch.ones(1, 4)).shape == (1, 4) and a.report().calls == 1  # the instrumented call ran
    assert not hasattr(b, "scaled")
