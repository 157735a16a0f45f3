"""GradientCentralize: weight gradients centralised like a hand-written hook, forward unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

import fxdebug
from fxdebug.passes import GradientCentralize
from zoo import ZOO


def _hooked(model):
    """The guides' version: a hook on every conv/linear weight."""
    handles = []
    for m in model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            handles.append(m.weight.register_hook(lambda g: g - g.mean(dim=tuple(range(1, g.dim())), keepdim=True)))
    return handles


@pytest.mark.parametrize("name, frontend", [("residual_cnn", "symbolic"), ("transformer_block", "symbolic"),
                                            ("residual_cnn", "export")])
def test_matches_hand_written_hook(name, frontend):
    model, inputs = ZOO[name]()
    model.eval()
    reference = copy.deepcopy(model)
    handles = _hooked(reference)
    dbg = fxdebug.instrument(model, [GradientCentralize()], example_inputs=inputs, frontend=frontend)
    dbg.graph.lint()
    y, y_ref = dbg(*inputs), reference(*inputs)
    assert torch.equal(y, y_ref)  # forward bitwise unchanged
    y.square().sum().backward()
    y_ref.square().sum().backward()
    ref = dict(reference.named_parameters())
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[k].grad, rtol=1e-6, atol=1e-7)
    weights = [m.weight for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert len(weights) >= 3
    for w in weights:
        assert w.grad.flatten(1).mean(dim=1).abs().max() < 1e-6  # centralised
    for h in handles:
        h.remove()
    assert list(dbg.state_dict()) == list(model.state_dict())


def test_where_and_model_untouched():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [GradientCentralize(where="fc")], example_inputs=(x,))
    (res,) = dbg.pass_results
    assert list(res.replaced) == ["fc"]
    dbg(x).sum().backward()
    assert model.fc.weight.grad.mean(dim=1).abs().max() < 1e-6
    assert model.stem[0].weight.grad.flatten(1).mean(dim=1).abs().max() > 1e-6  # not selected, not centralised
    assert not model.fc.weight._backward_hooks if hasattr(model.fc.weight, "_backward_hooks") else True
    with torch.no_grad():
        assert torch.equal(dbg(x), model(x))
    with pytest.raises(fxdebug.UsageError, match="selects no Conv or Linear"):
        fxdebug.instrument(model, [GradientCentralize(where="pool")], example_inputs=(x,))
