"""The Triton observation kernel (fxdebug/runtime/triton_kernel.py) against the C++ kernel.

Triton runs on CPU tensors only under its interpreter, which must be switched on before triton is
imported (its own reductions are built at import time), so the comparison runs in a fresh process
with ``TRITON_INTERPRET=1``: direct kernel cases (NaN/Inf, values whose float32 squares overflow,
float64, half, channels first / last / channels-last memory, a channel-count mismatch, empty and
integer tensors, batched calls) and the zoo models instrumented with NaNCheck + StatCollector, run
once on each kernel (``fxdebug.runtime.kernel.use``). Counts must be equal, sums close.
On CUDA (marked ``cuda``) the compiled kernel is checked the same way against the CPU kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(r'''
    import json, math, sys
    import torch
    sys.path.insert(0, "tests")
    import fxdebug
    from fxdebug.passes import NaNCheck, StatCollector
    from fxdebug.runtime import kernel
    from fxdebug.runtime.slots import K, init_table
    from fxdebug.runtime.triton_kernel import observe_triton, observe_many_triton, interpreting
    from zoo import ZOO

    out = {"interpreting": interpreting(), "cases": {}, "zoo": {}, "launches": None}
    op = kernel.observe_op()

    def run(fn, x, channels, cdim, calls=2):
        table = init_table(2 + -(-channels // K), [(2 * K, channels)] if channels else [], "cpu")
        for call in range(calls):
            table[0] = call
            fn(x, table, 0, 2 * K if channels else 0, channels, cdim)
        return table.tolist()

    def poisoned():
        x = torch.randn(3, 4, 5)
        x[0, 1, 2], x[2, 2, 0], x[1, 0, 4] = math.nan, math.inf, -math.inf
        return x

    cases = {
        "plain": (lambda: torch.randn(4, 8, 5, 5), 8, 1),
        "last_dim": (lambda: torch.randn(3, 7, 33), 33, -1),
        "channels_last": (lambda: torch.randn(2, 6, 9, 9).to(memory_format=torch.channels_last), 6, 1),
        "transposed": (lambda: torch.randn(20, 30).t(), 20, 1),
        "nonfinite": (poisoned, 4, 1),
        "inf_only": (lambda: torch.tensor([1.0, math.inf, -2.0, 0.0]), 0, 0),
        "f32_overflow": (lambda: torch.randn(5, 40000) * 1e30, 5, 0),
        "float64_huge": (lambda: torch.randn(3, 5000, dtype=torch.float64) * 1e200, 3, 0),
        "half": (lambda: torch.randn(4, 300).half(), 4, 0),
        "bfloat16": (lambda: torch.randn(4, 300).bfloat16(), 0, 0),
        "mismatch": (lambda: torch.randn(4, 5), 7, 1),
        "empty": (lambda: torch.randn(0, 3), 3, 1),
        "integer": (lambda: torch.arange(12).view(3, 4), 4, 1),
        "big_blocks": (lambda: torch.randn(70000), 0, 0),
    }
    for name, (make, channels, cdim) in cases.items():
        x = make()
        out["cases"][name] = [run(observe_triton, x, channels, cdim), run(op, x, channels, cdim)]

    # a batched call: one launch for several tensors, each into its own row
    xs = [torch.randn(3, 4), poisoned(), torch.randn(2, 5, 3), torch.zeros(0), torch.randn(6)]
    args = []
    for i, x in enumerate(xs):
        args += [i, 0, 0, 0]
    tables = []
    for fn in (observe_many_triton, kernel.observe_many_op()):
        t = init_table(len(xs), [], "cpu")
        t[0] = 3
        fn(xs, t, args)
        tables.append(t.tolist())
    out["cases"]["many"] = tables

    # one launch per observe call: count kernel launches of the interpreted kernel
    from fxdebug.runtime import triton_kernel
    fn, _ = triton_kernel._kernel(torch.device("cpu"))
    launches = []
    orig = fn.run
    def counting(*a, **k):
        launches.append(1)
        return orig(*a, **k)
    fn.run = counting
    t = init_table(len(xs), [], "cpu")
    observe_many_triton(xs, t, args)
    observe_triton(torch.randn(100000), t, 0, 0, 0, 0)
    fn.run = orig
    out["launches"] = len(launches)

    names = sys.argv[1].split(",")
    for name in names:
        model, inputs = ZOO[name]()
        model.eval()  # dropout would differ between the two runs
        dbg = fxdebug.instrument(model, [NaNCheck(mode="record"), StatCollector()], example_inputs=inputs)
        reports = {}
        for which in ("cpp", "triton"):
            dbg.reset()
            with kernel.use(which):
                with torch.no_grad():
                    dbg(*inputs)
                    dbg(*inputs)
                r = dbg.report()
            reports[which] = {"rows": [{k: v for k, v in row.items() if isinstance(v, (int, float)) or v is None}
                                       for row in r.rows], "notes": r.notes}
        out["zoo"][name] = reports
    print("RESULT" + json.dumps(out))
''')

MODELS = ["residual_cnn", "transformer_block", "functional_ops", "inplace_ops", "lstm", "embedding"]


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("FXDEBUG_KERNEL", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(MODELS)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(li for li in proc.stdout.splitlines() if li.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


COUNTS = (0, 1, 2, 6, 7, 8, 12, 14)  # calls, stat_calls, count, zeros, nan, inf, bad_calls, chan_mismatch


def _same(a: list[float], b: list[float]) -> None:
    import math

    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        slot = (i % 16) if i >= 16 else None
        if math.isnan(v):
            assert math.isnan(u), (i, u, v)
        elif slot in COUNTS or math.isinf(v):
            assert u == v, (i, u, v)
        elif slot == 3:  # float32 partial sums in another block order: close relative to the sum of |x|
            assert abs(u - v) <= 1e-6 * max(abs(a[i + 2]), 1.0), (i, u, v)
        else:
            assert u == pytest.approx(v, rel=1e-6, abs=1e-9), (i, u, v)


def test_triton_runs_under_the_interpreter(result):
    assert result["interpreting"] is True


@pytest.mark.parametrize("case", ["plain", "last_dim", "channels_last", "transposed", "nonfinite", "inf_only",
                                  "f32_overflow", "float64_huge", "half", "bfloat16", "mismatch", "empty", "integer",
                                  "big_blocks", "many"])
def test_triton_matches_cpp_kernel(result, case):
    triton_table, cpp_table = result["cases"][case]
    _same(triton_table, cpp_table)


def test_nonfinite_counts_are_exact_and_sums_do_not_overflow(result):
    t, _ = result["cases"]["nonfinite"]
    row = t[16:32]
    assert row[7] == 2 and row[8] == 4 and row[12] == 2 and row[13] == 0  # 1 NaN and 2 Inf per call, first bad call 0
    t, _ = result["cases"]["f32_overflow"]
    row = t[16:32]
    assert row[7] == row[8] == 0 and row[12] == 0  # 1e30**2 overflows float32, never looks non-finite
    assert 1e60 < row[4] < float("inf")


def test_one_launch_per_call(result):
    # one observe_many of 5 tensors and one observe of 100k elements: two launches
    assert result["launches"] == 2


@pytest.mark.parametrize("name", MODELS)
def test_zoo_reports_agree(result, name):
    import math

    cpp, tri = result["zoo"][name]["cpp"], result["zoo"][name]["triton"]
    assert any("observation kernel c++ on cpu" in n for n in cpp["notes"])
    assert any("observation kernel triton (interpreter) on cpu" in n for n in tri["notes"])
    assert len(cpp["rows"]) == len(tri["rows"]) > 0
    for a, b in zip(tri["rows"], cpp["rows"]):
        assert a.keys() == b.keys()
        for k in a:
            u, v = a[k], b[k]
            if k in ("calls", "count", "nonfinite_calls", "nonfinite_first_call", "zero_frac", "channels") or v is None:
                assert u == v, (name, b.get("node"), k, u, v)
            elif isinstance(v, float) and math.isnan(v):
                assert math.isnan(u)
            else:
                assert u == pytest.approx(v, rel=1e-5, abs=1e-6), (name, b.get("node"), k, u, v)


@pytest.mark.cuda
def test_cuda_triton_kernel_matches_cpu():
    import math

    import torch

    from fxdebug.runtime import kernel
    from fxdebug.runtime.slots import K, init_table

    assert kernel.active("cuda") == "triton"
    op = kernel.observe_op()
    for x, channels, cdim in [(torch.randn(4, 8, 33, 33), 8, 1), (torch.randn(3, 7, 1000), 1000, -1),
                              (torch.randn(1 << 22), 0, 0), (torch.tensor([1.0, math.nan, math.inf]), 0, 0)]:
        tables = []
        for device in ("cpu", "cuda"):
            t = init_table(2 + -(-channels // K), [(2 * K, channels)] if channels else [], device)
            for call in range(2):
                t[0] = call
                op(x.to(device), t, 0, 2 * K if channels else 0, channels, cdim)
            tables.append(t.cpu().tolist())
        _same(tables[1], tables[0])
