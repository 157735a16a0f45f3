"""The live capture at scale (issue 33): work per captured graph that does not grow with the model.

A live capture with regional capture on (``FXDEBUG_REGIONS=1``) has a part per repeated block, and every
part shares the whole model's modules. Per-part work that walks the model, or everything learnt from
the parts before it, makes ``instrument()`` and ``report()`` quadratic in the model's depth. These tests
count the Python and C calls one part's pass run and one part's report make, in a model of 4 blocks and
in one of 10: the same block, the same count. The figures live in tools/bench_scale.py and
docs/performance.md.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import pytest
import torch
from torch import nn

import fxdebug
import fxdebug.report.report as report_module
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(self.act(self.fc1(x))))


def _model(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(blocks)])


def _counting(fn: Callable[..., Any], counts: list[int]) -> Callable[..., Any]:
    """``fn``, with the number of calls (Python and C) each of its calls made appended to ``counts``."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        made = [0]

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event in ("call", "c_call"):
                made[0] += 1

        old = sys.getprofile()
        sys.setprofile(profile)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(old)
            counts.append(made[0])

    return wrapped


def _per_part(monkeypatch: pytest.MonkeyPatch, blocks: int) -> tuple[list[int], list[int], Any]:
    """Calls made by ShapeAssert's run and by the report of each part, for a model of ``blocks`` blocks."""
    runs: list[int] = []
    reports: list[int] = []
    monkeypatch.setattr(ShapeAssert, "run", _counting(ShapeAssert.run, runs))
    monkeypatch.setattr(report_module, "_follow_dtype", _counting(report_module._follow_dtype, reports))
    model, x = _model(blocks), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], example_inputs=(x,),
                             frontend="dynamo")
    torch.testing.assert_close(dbg(x), model(x))
    report = dbg.report()
    monkeypatch.undo()
    return runs, reports, report


@pytest.fixture
def regions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXDEBUG_REGIONS", "1")


def test_a_parts_shape_assert_and_report_work_does_not_grow_with_the_model(regions: None,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXDEBUG_REGION_COPIES", "0")  # ShapeAssert run on every part (copies: test_region_copies.py)
    with pytest.MonkeyPatch.context() as mp:
        small_runs, small_reports, small = _per_part(mp, 4)
    with pytest.MonkeyPatch.context() as mp:
        large_runs, large_reports, large = _per_part(mp, 10)
    assert len(small_runs) == 4 and len(large_runs) == 10  # a part per block, ShapeAssert run on each
    # the last block's part (names of one length: blocks 3 and 9): as much work in a model of 10 blocks as in one of 4
    # (it walked every expectation the parts before it had learnt, and the report read every parameter of the model,
    # for each part)
    assert large_runs[-1] == small_runs[-1]
    assert large_reports[-1] == small_reports[-1]
    assert {r["module"] for r in large.rows} >= {f"{i}.fc2" for i in range(10)}  # each block keeps its rows


def test_the_dtype_column_follows_the_model_on_a_part_per_block(regions: None) -> None:
    model, x = _model(4), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="dynamo")
    assert len(dbg.parts()) == 4
    dbg.to(torch.float64)
    dbg(x.double())
    floats = {r["dtype"] for r in dbg.report().rows if r["dtype"]}
    assert floats == {"float64"}  # each part's rows follow the parameters that part reads


def test_no_collection_runs_inside_a_large_report() -> None:
    # a row per node, its columns and its summary: many objects, freed by none; the collector's sweeps over them (and
    # over the rest of a large model's heap) cost more than building them
    import gc

    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(4, 4) if i % 2 == 0 else nn.ReLU() for i in range(3000)]), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    dbg(x)
    runs: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.collect()
    gc.callbacks.append(seen)
    try:
        report = dbg.report()
    finally:
        gc.callbacks.remove(seen)
    assert runs in ([], [0])  # at most the one young collection on resuming (51, four of them older, unpaused)
    assert len(report.rows) == 3001 and report.first_nonfinite is None  # the input and every layer
