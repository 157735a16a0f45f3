"""``Profile``: node names in profiler traces; ``time=True`` per-node wall time columns."""

from __future__ import annotations

import copy

import torch
from torch.profiler import ProfilerActivity, profile

import fxdebug
from fxdebug.passes import Profile, StatCollector
from zoo import ZOO


def test_record_function_ranges_carry_node_names_and_forward_is_unchanged():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    dbg = fxdebug.instrument(model, [Profile()], example_inputs=(x,))
    assert torch.equal(dbg(x), model(x))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dbg(x)
    names = {e.key for e in prof.key_averages()}
    # the last residual add: `iadd_3` in a symbolic graph, `layer2_1_iadd` in Dynamo's
    last_add = [r["node"] for r in dbg.report().rows if r["op"].endswith("iadd")][-1]
    assert {"layer1_0_conv1", last_add, "fc", "flatten"} <= names
    conv = next(e for e in prof.events() if e.name == "layer1_0_conv1")
    assert any("conv" in c.name for c in conv.cpu_children)  # the aten op runs inside the node's range
    assert dbg.report().rows and all("time_ms" not in r for r in dbg.report().rows)  # time=False: no column


def test_time_columns_per_node_and_reset(tmp_path):
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    dbg = fxdebug.instrument(model, [StatCollector(), Profile(time=True)], example_inputs=(x,))
    for _ in range(3):
        dbg(x)
    report = dbg.report()
    timed = [r for r in report.rows if r.get("time_ms") is not None]
    assert len(timed) >= 30 and all(r["time_ms"] > 0 for r in timed)
    assert max(r["time_share"] for r in timed) == 1.0 and all(0 < r["time_share"] <= 1 for r in timed)
    for r in timed:
        assert abs(r["time_total_ms"] - 3 * r["time_ms"]) < 1e-9 * max(1.0, r["time_total_ms"])
    col = report.column("time_share")
    assert col is not None and col.has(fxdebug.authoring.COLOR)
    dbg.reset()
    dbg(x)
    assert dbg.report().row("fc")["time_total_ms"] == dbg.report().row("fc")["time_ms"]  # one call since reset
    hot = [f for f in dbg.report().findings() if f.kind == "hot_spot"]
    assert hot and all(dbg.report().row(f.node)["time_share"] >= 0.5 for f in hot)
    twin = copy.deepcopy(dbg)
    twin(x)
    assert twin.report().row("fc")["time_ms"] > 0
    svg = (tmp_path / "t.svg")
    dbg.render(str(svg), depth=10)  # every node drawn (no folding into module boxes)
    assert "time_share" in svg.read_text()  # the column is on the picture (hot spots depend on which node is slowest)
