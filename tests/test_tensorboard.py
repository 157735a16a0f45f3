"""``Report.to_tensorboard``: event files read back with TensorBoard's own reader."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxdebug
from fxdebug.passes import Histograms, ParamGrads, StatCollector
from zoo import ZOO

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402


def _events(path):
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


@pytest.fixture
def run():
    model, (x,) = ZOO["residual_cnn"]()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]
    dbg = fxdebug.instrument(model, [StatCollector(grads=True), ParamGrads(), Histograms(bins=16, grads=True)],
                             example_inputs=(x,))
    report = fxdebug.collect(dbg, batches, loss_fn=lambda out, b: F.cross_entropy(out, b[1]), progress=False)
    return report


def test_scalars_grouped_by_module_path_with_the_report_values(run, tmp_path):
    writer = SummaryWriter(str(tmp_path))
    written = run.to_tensorboard(writer, step=7)
    writer.close()
    acc = _events(tmp_path)
    tags = set(acc.Tags()["scalars"])
    assert written == len(tags) + len(acc.Tags()["histograms"])
    conv = run.row("layer1_0_conv1")
    (ev,) = acc.Scalars("layer1/0/conv1/layer1_0_conv1/mean")
    assert ev.step == 7 and ev.value == pytest.approx(conv["mean"], rel=1e-6, abs=1e-12)
    (ev,) = acc.Scalars("layer1/0/conv1/layer1_0_conv1/max_abs")
    assert ev.value == pytest.approx(max(abs(conv["min"]), abs(conv["max"])), rel=1e-6)
    (ev,) = acc.Scalars("layer1/0/conv1/layer1_0_conv1/param_grad_norm")
    assert ev.value == pytest.approx(conv["param_grad_norm"], rel=1e-6)
    (ev,) = acc.Scalars("fc/fc/grad_norm")
    assert ev.value == pytest.approx(run.row("fc")["grad_norm"], rel=1e-6)
    assert "layer1/0/relu/layer1_0_relu/dead_frac" in tags
    assert "layer1/0/conv1/layer1_0_conv1/dead_frac" not in tags  # only after activations
    assert {t.split("/")[0] for t in tags} >= {"stem", "layer1", "layer2", "pool", "fc"}


def test_histograms_as_collected(run, tmp_path):
    writer = SummaryWriter(str(tmp_path))
    run.to_tensorboard(writer, step=1, prefix="val")
    writer.close()
    acc = _events(tmp_path)
    hist_tags = acc.Tags()["histograms"]
    assert "val/stem/2/stem_2/hist" in hist_tags and "val/stem/2/stem_2/grad_hist" in hist_tags
    (h,) = acc.Histograms("val/stem/2/stem_2/hist")
    value = h.histogram_value
    collected = run.row("stem_2")["hist"]
    assert h.step == 1 and list(value.bucket) == collected["counts"] and value.num == 3 * 4 * 8 * 16 * 16
    assert sum(value.bucket) == value.num and value.min == 0.0  # a ReLU's output
    assert list(value.bucket_limit)[:-1] == pytest.approx(collected["limits"][:-1])


def test_no_histograms_option_and_a_wrong_writer(run, tmp_path):
    writer = SummaryWriter(str(tmp_path))
    run.to_tensorboard(writer, histograms=False)
    writer.close()
    assert _events(tmp_path).Tags()["histograms"] == []
    with pytest.raises(fxdebug.UsageError, match="SummaryWriter"):
        run.to_tensorboard(object())
