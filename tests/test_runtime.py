"""The observation runtime: the fused ``fxdebug::observe`` op, its state table and the lowering.

The C++ kernel and the pure-torch implementation are checked against each other and against
plain torch reductions; the graph calls the op directly; large finite values are neither an
overflow nor a NaN origin; the fallback is chosen (and said) when the kernel is unavailable.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector
from fxdebug.runtime import backend, observe_op
from fxdebug.runtime.fallback import observe_torch
from fxdebug.runtime.slots import INDEX, K, init_table
from zoo import ZOO

CASES = [
    ("nchw", lambda: torch.randn(2, 3, 5, 5), 1, 3),
    ("channels_last", lambda: torch.randn(2, 3, 5, 5).contiguous(memory_format=torch.channels_last), 1, 3),
    ("ntd", lambda: torch.randn(2, 7, 16), -1, 16),
    ("nc", lambda: torch.randn(4, 16), 1, 16),
    ("large_flat", lambda: torch.relu(torch.randn(200_003)), 0, 0),
    ("large_nchw", lambda: torch.randn(2, 32, 40, 40), 1, 32),
    ("transposed", lambda: torch.randn(5, 6).t(), 1, 5),
    ("half", lambda: torch.randn(4, 4).half(), 1, 4),
    ("bfloat16", lambda: torch.randn(4, 4).bfloat16(), -1, 4),
    ("float64_huge", lambda: torch.randn(4, 4, dtype=torch.float64) * 1e200, -1, 4),
    ("float32_huge", lambda: torch.full((4, 4), 1e36), 1, 4),
    ("empty", lambda: torch.empty(0, 3), 1, 3),
    ("channel_count_changed", lambda: torch.randn(2, 3, 4), 1, 5),
]


def _poisoned():
    x = torch.randn(3, 4)
    x[0, 1], x[2, 2], x[1, 0] = math.nan, math.inf, -math.inf
    return x


CASES.append(("nonfinite", _poisoned, 1, 4))


def _poisoned_blocks():
    """NaN and Inf inside whole 512-element blocks (the kernel's float lanes redo such a block exactly), in the
    tail after them, and huge finite values whose squares overflow float32 in another block."""
    x = torch.randn(5, 1000)
    x[0, 3], x[1, 700], x[2, 999], x[4, 998] = math.nan, math.inf, -math.inf, math.nan
    x[3, 100:110] = 1e36
    return x


CASES += [
    ("nonfinite_in_blocks", _poisoned_blocks, 1, 1000),
    ("half_in_blocks", lambda: torch.randn(3, 1500).half(), 0, 3),
    ("bfloat16_in_blocks", lambda: torch.relu(torch.randn(2, 4, 300)).bfloat16(), 1, 4),
    ("short_runs", lambda: torch.randn(1, 512, 2, 2), 1, 512),  # a channel's run shorter than a vector
    ("short_runs_chunked", lambda: torch.randn(4, 3000, 3, 3), 1, 3000),  # chunks that start mid-way through the channels
]


def _nodes(dbg):
    """Every node of the module's captured graphs (one for a snapshot, one per capture of a live module)."""
    return [n for part in dbg.parts().values() for n in part.graph.nodes]



def _run(fn, x, channels, cdim, calls=2):
    table = init_table(2 + -(-channels // K), [(2 * K, channels)] if channels else [], "cpu")
    for call in range(calls):
        table[0] = call
        fn(x, table, 0, 2 * K if channels else 0, channels, cdim)
    return table


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_torch_reductions(case):
    _, make, cdim, channels = case
    x = make()
    native = _run(observe_op(), x, channels, cdim)
    reference = _run(observe_torch, x, channels, cdim)
    # float32 inputs are summed in float lanes per block of 512, blocks in float64: ~1e-7 relative
    torch.testing.assert_close(native, reference, rtol=1e-6, atol=1e-9, equal_nan=True)
    row = native[K: 2 * K]
    assert row[INDEX["calls"]] == 2
    if x.numel():
        xd = x.double()
        assert row[INDEX["count"]] == 2 * x.numel()
        assert row[INDEX["nan"]] == 2 * int(torch.isnan(x).sum()) and row[INDEX["inf"]] == 2 * int(torch.isinf(x).sum())
        assert row[INDEX["zeros"]] == 2 * int((x == 0).sum())
        finite = xd[torch.isfinite(xd)]
        if torch.isfinite(xd).all():
            torch.testing.assert_close(row[INDEX["sum"]], 2 * xd.sum(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(row[INDEX["sumsq"]], 2 * (xd * xd).sum(), rtol=1e-6, atol=0)
            assert row[INDEX["min"]] == finite.min() and row[INDEX["max"]] == finite.max()
            assert row[INDEX["bad_calls"]] == 0 and math.isinf(row[INDEX["first_bad"]])
        else:
            assert math.isnan(row[INDEX["min"]])  # NaN seen: min/max say so, as amin/amax would
            assert row[INDEX["bad_calls"]] == 2 and row[INDEX["first_bad"]] == 0


def test_kernel_is_thread_count_independent():
    x = torch.randn(4, 64, 33, 33)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(observe_op(), x, 64, 1)
        torch.set_num_threads(max(2, before))
        many = _run(observe_op(), x, 64, 1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)  # fixed chunks combined in order: bitwise the same


def test_the_graph_calls_the_op_directly():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,))
    one, many = torch.ops.fxdebug.observe.default, torch.ops.fxdebug.observe_many.default
    nodes = _nodes(dbg)
    watched = [n.args[0] for n in nodes if n.op == "call_function" and n.target is one]
    batches = [n for n in nodes if n.op == "call_function" and n.target is many]
    watched += [x for b in batches for x in b.args[0]]
    modules = [n for part in dbg.parts().values() for n in part.graph.nodes  # (one part, or one per block region)
               if n.op == "call_module" and isinstance(part.get_submodule(str(n.target)), fxdebug.authoring.Observer)]
    assert not modules and len(watched) == len(set(watched)) == len(dbg.observers()) == len(dbg.report().rows)
    assert batches and len(batches) < len(watched) / 3  # small tensors: several per call
    assert torch.equal(dbg(x), model(x))


def test_batched_observations_are_made_before_an_in_place_op():
    class InPlace(torch.nn.Module):
        def forward(self, x):
            y = x * 2.0  # observed, then overwritten in place below
            y.mul_(-1.0)
            return y + 1.0

    x = torch.rand(3, 4) + 1.0
    dbg = fxdebug.instrument(InPlace(), [StatCollector()], example_inputs=(x,))
    dbg(x)
    nodes = _nodes(dbg)
    mul_ = next(i for i, n in enumerate(nodes) if n.target in ("mul_", torch.Tensor.mul_))  # a method or Dynamo's function
    mul = next(n for n in nodes if n.name == "mul")
    user = next(i for i, n in enumerate(nodes) if n.op == "call_function" and mul in (n.args[0] if isinstance(n.args[0], list) else [n.args[0]]))
    assert user < mul_  # the observation of `mul` runs before `mul_` changes it
    assert dbg.report().row("mul")["min"] == pytest.approx(float((x * 2).min()))


def test_mixed_probes_keep_the_observer_and_still_use_one_fused_read():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], example_inputs=(x,))
    dbg(x)
    dbg(x)
    row = dbg.report().row("stem_2")
    with torch.no_grad():
        ref = model.stem(x)
    assert row["calls"] == 2 and row["count"] == 2 * ref.numel()
    assert row["mean"] == pytest.approx(float(ref.double().mean()), rel=1e-6)


class Huge(nn.Module):
    """nn.Linear with weights 1e36: the output is large but finite."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(1e36)
            self.fc.bias.zero_()

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_large_finite_values_are_not_a_nonfinite_origin():
    x = torch.full((2, 4), 0.5)
    dbg = fxdebug.instrument(Huge(), [NaNCheck(counts=True), StatCollector()], example_inputs=(x,))
    y = dbg(x)
    assert torch.isfinite(y).all()
    report = dbg.report()
    assert report.first_nonfinite is None and report.ok
    row = report.row("fc")
    assert row["mean"] == pytest.approx(2e36, rel=1e-6) and math.isfinite(row["std"]) and row["nan"] == 0
    raising = fxdebug.instrument(Huge(), [NaNCheck(mode="raise")], example_inputs=(x,))
    raising(x)  # finite: raise mode must not raise


def test_raise_mode_gives_real_counts():
    class Overflow(nn.Module):
        def forward(self, x):
            return x * 1e30 * 1e30

    x = torch.ones(2, 3)
    x[0, 0] = -1
    dbg = fxdebug.instrument(Overflow(), [NaNCheck(mode="raise")], example_inputs=(torch.zeros(2, 3),))
    with pytest.raises(fxdebug.NonFiniteError, match=r"0 NaN and 6 Inf of 6 values"):
        dbg(x)


def test_reset_and_reinstrument_do_not_double_count():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    dbg(x)
    dbg.reset()
    dbg(x)
    assert dbg.report().row("fc")["calls"] == 1
    again = fxdebug.instrument(dbg, [NaNCheck()], example_inputs=(x,))
    again.reset()
    again(x)
    row = again.report().row("fc")
    assert row["calls"] == 1 and row["count"] == 20 and row["nonfinite_calls"] == 0


def test_meta_device_runs_without_data():
    model, (x,) = ZOO["residual_cnn"]()
    model.to("meta")
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x.to("meta"),))
    out = dbg(x.to("meta"))
    assert out.device.type == "meta" and dbg.report().rows


def test_gradient_statistics_come_from_the_same_op():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [NaNCheck(backward=True), StatCollector(grads=True)], example_inputs=(x,))
    taps = [n for n in _nodes(dbg) if n.op == "call_function" and n.target in (torch.ops.fxdebug.observe_grad.default,
                                                                                  torch.ops.fxdebug.observe_grad_many.default)]
    assert taps
    out = dbg(x)
    out.sum().backward()
    row = dbg.report().row("fc")
    assert row["grad_count"] == out.numel() and row["grad_mean"] == pytest.approx(1.0)
    assert row["grad_nonfinite_calls"] == 0


def test_fallback_is_chosen_and_reported_without_the_kernel(tmp_path):
    code = (
        "import torch, fxdebug\n"
        "from fxdebug.passes import NaNCheck, StatCollector\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "x = torch.randn(2, 4)\n"
        "dbg = fxdebug.instrument(m, [NaNCheck(backward=True), StatCollector(grads=True)], example_inputs=(x,))\n"
        "dbg(x).sum().backward()\n"
        "r = dbg.report()\n"
        "print(fxdebug.runtime.backend())\n"
        "print(r.row('_1')['count'], any('pure-torch' in n for n in r.notes), r.row('_1')['grad_count'])\n"
        "from fxdebug.runtime.kernel import tick_op\n"
        "with torch.no_grad():\n"
        "    dbg(x)\n"
        "c = list(dbg.parts().values())[-1]._clock()\n"  # a live module: the no_grad call's own capture
        "print(tick_op() is None, int(c.table[0]) == c.calls - 1 >= 0)\n"  # the clock ticks through a view of slot 0
    )
    env = dict(os.environ, FXDEBUG_NO_KERNEL="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "8", "True", "8", "True", "True"]


def test_native_kernel_is_in_use_here():
    # g++ and torch's headers are on the machines this project is built on: the C++ kernel loads.
    assert backend() == "c++"


@pytest.mark.cuda
def test_cuda_matches_cpu():
    for _, make, cdim, channels in CASES:
        x = make()
        table = init_table(2 + -(-channels // K), [(2 * K, channels)] if channels else [], "cuda")
        table[0] = 0
        observe_op()(x.cuda(), table, 0, 2 * K if channels else 0, channels, cdim)
        cpu = init_table(2 + -(-channels // K), [(2 * K, channels)] if channels else [], "cpu")
        cpu[0] = 0
        observe_op()(x, cpu, 0, 2 * K if channels else 0, channels, cdim)
        torch.testing.assert_close(table.cpu(), cpu, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.cuda
def test_cuda_record_mode_never_syncs():
    model, (x,) = ZOO["residual_cnn"]()
    model.cuda()
    x = x.cuda()
    dbg = fxdebug.instrument(model, [NaNCheck(backward=True), StatCollector(grads=True)], example_inputs=(x,))
    dbg(x)
    torch.cuda.set_sync_debug_mode("error")
    try:
        dbg(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert dbg.report().row("fc")["calls"] == 2


def test_a_users_fused_probe_shares_the_one_read():
    class MeanAbs(fxdebug.authoring.FusedProbe):
        key = "mean-abs"
        columns = (fxdebug.Column("l1_mean"),)

        def summary_from(self, stats, phase):
            return {"l1_mean": stats.abs / stats.count if stats.count else None}

    @fxdebug.graph_pass(name="mean-abs", observe_only=True)
    def mean_abs(gm, ctx):
        return fxdebug.PassResult(gm, added=[ctx.observe(n, MeanAbs()) for n in ctx.nodes(gm, float_outputs=True)])

    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [mean_abs, StatCollector()], example_inputs=(x,))
    parts = dbg.parts().values()
    assert not [n for p in parts for n in p.graph.nodes
                if n.op == "call_module" and isinstance(p.get_submodule(str(n.target)), fxdebug.authoring.Observer)]
    dbg(x)
    row = dbg.report().row("fc")
    with torch.no_grad():
        ref = model(x)
    assert row["l1_mean"] == pytest.approx(float(ref.abs().double().mean()), rel=1e-6)
    assert row["l1_mean"] == pytest.approx(row["mean_abs"])


def test_the_clock_advances_through_one_cached_view():

    model, (x,) = ZOO["transformer_block"]()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,))
    with torch.no_grad():
        dbg(x)
        clock = list(dbg.parts().values())[-1]._clock()  # a live module: the no_grad call's own capture
        cached = clock._tick
        dbg(x)
    # the table is a view of a 2-D tensor: a test on ``view._base`` never matched, so a new view
    # (and an nn.Module setattr) was made on every call
    assert cached is not None and clock._tick is cached
    assert clock.table is not None and int(clock.table[0]) == clock.calls - 1


def test_the_clock_ticks_through_the_cpp_op():
    from fxdebug.runtime.kernel import tick_op

    op = tick_op()
    assert op is not None  # the C++ build is there (test_native_kernel_is_in_use_here)
    table = init_table(3, [], "cpu")
    before = table.clone()
    version = table._version
    for _ in range(3):
        op(table)
    assert table[0] == before[0] + 3 and torch.equal(table[1:], before[1:])  # slot 0 only
    assert table._version > version  # as an in-place add would: readers keyed on _version see the change
    for t in (torch.zeros(4, dtype=torch.float32), torch.zeros(8, dtype=torch.float64)[2:]):  # other dtypes, an offset view
        op(t)
        assert t.tolist()[0] == 1.0 and not any(t.tolist()[1:])
    op(torch.zeros(4, dtype=torch.float64, device="meta"))  # statistics kept on meta: no data, no error

    model, (x,) = ZOO["functional_ops"]()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,))
    dbg.reset()
    with torch.no_grad():
        for _ in range(4):
            out = dbg(x)
        ref = model(x)
    clock = list(dbg.parts().values())[-1]._clock()  # a live module: the no_grad calls' own capture
    assert torch.equal(out, ref)
    assert clock.calls == 4 and int(clock.table[0]) == 3
    assert dbg.report().row("fc")["count"] == 4 * ref.numel()
    before = clock._host_calls
    clock.forward(x)  # the eager path keeps its host count in the instance dict, with no nn.Module setattr
    assert clock.__dict__["_host_calls"] == before + 1 and int(clock.table[0]) == 4
