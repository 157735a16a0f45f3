"""The pure-torch observation path (``FXDEBUG_KERNEL=torch``, and devices without a native
kernel): few aten ops per call, no host sync, and the C++ kernel's numbers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxdebug.runtime.fallback import observe_many_torch, observe_torch
from fxdebug.runtime.kernel import observe_many_op, observe_op
from fxdebug.runtime.slots import INDEX, K, init_table

MAX_OPS = 19  # every aten op the dispatcher sees, views included (the old path issued 71-78, then 22)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops(x, channels=0, cdim=1):
    table = init_table(2 + -(-channels // K), [(2 * K, channels)] if channels else [], "cpu")
    observe_torch(x, table, 0, 2 * K if channels else 0, channels, cdim)  # constants are made on the first call
    with _Ops() as mode:
        observe_torch(x, table, 0, 2 * K if channels else 0, channels, cdim)
    return mode.ops


def test_a_call_issues_few_aten_ops_and_no_sync():
    ops = _ops(torch.randn(2, 8, 6, 6))
    assert len(ops) <= MAX_OPS, ops
    assert not any("local_scalar_dense" in o or "item" in o for o in ops)  # nothing read back to the host
    with_channels = _ops(torch.randn(2, 8, 6, 6), channels=8)
    assert len(with_channels) <= MAX_OPS + 3, with_channels


def _poisoned():
    x = torch.randn(3, 4, 5)
    x[0, 1, 2], x[2, 2, 0], x[1, 0, 4] = math.nan, math.inf, -math.inf
    return x


CASES = {
    "plain": (lambda: torch.randn(4, 8, 5, 5), 8, 1),
    "last_dim": (lambda: torch.randn(3, 7, 33), 33, -1),
    "nonfinite": (_poisoned, 4, 1),
    "inf_only": (lambda: torch.tensor([1.0, math.inf, -2.0, 0.0]), 0, 0),
    "neg_inf_max": (lambda: torch.full((5,), -math.inf), 0, 0),
    "f32_overflow": (lambda: torch.randn(5, 400) * 1e30, 5, 0),
    "float64_huge": (lambda: torch.randn(3, 500, dtype=torch.float64) * 1e200, 3, 0),
    "half": (lambda: torch.randn(4, 300).half(), 4, 0),
    "mismatch": (lambda: torch.randn(4, 5), 7, 1),
    "empty": (lambda: torch.randn(0, 3), 3, 1),
    "integer": (lambda: torch.arange(12).view(3, 4), 4, 1),
}


def _run(fn, x, channels, cdim, calls=3):
    table = init_table(2 + -(-channels // K), [(2 * K, channels)] if channels else [], "cpu")
    for call in range(calls):
        table[0] = call
        fn(x, table, 0, 2 * K if channels else 0, channels, cdim)
    return table


@pytest.mark.parametrize("case", list(CASES))
def test_torch_path_matches_the_cpp_kernel(case):
    make, channels, cdim = CASES[case]
    x = make()
    ours, native = _run(observe_torch, x, channels, cdim), _run(observe_op(), x, channels, cdim)
    torch.testing.assert_close(ours, native, rtol=1e-6, atol=1e-9, equal_nan=True)


def test_nonfinite_calls_are_counted_once_and_dated():
    x = _poisoned()
    t = init_table(1, [], "cpu")
    for call, value in enumerate([torch.ones(3), x, torch.ones(3), x]):
        t[0] = call
        observe_torch(value, t, 0, 0, 0, 0)
    row = t[K: 2 * K]
    assert row[INDEX["bad_calls"]] == 2 and row[INDEX["first_bad"]] == 1
    assert row[INDEX["nan"]] == 2 and row[INDEX["inf"]] == 4 and math.isnan(row[INDEX["min"]])


def test_batched_calls_match():
    xs = [torch.randn(3, 4), _poisoned(), torch.zeros(0), torch.randn(6)]
    args = [a for i in range(len(xs)) for a in (i, 0, 0, 0)]
    tables = []
    for fn in (observe_many_torch, observe_many_op()):
        t = init_table(len(xs), [], "cpu")
        fn(xs, t, args)
        tables.append(t)
    torch.testing.assert_close(tables[0], tables[1], rtol=1e-6, atol=1e-9, equal_nan=True)
