"""The annotated SVG: what the report says is what the picture shows (labels, tooltips, colours),
instrumentation folds away, findings are highlighted, modules collapse at ``depth``."""

from __future__ import annotations

import importlib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.render.dot import COLORS, auto_depth, group_nodes
from fxdebug.render.view import build_view
from zoo import ZOO, MnistMismatch

render_module = importlib.import_module("fxdebug.render.draw")  # the attribute fxdebug.render is the function
SVG = "{http://www.w3.org/2000/svg}"
XLINK = "{http://www.w3.org/1999/xlink}"


# -- a tiny statistics probe, so these tests do not depend on the pass library -------------------
class StatsProbe(fxdebug.authoring.Probe):
    """Last call's mean/min/max, zero and dead fractions; calls that saw NaN/Inf and the first one."""

    key = "test-stats"
    columns = (fxdebug.Column("dead_frac", roles=fxdebug.authoring.COLOR, threshold=0.5, label="dead",
                              only=fxdebug.authoring.activation_row),
               fxdebug.Column("nonfinite_calls", roles=fxdebug.authoring.NONFINITE),
               fxdebug.Column("nonfinite_first_call", roles=(fxdebug.authoring.ORIGIN, fxdebug.authoring.HIDDEN)))

    def init_state(self, x, phase):
        z = torch.zeros((), device=x.device)
        return {"mean": z.clone(), "min": z.clone(), "max": z.clone(), "zero": z.clone(), "dead": z.clone(),
                "bad": z.clone(), "first": torch.full((), 10**9, device=x.device)}

    def update(self, state, r, ctx):
        n = max(r["numel"], 1)
        state["mean"].copy_(r["sum"] / n)
        state["min"].copy_(r["min"])
        state["max"].copy_(r["max"])
        state["zero"].copy_(1 - r["nonzero"] / n)
        chan = r["chan_max"]
        if chan is not None and "relu" in ctx.op.lower():  # dead channels only mean something after a ReLU
            state["dead"].copy_((chan <= 0).float().mean())
        bad = (r["nan"] + r["inf"]) > 0
        state["bad"].add_(bad.float())
        state["first"].copy_(torch.where(bad & (state["first"] > ctx.clock), ctx.clock, state["first"]))

    def summary(self, state, phase):
        first = int(state["first"])
        return {"mean": float(state["mean"]), "min": float(state["min"]), "max": float(state["max"]),
                "zero_frac": float(state["zero"]), "dead_frac": float(state["dead"]),
                "nonfinite_calls": int(state["bad"]), "nonfinite_first_call": None if first == 10**9 else first}


