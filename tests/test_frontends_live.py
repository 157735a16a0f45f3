"""The explicit frontends (symbolic, export, subtrees) follow the live model, or refuse clearly.

Issue 23, part B: each test builds a construct a real workflow meets after ``instrument()`` (a
checkpoint loaded, a buffer counter, a hook, a replaced head, ``model.train()``, another keyword
signature) and asserts the instrumented module computes what the model computes at that moment,
or raises a typed fxdebug error naming the construct. ``instrument()`` itself leaves no trace on
the user's global state.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import fxdebug
from fxdebug.errors import FxDebugError, TraceError
from fxdebug.passes import NaNCheck, StatCollector

FRONTENDS = ("symbolic", "export", "subtrees")


def passes() -> list[fxdebug.Pass]:
    return [NaNCheck(), StatCollector()]


# -- 1. instrument() never touches the user's global state ------------------------------------------
class Drawing(nn.Module):
    """Draws from every random stream a forward can reach and appends to its own containers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gen = torch.Generator().manual_seed(3)
        self.np_gen = np.random.default_rng(5)
        self.seen: list[int] = []
        self.by_call: dict[int, float] = {}

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(len(self.seen))
        self.by_call[len(self.by_call)] = random.random() + float(np.random.rand()) + float(self.np_gen.random())
        noise = torch.rand(x.shape, generator=self.gen) if not torch.fx._symbolic_trace.is_fx_tracing() else 0
        return self.fc(x) + noise + torch.rand(x.shape)


def _streams(model: Drawing) -> tuple[Any, ...]:
    return (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone(),
            model.gen.get_state().clone(), model.np_gen.bit_generator.state)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_instrument_leaves_every_random_stream_and_container_as_it_was(frontend: str) -> None:
    model = Drawing()
    x = torch.randn(2, 4)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    before = _streams(model)
    try:
        fxdebug.instrument(model, passes(), x, frontend=frontend)
    except TraceError:
        pass  # a frontend may refuse the construct; it must still leave no trace
    after = _streams(model)
    assert after[0] == before[0], "Python's random stream moved"
    assert (after[1] == before[1]).all(), "numpy's global stream moved"
    assert torch.equal(after[2], before[2]), "torch's global stream moved"
    assert torch.equal(after[3], before[3]), "the model's torch.Generator moved"
    assert after[4] == before[4], "the model's numpy Generator moved"
    assert model.seen == [] and model.by_call == {}, "instrument() appended to the model's containers"


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_instrument_does_not_materialize_a_lazy_module(frontend: str) -> None:
    model = nn.Sequential(nn.LazyLinear(3), nn.ReLU())
    with pytest.raises(TraceError, match=r"'0' \(LazyLinear\).*lazy module.*Run the model once"):
        fxdebug.instrument(model, passes(), torch.randn(2, 4), frontend=frontend)
    assert isinstance(model[0], nn.LazyLinear), "instrument() materialized the lazy module on the model"
    model(torch.randn(2, 4))  # once run, it instruments like any module
    dbg = fxdebug.instrument(model, passes(), torch.randn(2, 4), frontend=frontend)
    x = torch.randn(2, 4)
    assert torch.equal(dbg(x), model(x))


# -- 2. symbolic: buffers are inputs, not constants -------------------------------------------------
class FrozenBN(nn.Module):
    """torchvision's FrozenBatchNorm2d: arithmetic over buffers in forward."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(n))
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def forward(self, x: Tensor) -> Tensor:
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale + bias


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = FrozenBN()

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.fc(x))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        self.step.add_(1)
        return self.fc(x) * self.step


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("make", [Backbone, FrozenBN], ids=["submodule", "root"])
def test_arithmetic_over_buffers_follows_load_state_dict(frontend: str, make: Any) -> None:
    model = make()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
    torch.manual_seed(1)
    model.load_state_dict({k: torch.rand_like(v) + 0.5 for k, v in model.state_dict().items()})
    torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_buffer_counter_counts_every_call(frontend: str) -> None:
    model = Counter()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
    assert model.step.item() == 0, "instrument() advanced the counter"
    outs = [dbg(x) for _ in range(3)]
    assert model.step.item() == 3
    base = model.fc(x).detach()
    for i, out in enumerate(outs, start=1):
        torch.testing.assert_close(out, base * i, rtol=0, atol=0)
