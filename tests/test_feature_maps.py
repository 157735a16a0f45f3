"""fxdebug.plot.feature_maps: grids of captured channels (and their gradients) written to disk."""

from __future__ import annotations

import pytest
import torch

import fxdebug
import fxdebug.plot
from fxdebug.passes import Capture
from zoo import ZOO

pytest.importorskip("matplotlib")


def test_activation_and_gradient_grid(tmp_path):
    model, (x,) = ZOO["residual_cnn"]()
    cap = Capture(["layer1", "stem.0"], grads=True)
    dbg = fxdebug.instrument(model, [cap], example_inputs=(x,))
    dbg(x)[:, 3].sum().backward()
    result = fxdebug.plot.feature_maps(cap, "layer1", tmp_path / "layer1.png")
    assert result.grad and result.channels == 8 and result.shape == (2, 8, 16, 16)
    data = (tmp_path / "layer1.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # both grids drawn: 8 activation images + 8 gradient images
    images = [im for ax in result.figure.get_axes() for im in ax.get_images()]
    assert len(images) == 16
    torch.testing.assert_close(torch.as_tensor(images[0].get_array().data), cap["layer1"][0, 0])


def test_from_instrumented_module_svg_and_channel_cap(tmp_path):
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [Capture(["layer2"])], example_inputs=(x,))
    dbg(x)
    result = fxdebug.plot.feature_maps(dbg, "layer2", tmp_path / "l2.svg", max_channels=5)
    assert not result.grad and result.channels == 5
    assert "<svg" in (tmp_path / "l2.svg").read_text()[:500]
    assert sum(len(ax.get_images()) for ax in result.figure.get_axes()) == 5


def test_errors_name_the_fix(tmp_path):
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [Capture(["layer2"])], example_inputs=(x,))
    with pytest.raises(fxdebug.UsageError, match=r"Capture\(\['fc'\]\)"):
        fxdebug.plot.feature_maps(dbg, "fc", tmp_path / "fc.png")
    with pytest.raises(fxdebug.UsageError, match="suffix"):
        fxdebug.plot.feature_maps(dbg, "layer2", tmp_path / "fc.jpeg")
    with pytest.raises(fxdebug.UsageError, match="run the instrumented model"):
        fxdebug.plot.feature_maps(dbg, "layer2", tmp_path / "l2.png")
