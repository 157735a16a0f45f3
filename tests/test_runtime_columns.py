"""Probe column declarations: a pass written only from docs/writing-passes.md gets its columns in
the report, the text table, the DataFrame, JSON and the picture, and first-origin detection."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from fxdebug.report.table import format_report
from zoo import ZOO

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-passes.md"


def _doc_pass() -> dict:
    """Run the "Declaring report columns" example exactly as the docs write it."""
    section = DOC.read_text().split("## Declaring report columns", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    ns: dict = {}
    torch.manual_seed(0)
    exec(compile(blocks[0].replace("print(", "_ = ("), "writing-passes.md", "exec"), ns)
    return ns


def test_doc_probe_gets_origin_detection_and_columns_everywhere(tmp_path):
    ns = _doc_pass()
    report = ns["report"]
    assert report.first_nonfinite == "log"  # no NaNCheck: the user's ORIGIN column alone found it
    assert report.nonfinite_nodes == ["log", "sum_1"] and not report.ok
    assert report.column("nan_calls").has(fxdebug.authoring.NONFINITE)
    header = next(line for line in format_report(report, use_rich=False).splitlines() if line.startswith("node"))
    assert "nan_calls" in header.split() and "nan_first" not in header  # hidden role kept out of the table
    data = json.loads(report.to_json())
    roles = {c["key"]: c["roles"] for c in data["columns"]}
    assert roles["nan_first"] == ["hidden", "origin"] and data["first_nonfinite"] == "log"
    svg = tmp_path / "m.svg"
    ns["dbg"].render(str(svg))
    assert "nan_calls" in svg.read_text()


def test_doc_probe_dataframe():
    pytest.importorskip("pandas")
    report = _doc_pass()["report"]
    df = report.to_dataframe()
    assert list(df.columns[:5]) == ["node", "module", "op", "shape", "dtype"]
    assert "nan_calls" in df.columns and df.attrs["fxdebug_columns"]["nan_first"]["roles"] == ["hidden", "origin"]
    assert list(df["nan_calls"]) == [0, 1, 1]


def test_builtin_passes_declare_their_columns():
    model, (x,) = ZOO["control_flow"]()
    dbg = fxdebug.instrument(model, [NaNCheck(backward=True), StatCollector(grads=True)], example_inputs=(x,))
    dbg(x).sum().backward()
    report = dbg.report()
    origin = {c.key for c in report.columns_with(fxdebug.authoring.ORIGIN)}
    assert origin == {"nonfinite_first_call", "grad_nonfinite_first_call"}
    assert [c.key for c in report.columns_with(fxdebug.authoring.COLOR)] == ["dead_frac"]
    assert report.column("grad_mean").phase == "grad" and report.column("mean").phase == "forward"


def test_column_rejects_unknown_role_and_phase():
    with pytest.raises(ValueError, match="unknown role"):
        fxdebug.Column("x", roles="colour")
    with pytest.raises(ValueError, match="phase"):
        fxdebug.Column("x", phase="backward")


def test_column_format_is_used_by_the_table():
    class Share(fxdebug.authoring.Probe):
        key = "share"
        columns = (fxdebug.Column("pos_share", format=".1%"),)

        def init_state(self, x, phase):
            return {"pos": torch.zeros((), device=x.device), "n": torch.zeros((), device=x.device)}

        def update(self, state, r, octx):
            state["pos"] += (r.x > 0).sum()
            state["n"] += r.x.numel()

        def summary(self, state, phase):
            return {"pos_share": float(state["pos"] / state["n"])}

    @fxdebug.graph_pass(name="share", observe_only=True)
    def share(gm, ctx):
        return fxdebug.PassResult(gm, added=[ctx.observe(n, Share()) for n in ctx.nodes(gm, float_outputs=True)])

    model = torch.nn.ReLU()
    x = torch.tensor([[1.0, -1.0, 2.0, -3.0]])
    dbg = fxdebug.instrument(model, [share], example_inputs=(x,))
    dbg(x)
    text = format_report(dbg.report(), use_rich=False)
    assert "50.0%" in text  # the ReLU output: 2 of 4 positive


# A user's probe's declarations: the share of |x| >= 0.99 (saturated tanh units), declared the way
# StatCollector declares its dead fraction.
SATURATION = (
    fxdebug.Column("saturated", roles=fxdebug.authoring.COLOR, threshold=0.5, label="saturated",
                   only=lambda row: "tanh" in str(row.get("op")), merge="max",
                   finding=fxdebug.authoring.FindingRule(
                       kind="saturated_units", message="{where}: {pct} of its outputs saturated.",
                       fix="scale its input down (a normalisation before {node}).", option="saturated")),
    fxdebug.Column("sat_calls", roles=fxdebug.authoring.HIDDEN, answers="saturation_calls",
                   reading=lambda rows: sum(r.get("sat_calls", 0) for r in rows)),
)


def test_a_users_declarations_drive_findings_table_merge_and_report_attributes():
    """The outputs read declarations only: a user's column gets the treatment StatCollector's dead
    fraction gets (only=, finding=, merge=, answers=) without fxdebug knowing its name."""
    from fxdebug.report.distributed import _merge_rows
    from fxdebug.runtime.columns import resolve_columns

    columns = resolve_columns(SATURATION)
    rows = [{"node": "tanh", "module": "", "op": "torch.tanh", "saturated": 0.8, "sat_calls": 2},
            {"node": "fc", "module": "fc", "op": "Linear", "saturated": 0.9, "sat_calls": 2}]
    report = fxdebug.Report(rows=rows, columns=columns)
    found = report.findings()
    assert [(f.kind, f.node) for f in found] == [("saturated_units", "tanh")]  # only= keeps fc out
    assert found[0].message.endswith("80% of its outputs saturated.") and "before tanh" in found[0].fix
    assert not report.findings(saturated=0.85)  # the rule's own threshold keyword
    with pytest.raises(fxdebug.UsageError, match="saturated"):
        report.findings(satruated=0.9)
    assert report.answer("saturation_calls") == 4
    cells = report.table(cols=["node", "saturated"]).splitlines()
    assert cells[-1].split() == ["fc", "-"]  # not shown where it does not apply
    (merged, _), notes = _merge_rows([[rows[0], rows[1]], [dict(rows[0], saturated=0.6), dict(rows[1])]],
                                     columns=columns)
    assert merged["saturated"] == 0.8 and not [n for n in notes if "saturated" in n]  # merge="max"
