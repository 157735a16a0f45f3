"""Report: rows, JSON, DataFrame, text table (rich and plain), auto-leaves; docs/observe.md runs."""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from fxdebug.report.table import format_report
from zoo import ZOO

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "observe.md"


def _report():
    model, (x,) = ZOO["control_flow"]()
    # a report with an auto-leaf (gate) and its row: symbolic tracing's (Dynamo has no leaves; it sees gate's ops)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    dbg(x)
    bad = x.clone()
    bad[0, 0] = math.nan
    dbg(bad)
    return dbg.report()


def test_rows_json_and_origin():
    report = _report()
    names = [r["node"] for r in report.rows]
    assert names == ["x", "pre", "gate", "relu", "post"]
    assert report.first_nonfinite == "x" and report.calls == 2
    row = report["pre"]
    for key in ("node", "module", "op", "shape", "dtype", "device", "mean", "std", "dead_frac", "nonfinite_calls"):
        assert key in row
    assert row["shape"] == (3, 8) and row["dtype"] == "float32" and row["device"] == "cpu"
    data = json.loads(report.to_json())
    assert data["first_nonfinite"] == "x" and data["rows"][1]["node"] == "pre"
    assert data["rows"][1]["mean"] == "nan"  # non-finite floats survive JSON as strings
    assert "gate" in data["auto_leaves"]


def test_dataframe():
    pd = pytest.importorskip("pandas")
    df = _report().to_dataframe()
    assert isinstance(df, pd.DataFrame) and list(df["node"]) == ["x", "pre", "gate", "relu", "post"]


@pytest.mark.parametrize("use_rich", [False, None])
def test_text_table_lists_origin_and_auto_leaves(use_rich):
    if use_rich is None:
        pytest.importorskip("rich")
    text = format_report(_report(), use_rich=use_rich)
    assert "NaN/Inf origin (forward): 'x'" in text
    assert re.search(r"auto-leaf: gate \(DataDependentGate\): .*zoo\.py:\d+", text)
    header = next(line for line in text.splitlines() if line.lstrip().startswith("node"))
    assert "mean" in header and "dead_frac" in header
    assert any(line.lstrip().startswith("post") for line in text.splitlines())
    assert "\x1b[" not in text


def test_observe_doc_runs():
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0].replace("print(report)", "str(report)")
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)
    assert isinstance(scope["report"], fxdebug.Report) and scope["report"].calls == 3
    assert scope["report"]["fc"]["grad_norm"] > 0
