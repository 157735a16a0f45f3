"""The report table: ``report.table(cols=...)``, fitting a width, dead_frac only after activations."""

from __future__ import annotations

import pytest

import fxdebug
from fxdebug.passes import StatCollector
from zoo import ZOO


@pytest.fixture
def report():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    dbg(x)
    return dbg.report()


def _header(text):
    return next(line for line in text.splitlines() if line.startswith("node")).split()


def test_cols_picks_columns_in_order(report):
    text = report.table(cols=["node", "max", "dead_frac"])
    assert _header(text) == ["node", "max", "dead_frac"]
    assert len(text.splitlines()) >= len(report.rows) + 2
    with pytest.raises(fxdebug.UsageError, match="no column 'maxx'"):
        report.table(cols=["node", "maxx"])


def test_width_drops_trailing_columns_and_says_so(report):
    wide = _header(report.table())
    text = report.table(width=60)
    narrow = _header(text)
    assert narrow == wide[: len(narrow)] and len(narrow) < len(wide) and narrow[:3] == ["node", "module", "op"]
    body = [line for line in text.splitlines() if not line.startswith(("fxdebug report", "note:", "("))]
    assert max(len(line) for line in body) <= 60 or len(narrow) == 3
    assert f"({len(wide) - len(narrow)} more column(s) to fit the terminal: {', '.join(wide[len(narrow):])}" in text


def test_dead_frac_only_on_activation_rows(report):
    # the block's functional relu: `relu` in a symbolic graph, `layer1_0_relu` in Dynamo's
    relu = next(r["node"] for r in report.rows if r["module"] == "layer1.0" and r["op"].endswith("relu"))
    lines = report.table(cols=["node", "op", "dead_frac"]).splitlines()
    cells = {line.split()[0]: line.split()[-1] for line in lines if line.split() and line.split()[0] in
             {"stem_0", "stem_2", "layer1_0_bn1", relu}}
    assert cells["stem_0"] == "-" and cells["layer1_0_bn1"] == "-"  # conv / batch-norm: no dead units
    assert cells["stem_2"] != "-" and cells[relu] != "-"
    assert report.row("stem_0").get("dead_frac") is not None  # the number stays in the rows and DataFrame
