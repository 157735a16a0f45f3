"""Two CPU processes over gloo: DDP and FSDP2 over instrumented modules, merged reports, a failing rank.

Each test spawns two ranks of tests/dist_worker.py the way torchrun does (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment, a free port per run), waits with a deadline, and
always kills and reaps both processes. The ranks run several scenarios per spawn, since starting
Python with torch is most of the cost.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxdebug

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
DEADLINE = 240  # seconds for a whole spawn on a loaded 2-core CI machine; the ranks' own timeouts are far lower

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(scenarios: str, out: Path, world: int = 2, timeout: float = 20.0) -> tuple[list[dict], list[int], str]:
    """Run ``scenarios`` on ``world`` ranks; returns each rank's results, exit codes and their output.

    The free port is only free when chosen: if another process took it first, start once more.
    """
    results, codes, text = _spawn_once(scenarios, out, world, timeout)
    if any(codes) and "address already in use" in text.lower():
        results, codes, text = _spawn_once(scenarios, out, world, timeout)
    return results, codes, text


def _spawn_once(scenarios: str, out: Path, world: int, timeout: float) -> tuple[list[dict], list[int], str]:
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "FXDEBUG_TEST_TIMEOUT": str(timeout), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = []
    logs = [out / f"log{r}.txt" for r in range(world)]
    try:
        for r in range(world):
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen([sys.executable, str(WORKER), scenarios, str(out)],
                                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                              stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=DEADLINE) for p in procs]
    finally:
        for p in procs:  # always reaped, whatever happened
            if p.poll() is None:
                p.kill()
            p.wait()
    text = "\n".join(f"--- rank {r} ---\n{logs[r].read_text()}" for r in range(world))
    results = []
    for r in range(world):
        path = out / f"rank{r}.pt"  # read, then removed: a retry must not see this run's files
        results.append(torch.load(path, weights_only=False) if path.exists() else {})
        path.unlink(missing_ok=True)
    return results, codes, text


def _ok(result: dict, name: str, log: str) -> dict:
    value = result.get(name)
    assert value is not None and "traceback" not in value, f"{name} failed:\n{(value or {}).get('traceback')}\n{log}"
    return value


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    results, codes, log = spawn("ddp,nan,collect,fsdp", out)
    assert codes == [0, 0], log
    return results, log


def test_ddp_over_instrumented_is_bitwise_plain_ddp(two_ranks):
    results, log = two_ranks
    for r in (0, 1):
        ddp = _ok(results[r], "ddp", log)
        assert ddp["bitwise"] and ddp["world"] == 2 and ddp["calls"] == 6 and ddp["origin"] is None


def test_tracing_ddp_unwraps_module(two_ranks):
    results, log = two_ranks
    ddp = _ok(results[0], "ddp", log)
    assert "DistributedDataParallel.module" in ddp["traced_notes"][0]
    assert ddp["traced_keys"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # the model's, no "module."


def test_merged_statistics_equal_statistics_of_concatenated_data(two_ranks):
    results, log = two_ranks
    r0, r1 = _ok(results[0], "ddp", log), _ok(results[1], "ddp", log)
    assert [r["node"] for r in r0["merged_rows"]] == [r["node"] for r in r1["merged_rows"]]
    for merged, a, b in zip(r0["merged_rows"], r0["local_rows"], r1["local_rows"]):
        if not a.get("count"):
            continue
        n = a["count"] + b["count"]
        assert merged["count"] == n
        mean = (a["count"] * a["mean"] + b["count"] * b["mean"]) / n
        assert merged["mean"] == pytest.approx(mean, rel=1e-12, abs=1e-15)
        assert merged["min"] == min(a["min"], b["min"]) and merged["max"] == max(a["max"], b["max"])
    # against the data itself: fxdebug.collect per rank over a DistributedSampler, merged == whole data set
    collected = _ok(results[0], "collect", log)
    assert collected["count"] == 20 * 8
    assert collected["mean"] == pytest.approx(collected["true_mean"], rel=1e-6)
    assert collected["std"] == pytest.approx(collected["true_std"], rel=1e-6)
    assert collected["min"] == collected["true_min"] and collected["max"] == collected["true_max"]
    assert collected["dead"] == collected["true_dead"]  # never positive on the whole data set
    other = _ok(results[1], "collect", log)
    assert other["count"] == 20 * 8 and other["dead"] == collected["dead"]
    assert {collected["local_dead"], other["local_dead"]} != {collected["true_dead"]}  # a rank alone would be wrong


def test_planted_nan_on_rank_1_is_named_with_rank_and_call(two_ranks):
    results, log = two_ranks
    for r in (0, 1):
        nan = _ok(results[r], "nan", log)
        assert nan["origin"] == fxdebug.report.distributed.Origin(call=2, rank=1, node="sqrt", module="")
        assert nan["first"] == "sqrt"
        # rank 0 alone sees the NaN only one call later, after the all-reduce spread NaN weights
        assert nan["per_rank"][0]["first_nonfinite"] == "fc1" and nan["per_rank"][1]["first_nonfinite"] == "sqrt"


def test_fsdp2_fully_shard_over_instrumented_module(two_ranks):
    results, log = two_ranks
    for r in (0, 1):
        fsdp = _ok(results[r], "fsdp", log)
        assert fsdp["bitwise"] and fsdp["losses"]
        assert fsdp["count"] == 2 * 3 * 4 * 8  # two ranks, three steps, batch 4, 8 features at fc1


def test_a_rank_failing_mid_step_gives_the_other_a_clear_error(tmp_path):
    results, codes, log = spawn("fail", tmp_path, timeout=20.0)
    assert codes[1] == 3 and results[1].get("exit")
    assert codes[0] == 0, log
    fail = results[0]["fail"]
    assert fail["step_error"] is not None  # DDP's all-reduce in rank 0's backward failed, it did not hang
    assert fail["type"] == "DistributedError", fail
    # gloo either names the rank that missed the barrier or reports the connection it closed when it died
    assert "rank 0: not every rank reached the merge" in fail["error"]
    assert "Ranks 1 failed" in fail["error"] or "onnection" in fail["error"], fail["error"]


def test_merge_rules_without_processes():
    """The row merge itself: parallel variance, global extremes, summed counts, and the declared merge
    rules (StatCollector's dead fraction from per-channel maxima; unknown without them, never guessed)."""
    from fxdebug.passes.nan_check import nonfinite_columns
    from fxdebug.passes.stat_collector import stats_columns
    from fxdebug.report.distributed import _merge_rows
    from fxdebug.runtime.columns import resolve_columns

    columns = resolve_columns([*stats_columns(True), *nonfinite_columns(False)])

    a = torch.randn(100, dtype=torch.float64)
    b = torch.randn(37, dtype=torch.float64) * 3 + 1
    row = lambda t: {"node": "n", "module": "", "op": "x", "count": t.numel(), "calls": 1, "mean": float(t.mean()),  # noqa: E731
                     "std": float(t.std(unbiased=False)), "min": float(t.min()), "max": float(t.max()),
                     "zero_frac": 0.0, "nan": 0, "dead_frac": 0.5, "nonfinite_first_call": None,
                     "nonfinite_calls": 1 if t is a else 0}
    (merged,), notes = _merge_rows([[row(a)], [row(b)]], columns=columns)
    both = torch.cat([a, b])
    assert merged["count"] == 137 and merged["calls"] == 2
    assert merged["mean"] == pytest.approx(float(both.mean()), rel=1e-12)
    assert merged["std"] == pytest.approx(float(both.std(unbiased=False)), rel=1e-12)
    assert merged["min"] == float(both.min()) and merged["max"] == float(both.max())
    assert merged["dead_frac"] is None and any("chan_max" in n for n in notes)
    assert merged["nonfinite_calls"] == 1  # a NONFINITE column sums by its role
    with_chan = [[{**row(a), "chan_max": [1.0, -1.0, 0.0]}], [{**row(b), "chan_max": [-2.0, 3.0, 0.0]}]]
    (merged,), _ = _merge_rows(with_chan, columns=columns)
    assert merged["dead_frac"] == pytest.approx(1 / 3)  # only the channel never positive on either rank
    assert not math.isnan(merged["std"])


def test_all_ranks_needs_an_initialised_group():
    dbg = fxdebug.instrument(torch.nn.Linear(2, 2), [], example_inputs=(torch.randn(1, 2),))
    with pytest.raises(fxdebug.UsageError, match="init_process_group"):
        dbg.report(all_ranks=True)


def test_tracing_dataparallel_unwraps_module_without_processes():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(2, 3)
    dbg = fxdebug.instrument(torch.nn.DataParallel(model), [], example_inputs=(x,))
    assert "DataParallel.module (Sequential)" in dbg.trace_info.notes[0]
    assert list(dbg.state_dict()) == list(model.state_dict())
    assert torch.equal(dbg(x), model(x))


def test_origin_order_is_call_then_rank_then_execution_order():
    from fxdebug.report.distributed import Origin, _origin

    ranks = [
        {"rank": 0, "fwd": (5, "fc1", 0, "fc1"), "bwd": (1, "fc1", 0, "fc1")},
        {"rank": 1, "fwd": (3, "log", 4, "head"), "bwd": (1, "log", 4, "head")},
        {"rank": 2, "fwd": (3, "add", 2, ""), "bwd": None},
        {"rank": 3, "fwd": None, "bwd": (1, "add", 2, "")},
    ]
    assert _origin(ranks, "fwd", reverse=False) == Origin(3, 1, "log", "head")  # call 3 beats 5; rank 1 beats 2
    assert _origin(ranks, "bwd", reverse=True) == Origin(1, 0, "fc1", "fc1")  # same call: lowest rank first
    same_rank = [{"rank": 0, "fwd": (2, "b", 7, "")}, {"rank": 0, "fwd": (2, "a", 3, "")}]
    assert _origin(same_rank, "fwd", reverse=False).node == "a"
    assert str(Origin(2, 1, "sqrt")) == "call 2, rank 1, node 'sqrt'"


def test_channel_maxima_copies_each_state_table_once(monkeypatch):
    # The merge was quadratic: channel_maxima copied the whole state table to the host once per node.
    from torch import nn

    from fxdebug.passes import StatCollector
    from fxdebug.report.distributed import channel_maxima
    from fxdebug.runtime.observer import Clock

    model = nn.Sequential(*[m for _ in range(30) for m in (nn.Linear(4, 4), nn.ReLU())])
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(torch.randn(2, 4),))
    dbg(torch.randn(2, 4))
    copies = []
    host_table = Clock.host_table
    monkeypatch.setattr(Clock, "host_table", lambda self: copies.append(id(self)) or host_table(self))
    maxima = channel_maxima(dbg)
    assert len(maxima) >= 30 and all(len(v) == 4 for v in maxima.values())  # per-channel maxima of many nodes
    assert len(copies) == len(set(copies)) >= 1  # one copy per table (here: per captured part), not per node
