"""Several threads calling one instrumented module: statistics stay exact (counts, sums, extremes)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector

THREADS, CALLS = 4, 300


def test_statistics_are_correct_under_threads() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    dbg = fxdebug.instrument(model, passes=[StatCollector(), NaNCheck()], example_inputs=(torch.randn(2, 8),))
    inputs = [torch.randn(2, 8, generator=torch.Generator().manual_seed(t)) for t in range(THREADS)]
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(x: torch.Tensor) -> None:
        try:
            start.wait()
            with torch.no_grad():
                for _ in range(CALLS):
                    dbg(x)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    row = dbg.report().row("_0")
    with torch.no_grad():
        outs = torch.cat([model[0](x) for x in inputs])
    assert row["calls"] == THREADS * CALLS and row["count"] == THREADS * CALLS * 16
    assert dbg.report().calls == THREADS * CALLS
    assert row["mean"] == pytest.approx(float(outs.double().mean()), rel=1e-5, abs=1e-6)
    assert row["min"] == pytest.approx(float(outs.min())) and row["max"] == pytest.approx(float(outs.max()))
    assert row["nonfinite_calls"] == 0
