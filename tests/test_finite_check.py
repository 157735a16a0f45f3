"""``fxdebug::any_nonfinite``: the guard's read-only, exact gradient check (C++ extension, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fxdebug
from fxdebug.runtime import kernel
from syncs import CountSyncs

OP = kernel.any_nonfinite_op()
needs_op = pytest.mark.skipif(OP is None, reason=f"the C++ extension is not built: {kernel.fallback_reason()}")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128]
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_bits(dtype: torch.dtype, n: int, seed: int, bad_rate: float) -> torch.Tensor:
    """``n`` elements of ``dtype`` with random bits (every sign, exponent and payload), the exponent
    forced off all-ones except at a ``bad_rate`` fraction of places (so both answers occur)."""
    real = dtype.to_real() if dtype.is_complex else dtype
    ints = _INTS[torch.finfo(real).bits // 8]
    gen = torch.Generator().manual_seed(seed)
    m = n * (2 if dtype.is_complex else 1)
    bits = torch.randint(torch.iinfo(ints).min, torch.iinfo(ints).max, (m,), dtype=ints, generator=gen)
    x = bits.view(real)
    finite = torch.isfinite(x) | (torch.rand(m, generator=gen) < bad_rate)
    repl = torch.randn(m, generator=gen).to(real) * 1e3
    x = torch.where(finite, x, repl)
    return torch.view_as_complex(x.view(n, 2)) if dtype.is_complex else x


def check(xs: list[torch.Tensor], flag: float = 0.0) -> float:
    f = torch.full((), flag)
    OP(xs, f)
    return float(f)


def expected(xs: list[torch.Tensor]) -> bool:
    return any(bool((~torch.isfinite(x)).any()) for x in xs if x.numel())


@needs_op
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_bit_patterns_of_every_dtype_match_isfinite_and_are_never_written(dtype: torch.dtype) -> None:
    sizes = [0, 1, 7, 33, 4095, 4096, 4097, 9000]  # empty, vector tails, chunk borders
    for seed in range(12):
        rate = (0.0, 1e-4, 1e-3)[seed % 3]
        xs = [random_bits(dtype, n, 100 * seed + i, rate) for i, n in enumerate(sizes)]
        views = [xs[-1].view(90, 100).t(), xs[-1][::3], xs[-2].view(-1)[1:4001].view(40, 100)[:, ::2]]  # non-contiguous
        kept = [x.clone() for x in xs]  # the views below share these tensors' memory
        for group in (xs, views, xs[:3], [xs[seed % len(xs)]]):
            f = torch.zeros(())
            with CountSyncs() as counter:
                OP(group, f)
            assert float(f) == float(expected(group)), (dtype, seed, [tuple(x.shape) for x in group])
            assert counter.syncs == 0
        for a, b in zip(kept, xs):  # bit for bit: only read
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)) if a.numel() else b.numel() == 0


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_exact_every_nan_payload_and_inf_counts_large_finite_zero_and_subnormals_do_not(dtype: torch.dtype) -> None:
    fi = torch.finfo(dtype)
    fine = torch.tensor([fi.max, -fi.max, 0.0, -0.0, fi.tiny, fi.tiny / 4, -fi.tiny / 4, fi.eps, 1.0], dtype=dtype)
    assert fine.isfinite().all() and check([fine.repeat(1000)]) == 0.0
    ints = _INTS[fi.bits // 8]
    man = {torch.float32: 23, torch.float64: 52, torch.float16: 10, torch.bfloat16: 7}[dtype]
    exp_bits = (1 << (fi.bits - 1 - man)) - 1
    gen = torch.Generator().manual_seed(1)
    for sign in (0, 1):
        for payload in [0, 1, 2, (1 << man) - 1, 1 << (man - 1)] + [int(v) for v in torch.randint(0, 1 << min(man, 30), (8,), generator=gen)]:
            word = (sign << (fi.bits - 1)) | (exp_bits << man) | payload  # +/-Inf (payload 0) or a NaN
            if word >= 1 << (fi.bits - 1):
                word -= 1 << fi.bits  # the signed integer of the same bits
            x = fine.repeat(513).view(ints).clone()
            x[2000] = word
            bad = x.view(dtype)
            assert not bool(bad[2000].isfinite()), (dtype, sign, payload)
            assert check([fine, bad]) == 1.0, (dtype, sign, payload)


@needs_op
def test_the_flag_is_only_ever_set_and_other_inputs_are_taken() -> None:
    assert check([torch.randn(10)], flag=1.0) == 1.0  # an earlier finding stays
    assert check([torch.randn(10)], flag=0.0) == 0.0
    assert check([]) == 0.0
    assert check([torch.arange(10), torch.ones(3, dtype=torch.bool)]) == 0.0  # integers: always finite
    f64 = torch.zeros(1, dtype=torch.float64)
    OP([torch.tensor([float("inf")])], f64)
    assert float(f64) == 1.0
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([1.0, float("nan")]), (5,), check_invariants=True)
    assert check([sparse]) == 1.0 and check([sparse.to_dense().nan_to_num()]) == 0.0
    if hasattr(torch, "float8_e4m3fn"):
        f8 = torch.tensor([1.0, float("nan"), 2.0]).to(torch.float8_e4m3fn)
        assert check([f8]) == 1.0 and check([f8[::2]]) == 0.0
    with pytest.raises(RuntimeError, match="one-element floating"):
        OP([torch.randn(3)], torch.zeros(2))


@needs_op
def test_large_tensors_split_across_threads_still_find_one_bad_element() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(1 << 20)
        assert check([x]) == 0.0
        for at in (0, (1 << 18) + 5, (1 << 20) - 1):
            y = x.clone()
            y[at] = -float("inf")
            assert check([y]) == 1.0 and check([y.view(1024, 1024).t()]) == 1.0
    finally:
        torch.set_num_threads(threads)


@needs_op
def test_the_guard_checks_cpu_gradients_with_it_and_falls_back_to_the_amp_op_without(monkeypatch: Any) -> None:
    def run() -> tuple[Any, list[str]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        g = fxdebug.guard(torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True))
        ops: list[str] = []

        class Ops(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                ops.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        for x in (torch.randn(2, 4), torch.tensor([[float("nan"), 0, 0, 0]]), torch.randn(2, 4)):
            w = model.weight.detach().clone()
            model(x).sum().backward()
            with Ops():
                g.step()
            g.zero_grad()
        return g, ops

    g, ops = run()
    assert "any_nonfinite" in ops and "_amp_foreach_non_finite_check_and_unscale_" not in ops
    assert int(g.skipped) == 1
    monkeypatch.setattr(kernel, "any_nonfinite_op", lambda: None)  # as without the C++ build
    g, ops = run()
    assert "any_nonfinite" not in ops and "_amp_foreach_non_finite_check_and_unscale_" in ops
    assert int(g.skipped) == 1


@pytest.mark.slow  # a fresh process (~5-15 s): the monkeypatched test above covers the fallback in CI
def test_without_the_extension_the_guard_still_skips_a_nan_step() -> None:
    code = (
        "import torch, fxdebug\n"
        "from fxdebug.runtime import kernel\n"
        "assert kernel.any_nonfinite_op() is None\n"
        "m = torch.nn.Linear(3, 2); g = fxdebug.guard(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))\n"
        "for bad in (False, True, False):\n"
        "    m(torch.randn(2, 3)).sum().backward()\n"
        "    if bad: m.bias.grad[1] = -float('inf')\n"
        "    w = m.weight.detach().clone(); g.step(); g.zero_grad()\n"
        "    assert torch.equal(w, m.weight) == bad\n"
        "print(int(g.skipped))\n")
    env = {**os.environ, "FXDEBUG_NO_KERNEL": "1", "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "1"
