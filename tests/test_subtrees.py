"""Per-subtree capture: a detector-like root that neither FX nor torch.export can capture."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.out = nn.Linear(4, 5)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        g = f.mean((2, 3))
        return self.out(torch.softmax(self.attn(g), -1) * g)


class Gate(nn.Module):
    """Untraceable by both frontends on its own: it branches on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if float(y.sum()) > 1e9:
            return y * 0
        return y


class Detector(nn.Module):
    """Loops over a list of images and keeps a data-dependent number of boxes."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.head = Head()
        self.gate = Gate()
        self.unused = nn.Linear(2, 2)
        self.register_buffer("threshold", torch.tensor(-10.0))

    def forward(self, images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        feats = torch.cat([self.backbone(im[None]) for im in images])
        scores = self.gate(self.head(feats))
        keep = scores[:, 0] > self.threshold
        boxes = scores[keep]
        if boxes.shape[0] == 0:
            boxes = scores[:0]
        return {"boxes": boxes, "scores": scores}


def _images() -> list[torch.Tensor]:
    return [torch.randn(3, 6, 6) for _ in range(3)]


def test_auto_falls_back_to_subtrees_and_reports_coverage() -> None:
    model, images = Detector().eval(), _images()
    keys = list(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # where the snapshot chain (symbolic, export) fails, subtrees: this file's subject, pinned whatever "auto" means
    # (docs/frontends.md's Detector example runs the chain itself)
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], example_inputs=(images,),
                             frontend="subtrees")
    info = dbg.trace_info
    assert info.frontend == "subtrees"
    assert info.captured == {"backbone": "symbolic", "head": "symbolic", "gate.proj": "symbolic"}
    assert set(info.eager_modules) == {"", "gate", "unused"}
    assert "cannot trace" in info.eager_modules["gate"] or "gate" in info.eager_modules["gate"].lower()
    assert info.eager_modules["unused"] == "not called with the example inputs"
    total = sum(p.numel() for p in model.parameters())
    assert info.coverage["parameters"] == pytest.approx((total - 6) / total)
    assert 0.3 < info.coverage["ops"] < 1.0
    ref, out = model(images), dbg(images)
    assert torch.equal(out["scores"], ref["scores"]) and torch.equal(out["boxes"], ref["boxes"])
    assert list(dbg.state_dict()) == keys
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.backbone) is Backbone and type(model.gate.proj) is nn.Linear, "the model was modified"
    own = dict(model.named_parameters())
    assert all(p is own[k] for k, p in dbg.named_parameters())
    report = dbg.report()
    assert report.frontend == "subtrees" and report.ok
    assert any("of parameters" in n and "of executed ops" in n for n in report.notes)
    assert any(n.startswith("subtrees: gate stays eager") for n in report.notes)
    assert {r["module"] for r in report.rows} >= {"backbone.conv", "head.attn", "gate.proj"}


def test_nan_is_located_in_a_captured_part() -> None:
    model, images = Detector().eval(), _images()
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(images,), frontend="subtrees")  # rows `part/node`
    with torch.no_grad():
        model.head.attn.bias[1] = float("nan")
    dbg(images)
    report = dbg.report()
    assert report.first_nonfinite == "head/attn"
    assert report[report.first_nonfinite]["module"] == "head.attn"


def test_deepcopy_and_save() -> None:
    model, images = Detector().eval(), _images()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(images,), frontend="subtrees")
    ref = model(images)["scores"]
    clone = copy.deepcopy(dbg)
    assert clone.head.attn.weight is not model.head.attn.weight
    assert torch.equal(clone(images)["scores"], ref)
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(images)["scores"], ref)
    assert loaded.trace_info.frontend == "subtrees"


def test_training_updates_the_models_parameters() -> None:
    model, images = Detector().train(), _images()
    dbg = fxdebug.trace(model, (images,), frontend="subtrees")
    dbg(images)["scores"].sum().backward()
    assert model.head.out.weight.grad is not None
    assert int(model.backbone.bn.num_batches_tracked) == 3  # the model's own buffer, one call per image


def test_subtrees_needs_example_inputs() -> None:
    with pytest.raises(fxdebug.MissingInputsError, match="none were given: pass example_inputs"):
        fxdebug.trace(Detector(), frontend="subtrees")
