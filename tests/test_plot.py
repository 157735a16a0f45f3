"""``fxdebug.plot.gradient_flow`` / ``activations``: the files and the data they draw."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxdebug
from fxdebug.report.findings import FindingRules
from fxdebug.passes import ParamGrads, StatCollector
from zoo import ZOO

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def report():
    model, (x,) = ZOO["residual_cnn"]()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(2)]
    dbg = fxdebug.instrument(model, [StatCollector(grads=True), ParamGrads()], example_inputs=(x,), frontend="symbolic")
    return fxdebug.collect(dbg, batches, loss_fn=lambda out, b: F.cross_entropy(out, b[1]), progress=False)


def test_gradient_flow_png_draws_the_report_numbers(report, tmp_path):
    plot = fxdebug.plot.gradient_flow(report, tmp_path / "flow.png")
    data = (tmp_path / "flow.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    modules = [r for r in report.rows if r.get("param_grad_max_abs") is not None]
    assert plot.nodes == [r["node"] for r in modules]  # execution order, one bar pair per module with parameters
    assert plot.series["max_abs"] == [r["param_grad_max_abs"] for r in modules]
    ax = plot.figure.axes[0]
    bars = [p.get_height() for p in ax.patches]
    assert bars[: len(modules)] == pytest.approx(plot.series["max_abs"])  # max bars, then mean bars
    assert bars[len(modules): 2 * len(modules)] == pytest.approx(plot.series["mean_abs"])
    assert ax.get_yscale() == "log"
    assert plot.bands["vanishing"][1] == FindingRules.vanishing and plot.bands["exploding"][0] == FindingRules.exploding
    assert [t.get_text() for t in ax.get_xticklabels()][0] == "stem.0"  # node stem_0: the module says it all


def test_gradient_flow_svg_of_activation_gradients_and_custom_bands(tmp_path):
    model, (x,) = ZOO["transformer_block"]()
    dbg = fxdebug.instrument(model, [StatCollector(grads=True)], example_inputs=(x,))
    report = fxdebug.collect(dbg, [x, x], loss_fn=lambda out, b: out.pow(2).mean(), progress=False)
    plot = fxdebug.plot.gradient_flow(report, tmp_path / "flow.svg", vanishing=1e-4, exploding=10.0)
    text = (tmp_path / "flow.svg").read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and "vanishing (&lt; 1e-04)" in text
    assert "gradients of node outputs" in plot.title
    row = report.row(plot.nodes[0])
    assert plot.series["max_abs"][0] == max(abs(row["grad_min"]), abs(row["grad_max"]))


def test_activations_plot_ranges_and_dead_fractions(report, tmp_path):
    plot = fxdebug.plot.activations(report, tmp_path / "acts.svg")
    assert (tmp_path / "acts.svg").read_text().count("<svg") == 1
    rows = [r for r in report.rows if r.get("min") is not None]
    assert plot.series["min"] == [r["min"] for r in rows] and plot.series["max"] == [r["max"] for r in rows]
    dead = dict(zip(plot.nodes, plot.series["dead_frac"]))
    assert dead["layer1_0_relu"] == report.row("layer1_0_relu")["dead_frac"] and dead["layer1_0_conv1"] is None
    assert plot.labels[plot.nodes.index("relu")] == "layer1.0 (relu)"  # a functional op: module and node
    ax, ax2 = plot.figure.axes
    assert len(ax2.patches) == sum(d is not None for d in plot.series["dead_frac"])
    segments = ax.collections[0].get_segments()  # the min..max lines
    assert [tuple(s[:, 1]) for s in segments] == [(r["min"], r["max"]) for r in rows]


def test_plots_say_what_is_missing(tmp_path):
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    report = fxdebug.collect(dbg, [x], progress=False)
    with pytest.raises(fxdebug.UsageError, match="ParamGrads"):
        fxdebug.plot.gradient_flow(report, tmp_path / "g.png")
    with pytest.raises(fxdebug.UsageError, match="suffix"):
        fxdebug.plot.activations(report, tmp_path / "a.jpeg")
    with pytest.raises(AttributeError, match="available"):
        fxdebug.plot.histogram  # noqa: B018


def test_gradient_flow_draws_values_below_1e_12_where_they_are(tmp_path):
    """B5: a gradient decaying to 1e-20 was drawn at the 1e-12 floor, hiding the decay."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[2].weight.mul_(1e-9)
        model[3].weight.mul_(1e-9)
    dbg = fxdebug.instrument(model, [ParamGrads()], example_inputs=(torch.randn(2, 4),))
    dbg(torch.randn(2, 4)).sum().backward()
    plot = fxdebug.plot.gradient_flow(dbg.report(), tmp_path / "flow.png")
    tiny = [v for v in plot.series["max_abs"] if v is not None and 0 < v < 1e-12]
    assert tiny, plot.series  # the first layer's gradient went through two 1e-9 weights
    ax = plot.figure.axes[0]
    n = len(plot.nodes)
    bars = [p.get_height() for p in ax.patches][:n]
    assert bars == pytest.approx(plot.series["max_abs"], rel=1e-6, abs=0)
    assert ax.get_ylim()[0] < min(tiny)  # the axis reaches below the smallest value


