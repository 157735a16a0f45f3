"""Statistics that fuse under torch.compile (``FXDEBUG_COMPILE_STATS=inline`` / ``fused_compile()``):
the fused op's Functionalize kernel (fxdebug/runtime/functional.py) turns each observation into
aten reductions, so AOTAutograd's graph holds no fxdebug op and Inductor's generated code calls
none (the reductions run inside the kernels that produce the activations), with the same numbers
as eager. By default the op stays one extern call (checked too)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector

pytest.importorskip("torch._dynamo")

STATS = ("calls", "count", "nonfinite_calls", "zero_frac", "mean", "std", "min", "max", "norm", "dead_frac")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).eval()


def _no_caches():
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig

    from fxdebug.runtime.kernel import fused_compile

    # a cached graph compiled under the other registration must not answer
    return iconfig.patch(fx_graph_cache=False), fconfig.patch(enable_autograd_cache=False), fused_compile()


def _rows(report):
    return {r["node"]: {k: r.get(k) for k in STATS} for r in report.rows if "count" in r}


def _same(a, b):
    assert a.keys() == b.keys() and a
    for node in a:
        for k in STATS:
            u, v = a[node][k], b[node][k]
            if isinstance(v, float) and v != v:
                assert u != u, (node, k, u, v)
                continue
            assert (u == v) if k in ("calls", "count", "nonfinite_calls") else (u == pytest.approx(v, rel=1e-5, abs=1e-7)), \
                (node, k, u, v)


def test_aot_graph_holds_no_fxdebug_op_and_counts_match_eager():
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, x = _model(), torch.randn(3, 8)
    dbg = fxdebug.instrument(model, [NaNCheck(mode="record"), StatCollector()], example_inputs=(x,), frontend="symbolic")
    with torch.no_grad():
        for _ in range(3):
            dbg(x)
    eager = _rows(dbg.report())
    dbg.reset()
    torch._dynamo.reset()
    c1, c2, fused = _no_caches()
    with c1, c2, fused, torch.no_grad():
        compiled = torch.compile(dbg, backend=aot_autograd(fw_compiler=capture))
        for _ in range(3):
            out = compiled(x)
    torch._dynamo.reset()
    assert torch.equal(out, model(x))
    assert graphs
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if "fxdebug" in t or "auto_functionalized" in t], targets
    assert any("amax" in t for t in targets) and any("isnan" in t for t in targets)
    _same(_rows(dbg.report()), eager)


def test_inductor_code_calls_no_fxdebug_op():
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    model, x = _model(), torch.randn(3, 8)
    x[0, 0] = float("nan")
    dbg = fxdebug.instrument(model, [NaNCheck(mode="record"), StatCollector()], example_inputs=(x,), frontend="symbolic")
    with torch.no_grad():
        dbg(x)
        dbg(x)
    eager = dbg.report()
    dbg.reset()
    torch._dynamo.reset()
    c1, c2, fused = _no_caches()
    with c1, c2, fused, torch.no_grad():
        compiled = torch.compile(dbg)
        out, code = run_and_get_code(compiled, x)
        compiled(x)
    torch._dynamo.reset()
    src = "\n".join(code)
    assert "fxdebug" not in src.replace("fxdebug/", "")  # source paths in comments aside, no op call
    assert "torch.ops.fxdebug" not in src
    assert torch.equal(out.isnan(), model(x).isnan())
    report = dbg.report()
    _same(_rows(report), _rows(eager))
    assert report.first_nonfinite == eager.first_nonfinite is not None


def test_by_default_the_op_stays_one_extern_call():
    import torch._dynamo
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, x = _model(), torch.randn(3, 8)
    dbg = fxdebug.instrument(model, [NaNCheck(mode="record"), StatCollector()], example_inputs=(x,), frontend="symbolic")
    torch._dynamo.reset()
    with iconfig.patch(fx_graph_cache=False), fconfig.patch(enable_autograd_cache=False), torch.no_grad():
        torch.compile(dbg, backend=aot_autograd(fw_compiler=capture))(x)
    torch._dynamo.reset()
    text = "\n".join(str(n.args) + str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function")
    assert "fxdebug.observe" in text
    assert dbg.report().row("_1")["calls"] == 1
