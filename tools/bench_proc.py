"""Fresh-process measurement for the benchmarks in tools/: run a script's one-row mode, read its JSON line.

Start-up and memory figures only mean something in a process that has not imported or compiled anything yet,
so each row of ``bench_startup``, ``bench_scale`` and ``bench_instrument_memory`` is its own process (one thread);
this is the one place that spawns it and turns a failure or a time-out into a row that says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["load_average", "run_json"]


def run_json(script: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> dict[str, Any]:
    """``python script *args`` in a fresh one-thread process from the repository root; its last stdout line as
    JSON, or ``{"error": ...}`` with the last line of stderr (or the time-out) when it did not finish."""
    try:
        done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_average() -> str:
    """The machine's 1/5/15-minute load averages, printed beside every table (a shared machine's figures need it)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
