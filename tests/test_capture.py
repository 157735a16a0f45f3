"""Capture: activations and gradients of chosen nodes; the Grad-CAM doc runs and agrees with a
hand-written forward/backward-hook implementation."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import fxdebug
from fxdebug.passes import Capture
from zoo import ZOO

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "gradcam.md"


def _doc_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1
    return blocks[0]


def hook_gradcam(model, x, layer):
    """Grad-CAM the way tutorials write it: a forward hook and a backward hook on ``layer``."""
    kept = {}
    h1 = layer.register_forward_hook(lambda m, i, o: kept.__setitem__("a", o.detach()))
    h2 = layer.register_full_backward_hook(lambda m, gi, go: kept.__setitem__("g", go[0].detach()))
    try:
        scores = model(x)
        scores[torch.arange(len(x)), scores.argmax(1)].sum().backward()
    finally:
        h1.remove()
        h2.remove()
    weights = kept["g"].mean(dim=(2, 3), keepdim=True)
    cam = F.relu((weights * kept["a"]).sum(dim=1, keepdim=True))
    cam = F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)
    return cam / cam.amax(dim=(2, 3), keepdim=True).clamp_min(1e-12)


def test_gradcam_doc_matches_hand_written_hooks():
    code = _doc_code()
    assert len([ln for ln in code.strip().splitlines() if ln.strip()]) <= 15
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    model = scope["model"]
    assert not model._forward_hooks and not model.layer2._forward_hooks  # nothing left on the model
    model.zero_grad()
    want = hook_gradcam(model, scope["x"], model.layer2)
    assert scope["heatmap"].shape == (2, 1, 16, 16)
    assert scope["heatmap"].amax() > 0
    torch.testing.assert_close(scope["heatmap"], want)


def test_capture_by_node_name_glob_and_last_call_only():
    model, (x,) = ZOO["functional_ops"]()
    cap = Capture(["conv", "relu", "cat*"])
    dbg = fxdebug.instrument(model, [cap], example_inputs=(x,))
    dbg(x)
    x2 = torch.randn_like(x)
    dbg(x2)
    torch.testing.assert_close(cap["conv"], model.conv(x2))
    torch.testing.assert_close(cap["relu"], F.relu(model.conv(x2)))
    assert cap["cat"].shape == (2, 8, 8, 8)
    assert set(cap.activations) == {"conv", "relu", "cat"}
    with pytest.raises(fxdebug.UsageError, match="grads=True"):
        cap.grad("conv")
    assert dbg.report()["conv"]["captured"] == (2, 8, 8, 8)
    dbg.reset()
    assert cap["conv"] is None


def test_capture_clones_values_later_changed_in_place():
    model, (x,) = ZOO["inplace_ops"]()
    cap = Capture(["fc1", "fc2"], grads=True)
    dbg = fxdebug.instrument(model, [cap], example_inputs=(x,))
    dbg(x).sum().backward()
    torch.testing.assert_close(cap["fc1"], model.fc1(x))
    assert cap.grad("fc2").shape == (3, 8)


def test_unknown_name_is_a_usage_error():
    model, (x,) = ZOO["functional_ops"]()
    with pytest.raises(fxdebug.UsageError, match="'nope' matches no tensor-valued node"):
        fxdebug.instrument(model, [Capture("nope")], example_inputs=(x,))


def test_where_limits_the_nodes_a_capture_may_match():
    model, (x,) = ZOO["residual_cnn"]()
    everything_in_layer1 = Capture(where="layer1")
    stem_only = Capture(["stem.2", "*_0"], where="stem")
    dbg = fxdebug.instrument(model, [everything_in_layer1, stem_only], example_inputs=(x,))
    dbg(x)
    by_name = {n.name: n for part in dbg.parts().values() for n in part.graph.nodes}
    layer1 = list(everything_in_layer1.activations)
    assert len(layer1) > 10 and all(fxdebug.authoring.module_path(by_name[n]).startswith("layer1.") for n in layer1)
    # "*_0" alone would also match layer2_0_downsample_0; where="stem" keeps the stem's conv
    assert set(stem_only.activations) == {"stem.2", "stem_0"}
    torch.testing.assert_close(stem_only["stem.2"], model.stem(x))
    torch.testing.assert_close(everything_in_layer1[layer1[-1]], model.layer1(model.stem(x)))
    with pytest.raises(fxdebug.UsageError, match="where="):
        Capture()


class _Broken(torch.nn.Module):
    """Two linears with a graph break between them: the live capture hands over two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(x)


def test_named_requests_over_a_live_capture_of_several_graphs():
    # each graph ran the pass on its own and raised for the request that is in the other one ('b' is not in the
    # first graph): every live capture with a graph break (or regional blocks) refused Capture by name
    torch.manual_seed(0)
    model, x = _Broken(), torch.randn(2, 4)
    cap = Capture(["a", "b", "relu*"], grads=True)
    dbg = fxdebug.instrument(model, [cap], example_inputs=(x,), frontend="dynamo")
    assert len(dbg.parts()) == 2
    dbg(x).sum().backward()
    hidden = torch.relu(model.a(x))
    assert torch.equal(cap["a"], model.a(x)) and torch.equal(cap["relu"], hidden)
    assert torch.equal(cap["b"], model.b(hidden))
    assert torch.equal(cap.grad("b"), torch.ones(2, 3))
    with pytest.raises(fxdebug.UsageError, match="'nope' matches no tensor-valued node or module in any of the "
                                                 "capture's 2 graph"):
        fxdebug.instrument(_Broken(), [Capture(["a", "nope"])], example_inputs=(x,), frontend="dynamo")
