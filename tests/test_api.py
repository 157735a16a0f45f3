"""The entry points and the pass pipeline: one capture type, parts, requires, where, provenance."""

from __future__ import annotations

import pickle

import pytest
import torch

import fxdebug
from fxdebug.api import FRONTENDS, module_from_capture
from fxdebug.authoring import INSTRUMENTATION, GraphRecord, graph_pass, node_meta
from fxdebug.capture.base import Capture, TraceOptions
from fxdebug.passes import NaNCheck, StatCollector
from zoo import ZOO
from test_subtrees import Detector, _images


def test_every_frontend_returns_an_instrumented_module_with_parts():
    model, (x,) = ZOO["transformer_block"]()
    model.eval()  # dropout off: the captures must compute exactly what the model computes
    for name, frontend in FRONTENDS.items():
        if frontend.live:  # Dynamo captures at each call of its module, not once: test_frontend_choice.py
            continue
        captured = frontend.capture(model, ((x,), {}), TraceOptions())
        # data: parts with their graphs; the module is built from it one floor up
        assert isinstance(captured, Capture) and captured.info.frontend == name
        assert captured.parts and all(isinstance(p.graph_module, torch.fx.GraphModule) for p in captured.parts)
        if name == "subtrees":  # the root stays eager; each part has the inputs it was recorded on
            assert "" not in [p.path for p in captured.parts]
            assert all(p.inputs is not None and p.root_path == p.path for p in captured.parts)
        else:
            assert [p.path for p in captured.parts] == [""] and captured.part.inputs is None
        gm = module_from_capture(model, captured)
        assert isinstance(gm, fxdebug.Instrumented) and gm.trace_info.frontend == name
        parts = gm.parts()
        assert parts and all(isinstance(p, fxdebug.Instrumented) for p in parts.values())
        if name != "subtrees":
            assert parts == {"": gm}
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_subtrees_parts_share_one_pipeline_and_one_report():
    model, images = Detector().eval(), _images()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(images,), frontend="subtrees")
    parts = dbg.parts()
    assert len(parts) > 1 and "" not in parts
    dbg(images)
    report = dbg.report()
    # every part ran the passes (its own pass results) and its rows read "path/node"
    for path, part in parts.items():
        assert [r.pass_name for r in part.pass_results] == ["nan-check", "stat-collector"]
        own = part.report()
        assert [f"{path}/{r['node']}" for r in own.rows] == [r["node"] for r in report.rows if r["node"].startswith(path + "/")]
    assert set(dbg.observers()) == {r["node"] for r in report.rows}
    assert report.frontend == "subtrees" and report.calls == max(p.report().calls for p in parts.values()) > 0
    dbg.reset()
    assert dbg.report().calls == 0


def test_requires_is_checked_before_the_pass_runs():
    ran = []

    @graph_pass(name="needs-shapes", requires=("shapes",))
    def needs_shapes(gm, ctx):
        ran.append(gm)

    model, (x,) = ZOO["residual_cnn"]()
    with pytest.raises(fxdebug.MissingInputsError, match="pass 'needs-shapes' requires example inputs") as info:
        fxdebug.instrument(model, [needs_shapes])
    assert info.value.pass_name == "needs-shapes" and not ran
    fxdebug.instrument(model, [needs_shapes], example_inputs=(x,))
    assert len(ran) == 1

    @graph_pass(name="typo", requires=("shapez",))
    def typo(gm, ctx):
        ran.append(gm)

    with pytest.raises(fxdebug.UsageError, match="requires 'shapez'.*requirements are example_inputs, prior_report, shapes"):
        fxdebug.instrument(model, [typo], example_inputs=(x,))
    assert len(ran) == 1


def test_where_reaches_the_context_one_way_and_only_narrows():
    seen = {}

    @graph_pass(name="select")
    def select(gm, ctx):
        seen["default"] = {n.name for n in ctx.nodes(gm)}
        seen["none"] = {n.name for n in ctx.nodes(gm, None)}
        seen["narrow"] = {n.name for n in ctx.nodes(gm, "*conv1*")}
        seen["other"] = {n.name for n in ctx.nodes(gm, "layer2")}

    model, (x,) = ZOO["residual_cnn"]()
    fxdebug.instrument(model, [select(where="layer1")], example_inputs=(x,))
    traced = fxdebug.trace(model).graph.nodes
    layer1 = {n.name for n in traced if n.op.startswith("call_") and fxdebug.authoring.module_path(n).startswith("layer1.")}
    assert len(layer1) > 8
    assert seen["default"] == seen["none"] == layer1
    assert seen["narrow"] == {n for n in layer1 if "conv1" in n} and seen["narrow"]
    assert seen["other"] == set()  # an explicit where never widens the pass's own


