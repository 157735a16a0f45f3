"""``fxdebug.outputs_of``: a where= meaning a module's output node(s), accepted by every built-in pass."""

from __future__ import annotations

import inspect

import pytest
import torch

import fxdebug
import fxdebug.passes as lib
from zoo import ZOO


def _picked(gm, where):
    return [n.name for n in gm.graph.nodes if n.op != "placeholder" and fxdebug.authoring.matches(where, n)]


def test_outputs_of_selects_what_leaves_the_module():
    model, (x,) = ZOO["residual_cnn"]()
    gm = fxdebug.trace(model, (x,))
    assert _picked(gm, fxdebug.outputs_of("layer2")) == ["relu_3"]
    assert _picked(gm, fxdebug.outputs_of("stem")) == ["stem_2"]
    assert _picked(gm, fxdebug.outputs_of("layer1.0.conv1")) == ["layer1_0_conv1"]
    # a plain where= selects every op inside; outputs_of only the exit
    assert len(_picked(gm, "layer2")) > 10


def test_globs_stay_within_a_path_segment():
    model, (x,) = ZOO["residual_cnn"]()
    gm = fxdebug.trace(model, (x,))
    assert _picked(gm, fxdebug.outputs_of("layer*")) == ["relu_1", "relu_3"]
    assert _picked(gm, fxdebug.outputs_of("layer1.*")) == ["relu", "relu_1"]
    assert _picked(gm, fxdebug.outputs_of("**.bn2")) == ["layer1_0_bn2", "layer1_1_bn2", "layer2_0_bn2", "layer2_1_bn2"]
    assert _picked(gm, fxdebug.outputs_of("layer1", "fc")) == ["relu_1", "fc"]


def test_a_module_called_twice_has_two_outputs_and_attention_has_one():
    model, (x,) = ZOO["shared_module"]()
    assert _picked(fxdebug.trace(model, (x,)), fxdebug.outputs_of("block")) == ["block_1", "block_3"]
    model, (x,) = ZOO["transformer_block"]()
    assert _picked(fxdebug.trace(model, (x,)), fxdebug.outputs_of("attn")) == ["attn_proj"]


def test_bad_patterns_are_refused():
    with pytest.raises(fxdebug.UsageError, match="glob"):
        fxdebug.outputs_of()
    with pytest.raises(fxdebug.UsageError, match="glob"):
        fxdebug.outputs_of("")


def _make(name: str, where, model=None):
    """Each built-in pass, limited by ``where``, with the arguments it needs."""
    needs = {
        "ParamUpdates": lambda: lib.ParamUpdates(torch.optim.SGD(model.parameters(), lr=0.1), where=where),
        "Breakpoint": lambda: lib.Breakpoint(where, action=lambda hit: None),
        "Capture": lambda: lib.Capture(where=where),
        "Freeze": lambda: lib.Freeze(where),
        "GradientScale": lambda: lib.GradientScale(where, -1.0),
        "PruneMasks": lambda: lib.PruneMasks(0.5, where=where),
    }
    if name in needs:
        return needs[name]()
    return getattr(lib, name)(where=where)


OBSERVERS = {"DeviceCheck", "GradientCentralize", "Histograms", "InplaceCheck", "NaNCheck", "ParamGrads", "Profile",
             "Shadow", "ShapeAssert", "StatCollector"}


PLAN_DRIVEN = {"Precision"}  # acts on the nodes its precision plan names; takes no where=


def test_plan_driven_passes_take_no_where():
    for name in PLAN_DRIVEN:
        assert "where" not in inspect.signature(getattr(lib, name)).parameters, name


@pytest.mark.parametrize("name", sorted(set(lib.__all__) - PLAN_DRIVEN))
def test_every_builtin_pass_accepts_outputs_of(name):
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    where = fxdebug.outputs_of("layer1.*")
    p = _make(name, where, model)
    assert p is not None
    if name in ("Fuse", "SwapActivation"):  # transforms: outputs of layer1 blocks are F.relu nodes
        where = fxdebug.outputs_of("layer1.*.bn2") if name == "Fuse" else where
        p = _make(name, where, model)
    try:
        dbg = fxdebug.instrument(model, [p], example_inputs=(x,))
    except fxdebug.UsageError as exc:  # a pass that cannot act on these nodes must say so, naming the where
        assert "outputs_of" in str(exc) or "where" in str(exc)
        return
    y = dbg(x)
    assert y.shape == model(x).shape
    if name in OBSERVERS or name in ("Breakpoint", "GradientScale"):
        torch.testing.assert_close(y, model(x))
    graph_nodes = [n for part in dbg.parts().values() for n in part.graph.nodes]
    touched = {fxdebug.authoring.fx_meta(n).get("observes") or fxdebug.authoring.node_meta(n).transforms.get("gradient-scale", {}).get("scales") for n in graph_nodes}
    if name in ("StatCollector", "NaNCheck", "Histograms", "Shadow"):
        rows = dbg.report().rows  # each block's output: its last relu (`relu`, `relu_1`; Dynamo: `layer1_0`, ...)
        assert sorted((r["module"], r["op"].rsplit(".", 1)[-1]) for r in rows) == [("layer1.0", "relu"),
                                                                                  ("layer1.1", "relu")]
    if name == "GradientScale":
        assert touched & {"relu", "relu_1"} == {"relu", "relu_1"}  # each block's output, as asked
    if name == "ParamGrads":  # parameters of the modules named (their outputs hold none)
        dbg(x).sum().backward()
        rows = [r for r in dbg.report().rows if r.get("param_grad_calls")]
        assert rows and all(r["module"].startswith("layer1.") for r in rows)
    if name == "ParamUpdates":  # only the parameters of the modules named are watched
        dbg(x).sum().backward()
        p.table.optimizer.step()
        rows = [r for r in dbg.report().rows if r.get("update_norm") is not None]
        assert rows and all(r["module"].startswith("layer1.") for r in rows)
    if name == "SwapActivation":
        swapped = [n for n in graph_nodes if "swap" in str(fxdebug.authoring.fx_meta(n).get("changed_by", ""))]
        assert swapped and all(fxdebug.authoring.module_path(n).startswith("layer1.") for n in swapped)
