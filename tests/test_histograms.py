"""``Histograms`` / ``StatCollector(histograms=True)``: fixed bins on the device, nothing dropped."""

from __future__ import annotations

import pytest
import torch

import fxdebug
from fxdebug.passes import Histograms, StatCollector
from zoo import ZOO


def test_counts_match_torch_histogram_of_the_values():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    dbg = fxdebug.instrument(model, [Histograms(bins=10, range=(-1.0, 1.0), where="fc")], example_inputs=(x,))
    batches = [torch.randn(2, 3, 16, 16) for _ in range(3)]
    for b in batches:
        dbg(b)
    h = dbg.report().row("fc")["hist"]
    with torch.no_grad():
        values = torch.cat([model(b).reshape(-1) for b in batches])
    inner = torch.histogram(values.clamp(-1, 1), bins=10, range=(-1.0, 1.0)).hist
    assert len(h["counts"]) == 12 and len(h["limits"]) == 12
    assert h["counts"][0] == float((values <= -1.0).sum()) and h["counts"][-1] == float((values > 1.0).sum())
    assert sum(h["counts"]) == h["num"] == values.numel()
    assert sum(h["counts"][1:-1]) == pytest.approx(float(inner.sum()) - h["counts"][0] - h["counts"][-1])
    assert h["min"] == pytest.approx(float(values.min())) and h["sum"] == pytest.approx(float(values.double().sum()), rel=1e-6)


def test_first_call_range_and_gradients_through_stat_collector():
    model, (x,) = ZOO["transformer_block"]()
    dbg = fxdebug.instrument(model, [StatCollector(grads=True, histograms=8)], example_inputs=(x,))
    dbg(x).sum().backward()
    row = dbg.report().row("attn_proj")
    h, g = row["hist"], row["grad_hist"]
    assert len(h["counts"]) == 10 and h["counts"][0] == 0 and h["counts"][-1] == 0  # the first call fixed the range
    assert h["limits"][0] < h["min"] and h["limits"][-2] > h["max"]
    assert sum(g["counts"]) == g["num"] == x.numel()
    assert "hist" not in str(dbg.report()).splitlines()[1]  # a hidden column: not in the table


def test_bad_options_are_refused():
    with pytest.raises(fxdebug.UsageError, match="bins"):
        Histograms(bins=0)
    with pytest.raises(fxdebug.UsageError, match="lo < hi"):
        Histograms(range=(1.0, 0.0))
