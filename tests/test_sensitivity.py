"""``fxdebug.sensitivity``: per-layer change under weight noise, weights restored exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdebug
from zoo import ZOO


class _Gated(nn.Module):
    """``dead`` feeds the output multiplied by zero: its weights cannot matter."""

    def __init__(self) -> None:
        super().__init__()
        self.live = nn.Linear(6, 4)
        self.dead = nn.Linear(6, 4)

    def forward(self, x):
        return self.live(x) + 0.0 * self.dead(x)


def test_weights_buffers_and_mode_are_restored_bitwise():
    model, (x,) = ZOO["residual_cnn"]()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = fxdebug.sensitivity(model, (x,), noise=0.05)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and model.training
    assert [r["module"] for r in result.rows] == [n for n, m in model.named_modules()
                                                  if n and any(True for _ in m.parameters(recurse=False))]
    assert all(r["change"] > 0 for r in result.rows) and max(r["share"] for r in result.rows) == 1.0


def test_a_layer_that_cannot_matter_scores_zero_and_the_table_ranks():
    torch.manual_seed(0)
    model = _Gated()
    result = fxdebug.sensitivity(model, torch.randn(5, 6))
    assert result["dead"]["change"] == 0.0 and result["live"]["change"] > 0
    assert result.ranked()[0]["module"] == "live"
    lines = str(result).splitlines()
    assert lines[0].startswith("sensitivity — relative output change") and lines[3].startswith("live")


def test_noise_scales_the_change_and_draws_are_seeded():
    model, (x,) = ZOO["transformer_block"]()
    small = fxdebug.sensitivity(model, (x,), noise=1e-3, modules=["mlp.0"])
    big = fxdebug.sensitivity(model, (x,), noise=1e-2, modules=["mlp.0"])
    assert big["mlp.0"]["change"] == pytest.approx(10 * small["mlp.0"]["change"], rel=0.05)  # linear for small noise
    assert fxdebug.sensitivity(model, (x,), modules=["mlp.0"]).rows == fxdebug.sensitivity(model, (x,), modules=["mlp.0"]).rows


def test_loss_sensitivity_and_errors():
    model, (x,) = ZOO["residual_cnn"]()
    target = torch.tensor([1, 2])
    result = fxdebug.sensitivity(model, (x,), loss_fn=lambda out, inputs: F.cross_entropy(out, target))
    with torch.no_grad():
        expected = float(F.cross_entropy(model.eval()(x), target))
    assert result.metric == "loss" and result.baseline == pytest.approx(expected)
    with pytest.raises(fxdebug.UsageError, match="own no parameters"):
        fxdebug.sensitivity(model, (x,), modules=["pool"])
    with pytest.raises(fxdebug.UsageError, match="positive"):
        fxdebug.sensitivity(model, (x,), noise=0)


def test_svg_colours_the_most_sensitive_modules(tmp_path):
    torch.manual_seed(0)
    model = _Gated()
    result = fxdebug.sensitivity(model, torch.randn(5, 6))
    path = result.render(str(tmp_path / "sens.svg"))
    from pathlib import Path

    text = Path(path).read_text()
    assert "<svg" in text and "hot: sensitivity 1" in text  # live: the most sensitive, a hot spot
    assert text.count("hot: sensitivity") == 1  # dead: share 0


@pytest.mark.parametrize("frontend", ["export", "dynamo"])
def test_shares_land_on_modules_called_as_functions(frontend):
    """Export and Dynamo graphs call a Linear as torch.linear: the share still lands on the module's output."""
    from fxdebug.numerics.sensitivity import _ShareAnnotation

    torch.manual_seed(0)
    model, x = _Gated(), torch.randn(5, 6)
    dbg = fxdebug.instrument(model, [_ShareAnnotation({"live": 1.0, "dead": 0.0})], example_inputs=(x,),
                             frontend=frontend)
    dbg(x)
    assert {r["module"]: r["sensitivity"] for r in dbg.report().rows if r.get("sensitivity") is not None} == \
        {"live": 1.0, "dead": 0.0}
