"""Tracing that never gives up on the whole model: auto-leafing, module paths, clear failures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from zoo import ZOO, DataDependentGate


def test_auto_leaf_makes_the_smallest_untraceable_module_a_leaf():
    model, (x,) = ZOO["control_flow"]()
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)  # plain FX gives up on the whole model
    dbg = fxdebug.trace(model)
    leaves = dbg.trace_info.auto_leaves
    assert list(leaves) == ["gate"]
    info = leaves["gate"]
    assert info.module_type == "DataDependentGate"
    assert "control flow" in info.reason or "TraceError" in info.reason
    assert info.location is not None and "zoo.py" in info.location and "x.sum() > 0" in info.location
    # pre and post are still traced op by op; only the gate is a black box.
    targets = [n.target for n in dbg.graph.nodes if n.op == "call_module"]
    assert targets == ["pre", "gate", "post"]
    assert torch.equal(dbg(x), model(x))
    assert "gate" in dbg.report().auto_leaves


def test_auto_leaf_disabled_raises_trace_error_naming_module_and_line():
    model, _ = ZOO["control_flow"]()
    with pytest.raises(fxdebug.TraceError) as err:
        fxdebug.trace(model, auto_leaf=False)
    assert err.value.module == "gate"
    assert "leaf_modules=['gate']" in str(err.value)
    assert "zoo.py" in str(err.value)


class UntraceableRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.mean() > 0:  # the root itself branches on data
            return self.fc(x)
        return x


def test_untraceable_root_raises_trace_error_with_remedies():
    with pytest.raises(fxdebug.TraceError) as err:
        fxdebug.trace(UntraceableRoot(), frontend="symbolic")
    message = str(err.value)
    assert err.value.module == ""
    assert "UntraceableRoot" in message and "test_trace.py" in message and "x.mean() > 0" in message
    assert "leaf_modules" in message and "concrete_args" in message
    assert isinstance(err.value, RuntimeError)


def test_user_leaf_modules_by_name_and_type():
    model, (x,) = ZOO["residual_cnn"]()
    by_name = fxdebug.trace(model, leaf_modules=["layer1"])
    assert "layer1" in [n.target for n in by_name.graph.nodes if n.op == "call_module"]
    by_type = fxdebug.trace(model, leaf_modules=[type(model.layer1[0])])
    called = [n.target for n in by_type.graph.nodes if n.op == "call_module"]
    assert "layer1.0" in called and "layer2.1" in called
    model.eval()
    assert torch.equal(by_type.eval()(x), model(x))


def test_every_node_records_its_owning_module():
    model, _ = ZOO["transformer_block"]()
    dbg = fxdebug.trace(model)
    paths = {n.name: fxdebug.authoring.module_path(n) for n in dbg.graph.nodes}
    # functional calls and tensor methods inside Attention.forward belong to "attn"
    softmax = next(n for n in dbg.graph.nodes if n.op == "call_method" and n.target == "softmax")
    assert paths[softmax.name] == "attn"
    chunk = next(n for n in dbg.graph.nodes if n.op == "call_method" and n.target == "chunk")
    assert fxdebug.authoring.fx_meta(chunk)["module"] == "attn"
    gelu = next(n for n in dbg.graph.nodes if n.op == "call_module" and n.target == "mlp.1")
    assert fxdebug.authoring.fx_meta(gelu)["module_type"] == "GELU"
    add = [n for n in dbg.graph.nodes if n.op == "call_function" and n.target.__name__ == "add"]
    assert [paths[a.name] for a in add] == ["", ""]  # the residual adds live in the root's forward


def test_source_lines_are_the_users():
    model, _ = ZOO["functional_ops"]()
    dbg = fxdebug.trace(model)
    cat = next(n for n in dbg.graph.nodes if n.target is torch.cat)
    assert fxdebug.authoring.source_line(cat).startswith("zoo.py:")
    assert "torch.cat" in fxdebug.authoring.source_line(cat)


def test_not_a_module_is_a_usage_error():
    with pytest.raises(fxdebug.UsageError, match="nn.Module instance"):
        fxdebug.trace(lambda x: x)
    with pytest.raises(fxdebug.UsageError, match="instantiate it first"):
        fxdebug.instrument(DataDependentGate, passes=[])
    with pytest.raises(TypeError):
        fxdebug.instrument([1, 2, 3])


def test_rejected_example_inputs_name_the_node():
    model, _ = ZOO["residual_cnn"]()
    with pytest.raises(fxdebug.ShapeMismatchError) as err:
        fxdebug.instrument(model, passes=[], example_inputs=(torch.randn(2, 1, 16, 16),))
    assert err.value.node == "stem_0"
    assert "in_channels=3" in str(err.value) and "(2, 1, 16, 16)" in str(err.value)


def test_scenario_one_flatten_linear_mismatch():
    from zoo import BROKEN

    model, inputs = BROKEN["mnist_mismatch"]()
    with pytest.raises(fxdebug.ShapeMismatchError) as err:
        fxdebug.instrument(model, passes=[], example_inputs=inputs)
    message = str(err.value)
    assert err.value.node == "fc1" and err.value.module == "fc1"
    assert "(2, 1440)" in message and "in_features=1440" in message and "'view'" in message
    assert isinstance(err.value.__cause__, RuntimeError)


@pytest.mark.parametrize("frontend", ["auto", "dynamo"])  # fc a module call (symbolic) or torch.linear (Dynamo)
def test_runtime_op_failure_names_the_node(frontend):
    model, (x,) = ZOO["functional_ops"]()
    dbg = fxdebug.instrument(model, passes=[], example_inputs=(x,), frontend=frontend)
    with pytest.raises(fxdebug.ShapeMismatchError) as err:
        dbg(torch.randn(2, 4, 6, 6))  # 6x6 input: fc sees the wrong number of features
    assert err.value.node == "fc"
    assert "in_features=128" in str(err.value) and "set in_features=72" in str(err.value)


def test_non_shape_errors_keep_their_type_and_gain_a_note():
    class WrongDtype(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            return x.to(torch.int64) @ self.w

    dbg = fxdebug.trace(WrongDtype())
    with pytest.raises(RuntimeError) as err:
        dbg(torch.randn(2, 3))
    assert not isinstance(err.value, fxdebug.FxDebugError)
    notes = "".join(getattr(err.value, "__notes__", []))
    assert "node 'matmul'" in notes and "int64" in notes