@fxdebug.graph_pass(name="test-stats", observe_only=True)
def stats_pass(gm, ctx):
    added = [ctx.observe(n, StatsProbe()) for n in ctx.nodes(gm, float_outputs=True)]
    return fxdebug.PassResult(gm, added=[a for a in added if a is not None])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.conv(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return torch.log(self.fc(x)) * 2


class Sick(nn.Module):
    """Dead channels in ``block.act`` (3 of 4), NaN from ``torch.log`` in ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = Head()
        with torch.no_grad():
            self.block.conv.bias.copy_(torch.tensor([-50.0, -50.0, -50.0, 0.5]))
            self.head.fc.bias.copy_(torch.tensor([5.0, -5.0]))

    def forward(self, x):
        return self.head(torch.flatten(self.block(x), 2).mean(-1))


def parse(path):
    """``{title: {"fill", "stroke", "text", "tooltip", "id"}}`` for every node of an SVG."""
    root = ET.parse(path).getroot()
    out = {}
    for g in root.iter(f"{SVG}g"):
        if g.get("class") != "node":
            continue
        title = g.find(f"{SVG}title").text
        shape = next(e for e in g.iter() if e.tag in (f"{SVG}path", f"{SVG}polygon", f"{SVG}ellipse"))
        link = next((e for e in g.iter(f"{SVG}a") if e.get(f"{XLINK}title")), None)
        out[title] = {"fill": shape.get("fill"), "stroke": shape.get("stroke"), "id": g.get("id"),
                      "text": [t.text or "" for t in g.iter(f"{SVG}text")],
                      "tooltip": link.get(f"{XLINK}title") if link is not None else ""}
    return out, root


@pytest.fixture
def sick(tmp_path):
    model = Sick()
    x = torch.randn(2, 3, 5, 5)
    # the picture's node names (log, block_act) are symbolic tracing's (Dynamo names them head_log, ...)
    dbg = fxdebug.instrument(model, [stats_pass], example_inputs=(x,), frontend="symbolic")
    dbg(x)
    dbg(x)
    path = dbg.render(str(tmp_path / "sick.svg"))
    return dbg, dbg.report(), path


def test_labels_and_tooltips_carry_the_report(sick):
    dbg, report, path = sick
    nodes, _ = parse(path)
    for row in report.rows:
        node = nodes[row["node"]]
        text = " ".join(node["text"])
        assert row["node"] in text
        assert "(" + ", ".join(map(str, row["shape"])) + ")" in text
        assert f"mean: {row['mean']!r}" in node["tooltip"]  # full precision in the tooltip
        assert f"dead_frac: {row['dead_frac']!r}" in node["tooltip"]
        assert f"module: {row['module'] or '<root>'}" in node["tooltip"]
    act = " ".join(nodes["block_act"]["text"])
    assert "dead 75%" in act and "ReLU" in act


def test_highlights_match_the_findings(sick):
    dbg, report, path = sick
    nodes, root = parse(path)
    assert report.first_nonfinite == "log"
    assert nodes["log"]["fill"] == COLORS["origin"]
    assert "NaN/Inf ORIGIN" in nodes["log"]["text"]
    assert nodes["mul"]["fill"] == COLORS["nonfinite"]  # downstream of the origin, saw NaN
    assert "NaN/Inf in 2 call(s)" in nodes["mul"]["text"]
    assert nodes["block_act"]["fill"] == COLORS["hot"]
    assert nodes["block_conv"]["fill"] == COLORS["op"]
    legend = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "NaN/Inf origin" in legend and "hot spot" in legend
    assert "failed a shape/device check" not in legend  # only findings that are present


def test_instrumentation_is_folded_unless_asked(sick, tmp_path):
    dbg, report, path = sick
    observers = [n.name for n in dbg.graph.nodes if fxdebug.authoring.is_instrumentation(n)]
    assert observers
    nodes, _ = parse(path)
    assert not set(observers) & set(nodes)
    assert "observed by: test-stats" in nodes["block_conv"]["tooltip"]
    shown, _ = parse(dbg.render(str(tmp_path / "all.svg"), show_instrumentation=True))
    assert set(observers) <= set(shown)
    assert all(shown[o]["fill"] == COLORS["instrumentation"] for o in observers)


def test_failed_check_is_highlighted(tmp_path):
    model, (x,) = ZOO["mnist_mismatch"]() if "mnist_mismatch" in ZOO else (MnistMismatch(), (torch.randn(2, 1, 28, 28),))
    with pytest.raises(fxdebug.ShapeMismatchError) as info:
        fxdebug.instrument(model, [], example_inputs=(x,))
    assert info.value.node == "fc1"
    nodes, _ = parse(fxdebug.render(model, tmp_path / "fail.svg", failed=info.value))
    assert nodes["fc1"]["fill"] == COLORS["failed"]
    assert "FAILED" in nodes["fc1"]["tooltip"] and "in_features=1440" in nodes["fc1"]["tooltip"]
    assert nodes["conv"]["fill"] == COLORS["op"]
    # A pass can mark a node itself through the metadata.
    gm = fxdebug.trace(model)
    fxdebug.authoring.fx_meta(next(n for n in gm.graph.nodes if n.name == "view"))["failed"] = "expected (N, 1000)"
    nodes, _ = parse(fxdebug.render(gm, tmp_path / "meta.svg"))
    assert nodes["view"]["fill"] == COLORS["failed"] and "expected (N, 1000)" in nodes["view"]["tooltip"]


@fxdebug.node_pass(name="leaky")
def leaky(node, ctx):
    if not fxdebug.authoring.is_relu(node):
        return None
    return ctx.replace_with_module(node, nn.LeakyReLU(0.1))


def test_transform_provenance_is_labelled(tmp_path):
    model = Sick()
    x = torch.randn(2, 3, 5, 5)
    gm = fxdebug.instrument(model, [leaky], example_inputs=(x,))
    changed = [n.name for n in gm.graph.nodes if fxdebug.authoring.fx_meta(n).get("changed_by")]
    assert len(changed) == 1
    nodes, _ = parse(fxdebug.render(gm, tmp_path / "t.svg"))
    node = nodes[changed[0]]
    assert "~ changed by leaky" in node["text"] and "LeakyReLU" in " ".join(node["text"])
    assert node["stroke"] == COLORS["changed"]
    assert "replaces ReLU (block_act)" in node["tooltip"]


def test_depth_collapses_the_right_modules(tmp_path):
    model, (x,) = ZOO["residual_cnn"]()
    gm = fxdebug.trace(model)
    nodes, root = parse(fxdebug.render(gm, tmp_path / "d1.svg", x, depth=1))
    groups = sorted(t for t in nodes if t.startswith("module/"))
    assert groups == ["module/layer1", "module/layer2", "module/stem"]
    assert "layer1_0_conv1" not in nodes and "pool" in nodes and "fc" in nodes
    members = [n.name for n in gm.graph.nodes if fxdebug.authoring.module_path(n).split(".")[0] == "layer2"]
    tip = nodes["module/layer2"]["tooltip"]
    assert all(f"{m} :" in tip for m in members)
    text = " ".join(nodes["module/layer2"]["text"])
    assert f"{len(members)} ops" in text and "in (2, 8, 16, 16)" in text and "out (2, 16, 8, 8)" in text

    nodes, root = parse(fxdebug.render(gm, tmp_path / "d2.svg", depth=2, fold=False))
    groups = sorted(t for t in nodes if t.startswith("module/"))
    assert groups == ["module/layer1.0", "module/layer1.1", "module/layer2.0", "module/layer2.1"]
    # Folded (the default): layer1's two identical blocks are one box; layer2.0 downsamples, 2.1 does not.
    folded, _ = parse(fxdebug.render(gm, tmp_path / "d2f.svg", depth=2))
    assert sorted(t for t in folded if t.startswith("module/")) == ["module/layer1.0", "module/layer2.0",
                                                                     "module/layer2.1"]
    assert "layer1.0–1 ×2 : BasicBlock" in folded["module/layer1.0"]["text"]
    assert "stem_0" in nodes  # stem's children are depth-2 leaf modules: one op each, drawn as is
    clusters = {g.get("id") for g in root.iter(f"{SVG}g") if g.get("class") == "cluster"}
    assert {"cluster/layer1", "cluster/layer2", "cluster/stem"} <= clusters
    assert not any(c.startswith("cluster/layer1.0") for c in clusters)


def test_collapsed_box_aggregates_findings(sick, tmp_path):
    dbg, report, _ = sick
    nodes, _ = parse(dbg.render(str(tmp_path / "agg.svg"), depth=1, fold=False))
    block = nodes["module/block"]
    assert block["fill"] == COLORS["hot"] and "worst dead 75% (block_act)" in block["text"]
    head = nodes["module/head"]
    assert head["fill"] == COLORS["origin"] and "NaN/Inf ORIGIN inside: log" in head["text"]
    # By default the module holding the origin stays open, so the origin itself is drawn.
    nodes, root = parse(dbg.render(str(tmp_path / "open.svg"), depth=1))
    assert "module/head" not in nodes and nodes["log"]["fill"] == COLORS["origin"]
    assert "module/block" in nodes
    clusters = {g.get("id") for g in root.iter(f"{SVG}g") if g.get("class") == "cluster"}
    assert "cluster/head" in clusters


def test_output_is_deterministic(tmp_path):
    outs = []
    for i in range(2):
        model, (x,) = ZOO["transformer_block"]()
        path = fxdebug.render(model, tmp_path / f"g{i}.svg", x)
        outs.append((Path(path).read_text(), (tmp_path / f"g{i}.dot").read_text()))
    assert outs[0] == outs[1]


def test_auto_leaf_marked(tmp_path):
    model, (x,) = ZOO["control_flow"]()
    nodes, _ = parse(fxdebug.render(model, tmp_path / "cf.svg", x))
    assert nodes["gate"]["stroke"] == COLORS["auto_leaf"]
    assert "auto-leaf (not traced inside)" in nodes["gate"]["text"]


def test_missing_graphviz_writes_dot_and_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(render_module.shutil, "which", lambda name: None)
    model, (x,) = ZOO["functional_ops"]()
    with pytest.raises(fxdebug.FxDebugError, match=r"apt-get install -y graphviz.*brew install graphviz"):
        fxdebug.render(model, tmp_path / "g.svg", x)
    assert (tmp_path / "g.dot").read_text().startswith("digraph")
    assert not (tmp_path / "g.svg").exists()


def test_default_depth_keeps_big_graphs_readable():
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(20)])

        def forward(self, x):
            return self.blocks(x) + x

    model = nn.Sequential(*[Stage() for _ in range(10)])  # 10 * (40 + 1) ops
    view = build_view(fxdebug.trace(model))
    boxes = {k: len(set(group_nodes(view, k)[1].values())) for k in (1, 2, 3)}
    assert boxes == {1: 12, 2: 22, 3: 212}  # stages; stages' blocks + adds; every Linear/ReLU pair
    assert auto_depth(view, budget=100) == 2  # the deepest level that fits
    assert auto_depth(view, budget=5) == 1  # nothing fits: the most collapsed picture
    assert auto_depth(view, budget=10_000) is None  # everything fits: nothing collapsed


def test_bad_arguments_are_usage_errors(tmp_path):
    with pytest.raises(fxdebug.UsageError, match="depth"):
        fxdebug.render(nn.Linear(2, 2), tmp_path / "g.svg", depth=0)
    with pytest.raises(fxdebug.UsageError, match="instantiate"):
        fxdebug.render(nn.Linear, tmp_path / "g.svg")
    with pytest.raises(fxdebug.UsageError, match="writes svg"):
        fxdebug.render(nn.Linear(2, 2), tmp_path / "g.dot")


def test_render_doc_examples(tmp_path, monkeypatch):
    """docs/render.md's example, run as written: both files appear, the SVG draws the origin."""
    import re as _re

    monkeypatch.chdir(tmp_path)
    text = (Path(__file__).resolve().parent.parent / "docs" / "render.md").read_text(encoding="utf-8")
    blocks = _re.findall(r"```python\n(.*?)```", text, flags=_re.S)
    assert blocks
    ns: dict = {}
    for block in blocks:
        exec(compile(block, "render.md", "exec"), ns)
    nodes, _ = parse(tmp_path / "demo.svg")
    origin = ns["dbg"].report().first_nonfinite  # `log` (symbolic) or `head_log` (Dynamo): head's torch.log
    assert origin in ("log", "head_log") and ns["dbg"].report()[origin]["module"] == "head"
    assert nodes[origin]["fill"] == COLORS["origin"] and nodes["stage2_act"]["fill"] == COLORS["hot"]
    assert "window.fxdebugViewer" in (tmp_path / "demo.html").read_text(encoding="utf-8")


def test_cli_render_html(tmp_path, capsys):
    from fxdebug.cli.main import main

    zoo = Path(__file__).resolve().parent / "zoo.py"
    assert main(["render", f"{zoo}:ResidualCNN", "--input", "1,3,32,32", "--html", "-o", str(tmp_path / "g.svg")]) == 0
    page = (tmp_path / "g.html").read_text(encoding="utf-8")
    assert '"name":"layer1_0_conv1"' in page and "window.fxdebugViewer" in page
    assert not (tmp_path / "g.svg").exists()
    assert "g.html" in capsys.readouterr().out


def test_render_takes_an_options_object_and_keywords_and_names_unknown_options(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    opts = fxdebug.RenderOptions(depth=1, show_instrumentation=True)
    path = fxdebug.render(model, str(tmp_path / "m.svg"), (x,), options=opts, fold=False)
    assert path.endswith("m.svg") and (tmp_path / "m.dot").exists()
    with pytest.raises(fxdebug.UsageError, match="no option 'colour'.*depth"):
        fxdebug.render(model, str(tmp_path / "n.svg"), (x,), colour="red")
