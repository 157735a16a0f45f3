"""Smoke test of the benchmark harness's quick path (tiny sizes; nothing here is timed)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bm():
    return _load("bench_models")


@pytest.fixture(scope="module")
def bench():
    return _load("bench")


@pytest.mark.parametrize("name", ["resnet50-style", "vit-s-style", "mlp-100x1024", "graph-2000"])
def test_quick_models_run_and_variants_keep_outputs(bm, name):
    model, x = bm.MODELS[name](True)
    assert not model.training
    with torch.no_grad():
        ref = model(*x)
        hooked = bm.hooked_copy(model, sync=False)(*x)
        limit = bm.limit_proxy(model, x, None)(*x)
    torch.testing.assert_close(hooked, ref, rtol=0, atol=0)
    assert torch.equal(limit, ref)


def test_limit_proxy_adds_one_reduction_per_observed_node(bm):
    model, x = bm.MODELS["mlp-100x1024"](True)
    gm = bm.limit_proxy(model, x, ["_0", "_1"])
    added = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is bm._one_reduction]
    assert sorted(n.args[0].name for n in added) == ["_0", "_1"]


def test_hooks_fill_one_row_per_leaf(bm):
    model, x = bm.MODELS["mlp-100x1024"](True)
    hooked = bm.hooked_copy(model, sync=True)
    calls = []
    for m in hooked.modules():
        if not list(m.children()):
            m.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        hooked(*x)
    assert len(calls) == 20  # 10 × (Linear, ReLU)


def test_interleaved_calls_every_variant_warmup_plus_runs(bench):
    counts = {"a": 0, "b": 0}

    def make(k):
        def run():
            counts[k] += 1
        return run

    med = bench.interleaved({k: make(k) for k in counts}, runs=3, warmup=2, sync=lambda: None)
    assert counts == {"a": 5, "b": 5}
    assert set(med) == {"a", "b"} and all(v >= 0 for v in med.values())


def test_quick_harness_writes_the_table(bench, bm, tmp_path):
    out = tmp_path / "bench.md"
    text = bench.main(["--quick", "--models", "mlp-100x1024", "--runs", "1", "--warmup", "0", "--threads", "1",
                       "--out", str(out)])
    assert out.read_text().strip() == text.strip()
    row = next(line for line in text.splitlines() if line.startswith("| mlp-100x1024 | 22 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[3]) > 0  # plain ms, hooks ratio
    assert "trace_s" in text
    if bm.passes_available():
        assert float(cells[5]) > 0  # the fxdebug variant ran
        assert re.search(r"\| instrument_s \| \d", text)


def test_debug_suite_runs_and_writes_its_table(tmp_path):
    _load("bench")
    debug = _load("bench_debug")
    out = tmp_path / "debug.md"
    args = debug.parse(["--models", "zoo residual_cnn,mlp 20x256 batch 2", "--runs", "1", "--warmup", "0",
                        "--repeats", "1", "--out", str(out)])
    threads = torch.get_num_threads()
    try:
        text = debug.run(args, lambda: "test machine")
    finally:
        torch.set_num_threads(threads)
    assert out.read_text().strip() == text.strip()
    for model in ("zoo residual_cnn", "mlp 20x256 batch 2"):
        assert re.search(rf"\| {re.escape(model)} \| (symbolic|dynamo) \| \d+ \|", text)  # the default frontend
    assert "hooks .item()" in text and "hooks sum" in text and "Forward + backward" in text
    assert "| runtime kernel | c++ |" in text