def test_insert_before_and_after_record_provenance_and_leave_torch_meta_alone():
    def check(t):
        return None

    @graph_pass(name="bracket", observe_only=True)
    def bracket(gm, ctx):
        added = []
        for node in ctx.nodes(gm, "stem.0"):
            before = ctx.insert_before(node, check, (node.args[0],))
            after = ctx.insert_after(node, torch.relu, rewire=True)
            node_meta(before).watch(INSTRUMENTATION, observes=node)
            added += [before, after]
        return fxdebug.PassResult(gm, added=added)

    model, (x,) = ZOO["residual_cnn"]()
    traced = fxdebug.trace(model)
    torch_keys = {n.name: set(n.meta) - {"fxdebug"} for n in traced.graph.nodes}
    assert not any("stack_trace" in keys for keys in torch_keys.values())  # the user's line is fxdebug's key
    assert "zoo.py" in fxdebug.authoring.source_line(next(n for n in traced.graph.nodes if n.name == "layer1_0_conv1"))
    # torch's own node meta of a symbolic graph is the reference: the snapshot graph is the subject
    dbg = fxdebug.instrument(model, [bracket], example_inputs=(x,), frontend="symbolic")
    order = [n.name for n in dbg.graph.nodes]
    before = next(n for n in dbg.graph.nodes if n.target is check)
    after = next(n for n in dbg.graph.nodes if n.target is torch.relu)
    assert order.index(before.name) < order.index("stem_0") < order.index(after.name)
    for n in (before, after):
        meta = node_meta(n)
        assert meta.added_by == "bracket" and meta.module == "stem.0"
        assert set(n.meta) - {"fxdebug"} <= {"val", "tensor_meta"}  # no torch key written by fxdebug
    for n in dbg.graph.nodes:
        if n.name in torch_keys:
            assert set(n.meta) - {"fxdebug"} == torch_keys[n.name]
    assert dbg.pass_results[0].added == [before.name, after.name]


def test_graph_record_is_typed_and_survives_copy_and_pickle():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,))
    record = dbg.meta["fxdebug"]
    assert isinstance(record, GraphRecord) and record.model_type == "ResidualCNN"
    assert record.trace is dbg.trace_info and [r.pass_name for r in record.passes] == ["nan-check"]
    assert record.get("model_type") == "ResidualCNN" and record.instrument_seconds > 0
    again = pickle.loads(pickle.dumps(dbg))
    assert again.meta["fxdebug"].model_type == "ResidualCNN"
    assert [r.pass_name for r in fxdebug.trace(dbg).pass_results] == ["nan-check"]


def test_errors_have_one_class_per_meaning():
    model, (x,) = ZOO["residual_cnn"]()
    with pytest.raises(TypeError):
        fxdebug.instrument(type(model))  # a class, not an instance
    with pytest.raises(ValueError, match="frontend='nope'") as info:
        fxdebug.trace(model, (x,), frontend="nope")
    assert isinstance(info.value, fxdebug.UsageError) and not isinstance(info.value, TypeError)
    for call in (lambda: fxdebug.trace(model, frontend="export"), lambda: fxdebug.trace(model, frontend="subtrees")):
        with pytest.raises(fxdebug.MissingInputsError):
            call()


def test_mode_switch_recipe_is_data_and_recaptures_on_its_own_floor():
    from torch import nn

    from fxdebug.instrumented import pipeline
    from fxdebug.instrumented.snapshot_recipe import recipe

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval(), torch.randn(3, 4)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="export")
    rec = recipe(dbg)
    # the record is the recipe (model, frontend, inputs, passes); re-capture is instrumented/'s own function
    assert rec is not None and rec.model is model and rec.frontend == "export"
    assert [p.name for p in rec.passes] == ["stat-collector"] and rec.recapture is pipeline.recapture
    assert not hasattr(rec, "instrument")
    dbg.train()
    dbg(x)  # the export graph bakes eval mode in: called in training mode, it is captured again
    assert len(rec.snapshots) == 2 and rec.current is rec.snapshots[1] and rec.current.flags[0] is True
