"""The cost-saving choices of the observe passes, checked for what they promise: views are
skipped (and can be asked for), large tensors are still read whole (one fused pass, exact), and
every kind of non-finite value is caught by that one pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from zoo import ZOO


def test_views_are_skipped_by_default_and_observed_on_request():
    model, inputs = ZOO["transformer_block"]()
    default = fxdebug.instrument(model, [StatCollector()], example_inputs=inputs)
    watched = {r["node"] for r in default.report().rows}
    views = [n.name for part in default.parts().values() for n in part.graph.nodes if fxdebug.authoring.is_view(n)]
    assert views and not watched & set(views)
    everything = fxdebug.instrument(model, [StatCollector(views=True), NaNCheck(views=True)], example_inputs=inputs)
    everything(*inputs)
    rows = {r["node"]: r for r in everything.report().rows}
    float_views = [v for v in views if v in rows]
    assert float_views
    transpose = next(v for v in float_views if "transpose" in v)  # `transpose` (symbolic), `attn_transpose` (Dynamo)
    assert rows[transpose]["count"] > 0 and rows[transpose]["nonfinite_calls"] == 0


class Sparse(nn.Module):
    def forward(self, x):
        return torch.relu(x - 0.3)


@pytest.mark.parametrize("shape", [(4, 16, 64, 64), (3, 100_003)])
def test_large_tensors_are_read_whole_in_one_fused_pass(shape):
    x = torch.randn(*shape)
    out = torch.relu(x - 0.3)
    exact_zero = float((out == 0).double().mean())
    exact_abs = float(out.abs().double().mean())
    dbg = fxdebug.instrument(Sparse(), [StatCollector()], example_inputs=(x,))
    dbg(x)
    row = dbg.report().rows[-1]
    assert "sampled_frac" not in row  # no sampling: every element is read
    assert row["zero_frac"] == pytest.approx(exact_zero, abs=1e-12)
    assert row["mean_abs"] == pytest.approx(exact_abs, rel=1e-6)
    assert row["mean"] == pytest.approx(float(out.double().mean()), rel=1e-6)
    assert row["count"] == out.numel()


def test_sample_is_a_view_spread_over_the_whole_tensor():
    x = torch.arange(4 * 256 * 1024, dtype=torch.float32).view(4, 256, 1024)
    sample = fxdebug.authoring.systematic_sample(x)
    assert sample.numel() == fxdebug.authoring.SAMPLE and sample.data_ptr() == x.data_ptr()
    assert float(sample.min()) == 0 and float(sample.max()) > 0.95 * x.numel()
    small = torch.randn(10, 10)
    assert fxdebug.authoring.systematic_sample(small) is small


class Cancels(nn.Module):
    def forward(self, x):
        return x * 1.0


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf"), "both"])
def test_the_fused_pass_detects_every_kind_of_non_finite(poison):
    x = torch.randn(4, 8)
    if poison == "both":
        x[0, 0], x[1, 1] = float("inf"), float("-inf")  # the sum is NaN: still caught
    else:
        x[2, 3] = poison
    dbg = fxdebug.instrument(Cancels(), [NaNCheck()], example_inputs=(torch.randn(4, 8),))
    dbg(x)
    report = dbg.report()
    assert report.first_nonfinite == "x"
    assert report.row("mul")["nonfinite_calls"] == 1
