"""Instrumented modules under torch.compile: no graph breaks caused by fxdebug, no recompiling
on every call, and statistics that count each call exactly once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector

pytest.importorskip("torch._dynamo")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()


def test_compiled_instrumented_module_counts_each_call_once_without_breaks():
    import torch._dynamo

    torch._dynamo.reset()
    model = _model()
    x = torch.randn(2, 3, 8, 8)
    # torch.compile over a snapshot graph module is the subject (a live module is itself Dynamo's capture)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    explanation = torch._dynamo.explain(dbg)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    dbg.reset()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(dbg, backend="eager")
    calls = 5
    with torch.no_grad():
        for _ in range(calls):
            out = compiled(x)
    assert torch.equal(out, model(x))
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] <= 2  # the first call creates the device clock; after that nothing changes

    report = dbg.report()
    relu = report.row("_2")
    assert relu["calls"] == calls
    assert relu["count"] == calls * 2 * 4 * 6 * 6
    with torch.no_grad():
        expected = torch.relu(model[1](model[0](x)))
    assert relu["mean"] == pytest.approx(float(expected.double().mean()), rel=1e-5)
    assert relu["max"] == pytest.approx(float(expected.max()))
    assert report.first_nonfinite is None
    assert report.calls == calls and report.row("input_1")["calls"] == calls  # NaNCheck-only row


def test_inductor_compiles_the_fused_op_in_place():
    """Inductor compiles the graph with the fused op (its fake implementation traces, the state
    table's mutation is functionalised and written back): outputs equal, each call counted once."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _model()
    x = torch.randn(2, 3, 8, 8)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,))
    compiled = torch.compile(dbg)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(x)
    assert torch.equal(out, model(x))
    report = dbg.report()
    assert report.row("_2")["calls"] == 3 and report.calls == 3
    assert report.row("_2")["count"] == 3 * 2 * 4 * 6 * 6
    torch._dynamo.reset()


def test_inductor_observes_activations_in_the_layout_it_chose():
    """The observe ops carry Tag.flexible_layout: Inductor hands the extern call each activation in
    its own layout (channels last after a convolution) instead of writing an NCHW copy of it for the
    call (a fused kernel named after the observe op); per-channel statistics equal the eager ones."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3), nn.BatchNorm2d(32), nn.ReLU()).eval()
    x = torch.randn(1, 3, 16, 16)
    eager = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    assert torch.Tag.flexible_layout in torch.ops.fxdebug.observe.default.tags
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):  # the cache key ignores op tags
        eager(x)
        _, codes = run_and_get_code(torch.compile(dbg), x)
    code = "\n".join(codes)
    assert "fxdebug.observe" in code
    copies = sorted({line.split("(")[0].strip() for line in code.splitlines()
                     if "cpp_fused_" in line and "=" not in line and "observe" in line.split("(")[0]})
    assert not copies, copies
    a, b = eager.report(), dbg.report()
    for name in ("_0", "_1", "_3", "_4"):
        assert a.row(name)["count"] == b.row(name)["count"]
        assert a.row(name)["mean"] == pytest.approx(b.row(name)["mean"], rel=1e-4, abs=1e-5)
    torch._dynamo.reset()
