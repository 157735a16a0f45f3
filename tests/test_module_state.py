"""``graph.module_state.ModuleState``: the one walk that ``untouched_state`` / ``preserved_state`` make
saves exactly what the per-kind helpers save, and a forward that changes everything leaves no trace."""

from __future__ import annotations

import random

import torch
from torch import nn

from fxdebug.graph.inputs import preserved_state, untouched_state
from fxdebug.graph.module_state import ModuleState, _generators, saved_containers, saved_plain_state


class _Messy(nn.Module):
    """A forward that touches every kind of state a capture must put back."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.a, self.b = shared, shared  # one module under two names: saved once
        self.calls, self.tag, self.cache, self.seen = 0, "x", [1], {"k": 1}
        self.gen = torch.Generator().manual_seed(3)
        self.rng = random.Random(5)
        self.register_buffer("avg", torch.zeros(2))
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.tag = None
        self.cache.append(2)
        self.seen["k"] = 2
        self.avg = self.avg + 1  # rebinds the buffer slot
        self.steps.add_(1)  # writes into the buffer
        noise = torch.rand(2, generator=self.gen) + self.rng.random() + random.random() + torch.rand(2)
        return self.a(x) + self.b(x) + noise


def _model() -> _Messy:
    torch.manual_seed(0)
    random.seed(0)
    return _Messy(nn.Linear(2, 2))


def test_one_walk_saves_what_the_helpers_save() -> None:
    model = _model()
    state = ModuleState(model, buffers=True)
    assert [(m, v) for m, v in state.plain] == saved_plain_state(model)
    assert [(id(a), b) for a, b in state.containers] == [(id(a), b) for a, b in saved_containers(model)]
    assert [id(g) for g, _ in state.streams[2:]] == [id(g) for g in _generators(model)]  # after Python's, numpy's
    assert [id(b) for b, _ in state.buffers] == [id(b) for b in model.buffers()]  # each buffer once
    assert [m for m, _ in state.slots] == list(model.modules())


def test_a_forward_that_changes_everything_leaves_no_trace() -> None:
    x = torch.randn(1, 2, generator=torch.Generator().manual_seed(1))
    expected = _model()(x)  # what a fresh model's first call computes
    model = _model()
    avg, steps, cache, seen = model.avg, model.steps.clone(), model.cache, model.seen
    streams = (random.getstate(), torch.get_rng_state(), model.gen.get_state(), model.rng.getstate())
    for context in (untouched_state, preserved_state):
        with context(model):
            model(x)
        assert (model.calls, model.tag, model.cache, model.seen) == (0, "x", [1], {"k": 1})
        assert model.cache is cache and model.seen is seen  # the same objects, put back in place
        assert random.getstate() == streams[0] and torch.equal(torch.get_rng_state(), streams[1])
        assert torch.equal(model.gen.get_state(), streams[2]) and model.rng.getstate() == streams[3]
        if context is preserved_state:
            assert model.avg is avg and torch.equal(model.steps, steps)
        else:  # untouched_state leaves buffers to the caller: the rebound slot and the write stay
            assert model.avg is not avg and not torch.equal(model.steps, steps)
            model._buffers["avg"] = avg
            model.steps.copy_(steps)
    torch.testing.assert_close(model(x), expected)  # the model computes what it would have computed