class _TinyViT(torch.nn.Module):
    """Patch embedding, a class token, then a token MLP: activations are (N, 1 + h*w, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 8, kernel_size=4, stride=4)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, 8))
        self.mlp = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)  # (N, 16, 8)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], dim=1)
        return self.mlp(tokens)


def _images(result):  # type: ignore[no-untyped-def]
    return [im for ax in result.figure.get_axes() for im in ax.get_images()]


def test_feature_maps_lays_vit_tokens_back_on_the_patch_grid(tmp_path):
    """B6: (N, T, C) tokens were drawn as T one-row strips of C 'channels'."""
    from fxdebug.passes import Capture

    torch.manual_seed(0)
    model, x = _TinyViT(), torch.randn(2, 3, 16, 16)
    dbg = fxdebug.instrument(model, [Capture(["mlp"])], example_inputs=(x,), frontend="symbolic")
    out = dbg(x)
    result = fxdebug.plot.feature_maps(dbg, "mlp", tmp_path / "tokens.png")
    assert result.layout == "NTC" and result.channels == 8  # the channels are the last dim
    first = _images(result)[0].get_array().data
    assert first.shape == (4, 4)  # 16 patch tokens on a 4x4 grid, the class token dropped
    torch.testing.assert_close(torch.as_tensor(first), out[0, 1:, 0].detach().reshape(4, 4))


def test_feature_maps_reads_channels_last_maps(tmp_path):
    """B6: Swin-style (N, H, W, C) maps were drawn as H 'channels' of W x C."""
    from fxdebug.passes import Capture

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.LayerNorm(6))
    x = torch.randn(2, 4, 4, 5)
    dbg = fxdebug.instrument(model, [Capture(["1"])], example_inputs=(x,), frontend="symbolic")
    out = dbg(x)
    result = fxdebug.plot.feature_maps(dbg, "1", tmp_path / "swin.png")
    assert result.layout == "NHWC" and result.channels == 6
    images = _images(result)
    assert len(images) == 6 and images[0].get_array().data.shape == (4, 4)
    torch.testing.assert_close(torch.as_tensor(images[5].get_array().data), out[0, :, :, 5].detach())
    # an explicit layout wins over detection
    assert fxdebug.plot.feature_maps(dbg, "1", tmp_path / "as_nchw.png", layout="NCHW").channels == 4


def test_feature_maps_draws_an_activation_only_capture(tmp_path):
    """B6: a Capture without grads=True raised (asking for its gradient) instead of drawing."""
    from fxdebug.passes import Capture

    model, (x,) = ZOO["residual_cnn"]()
    cap = Capture(["layer1"])
    dbg = fxdebug.instrument(model, [cap], example_inputs=(x,), frontend="symbolic")
    dbg(x)
    result = fxdebug.plot.feature_maps(cap, "layer1", tmp_path / "acts.png")
    assert not result.grad and result.channels == 8 and len(_images(result)) == 8
