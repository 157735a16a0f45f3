"""``Report.scalars`` (the flat tracker dict) and the notebook display of reports and modules."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.log(self.fc2(self.act(self.fc1(x)))))


def _dbg(grads: bool = False, **options: str) -> fxdebug.Instrumented:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    return fxdebug.instrument(Net(), [NaNCheck(), StatCollector(grads=grads)], example_inputs=(x,), **options)


def _per_node(values: dict[str, float], prefix: str = "fxdebug/") -> list[str]:
    return [k for k in values if k.startswith(prefix) and k[len(prefix):].count("/") >= 2]


def test_scalars_are_flat_finite_floats_with_summaries():
    dbg = _dbg(grads=True)
    x = torch.randn(3, 4)
    dbg(x).abs().sum().backward()  # log of negative values: NaN from node 'log'
    values = dbg.report().scalars()
    assert all(isinstance(k, str) and type(v) is float and math.isfinite(v) for k, v in values.items())
    assert values["fxdebug/calls"] == 1.0 and values["fxdebug/ok"] == 0.0
    assert values["fxdebug/nonfinite_nodes"] >= 1
    assert values["fxdebug/nodes"] == len(dbg.report().rows)
    assert "fxdebug/grad_max_abs_max" in values  # over the gradients' finite values
    # the origin's non-finite count is the first per-node key
    assert _per_node(values)[0] == "fxdebug/root/log/nonfinite_calls"
    assert values["fxdebug/fc1/fc1/max_abs"] > 0


def test_top_k_caps_per_node_keys_nonfinite_first_then_largest():
    dbg = _dbg()
    dbg(torch.randn(3, 4))
    report = dbg.report()
    every = report.scalars(top_k=None)
    capped = report.scalars(prefix="train/fx/", top_k=2)
    assert len(_per_node(every)) > 2
    keys = _per_node(capped, "train/fx/")
    assert len(keys) == 2 and all(k.startswith("train/fx/") for k in capped)
    assert keys[0] == "train/fx/root/log/nonfinite_calls"
    assert capped["train/fx/calls"] == 1.0  # summaries are not counted against top_k
    assert report.scalars(top_k=0).keys() == {k for k in every if k not in _per_node(every)}


def test_top_k_ranks_finite_nodes_by_size():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight.mul_(1000)
    dbg = fxdebug.instrument(model, [StatCollector(grads=True)], example_inputs=(torch.randn(2, 4),))
    dbg(torch.randn(2, 4)).sum().backward()
    values = dbg.report().scalars(top_k=2)
    assert values["fxdebug/grad_max_abs_max"] > values["fxdebug/grad_max_abs_min"] > 0
    assert _per_node(values) == ["fxdebug/1/_1/max_abs", "fxdebug/1/_1/grad_max_abs"]  # layer 1 is the largest
    assert values["fxdebug/max_abs"] == values["fxdebug/1/_1/max_abs"]


def test_scalars_rejects_a_bad_top_k():
    dbg = _dbg()
    dbg(torch.randn(3, 4))
    with pytest.raises(fxdebug.UsageError, match="top_k"):
        dbg.report().scalars(top_k=-3)


def test_report_mimebundle_has_text_and_an_html_table_without_script():
    dbg = _dbg()
    dbg(torch.randn(3, 4))
    report = dbg.report()
    bundle = report._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert "NaN/Inf origin (forward): 'log'" in bundle["text/plain"]
    page = bundle["text/html"]
    assert page.count("<tr") == len(report.rows) + 1 and "<script" not in page
    assert "<th" in page and ">log<" in page and "font-weight:bold" in page  # the origin stands out
    assert report._repr_mimebundle_(include=["text/html"]).keys() == {"text/html"}


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_instrumented_module_shows_an_inline_static_svg():
    dbg = _dbg(frontend="symbolic")
    dbg(torch.randn(3, 4))
    bundle = dbg._repr_mimebundle_()
    svg = bundle["image/svg+xml"]
    assert svg.startswith("<svg") and "<script" not in svg and "fc2" in svg
    assert "text/plain" in bundle
