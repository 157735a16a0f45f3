"""instrument() with a big example batch holds what one training forward holds, not twice that (issue 35 B16).

The figures come from ``tools/bench_instrument_memory.py`` in a fresh process (the resident high-water
mark of each call above the resident size before it, Linux only). The MLP's activations kept for
backward are ~130 MiB: an ``instrument()`` that kept the example call's activations (or its output's
autograd graph) alive while it ran another pass over the batch, or copied the batch per pass, would
reach twice the forward's peak; one copy of the input and Dynamo's bookkeeping stay well below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "tools", "bench_instrument_memory.py")


def _peaks(frontend: str) -> dict:
    done = subprocess.run([sys.executable, BENCH, "--one", frontend, "mlp", "4096", "2048"], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's resettable resident high-water mark")
@pytest.mark.parametrize("frontend", ["dynamo", "symbolic"])
def test_instrument_with_a_big_batch_peaks_near_one_forward(frontend: str) -> None:
    r = _peaks(frontend)
    forward = r["forward"]
    assert forward is not None and forward > 100, r  # the activations dominate, or the test measures nothing
    assert r["frontend"] == frontend
    # one forward's activations + one copy of the input + a fixed allowance for the capture's own objects
    allowance = forward + r["input_mib"] + 48
    assert r["instrument"] <= allowance, r
    assert r["instrumented call"] <= forward * 1.15 + 16, r  # the instrumented call keeps what the model keeps
