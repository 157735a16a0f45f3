"""DeviceCheck: mixed devices are named before the op runs (cpu vs meta here; cuda where present)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import DeviceCheck
from zoo import ZOO


def test_model_on_one_device_input_on_another():
    model, inputs = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [DeviceCheck()], example_inputs=inputs)
    torch.testing.assert_close(dbg(*inputs), model(*inputs))
    with pytest.raises(fxdebug.DeviceMismatchError) as info:
        dbg(inputs[0].to("meta"))
    err = info.value
    assert (err.node, err.module) == ("stem_0", "stem.0")
    assert err.op in ("Conv2d", "torch.conv2d")  # the module (symbolic) or the function with its weights (Dynamo)
    msg = str(err)
    assert "input 'x' (2, 3, 16, 16) on meta" in msg and "parameters stem.0.weight on cpu" in msg
    assert "Move the inputs to cpu" in msg and "zoo.py:" in msg
    assert err.__cause__ is None  # raised before torch ran the op


class MakesCpuBuffer(nn.Module):
    """Scenario 3: a tensor created inside forward without device=."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        bias = torch.ones(x.shape[-1])  # lands on the default device (cpu), whatever x's is
        return h + bias


def test_tensor_created_on_cpu_inside_forward():
    model = MakesCpuBuffer()
    dbg = fxdebug.instrument(model, [DeviceCheck()], example_inputs=(torch.randn(2, 4),))
    model.to("meta")
    with pytest.raises(fxdebug.DeviceMismatchError, match=r"node 'add' .*input 'fc' \(2, 4\) on meta; input 'ones' \(4,\) on cpu"):
        dbg(torch.randn(2, 4, device="meta"))


def test_guards_only_where_devices_could_mix_and_where():
    model, inputs = ZOO["functional_ops"]()
    dbg = fxdebug.instrument(model, [DeviceCheck()], example_inputs=inputs)
    graphs = [part.graph for part in dbg.parts().values()]
    guarded = {fxdebug.authoring.fx_meta(n)["observes"] for g in graphs for n in g.nodes
               if n.op == "call_function" and fxdebug.authoring.fx_meta(n).get("probes") == ["device-check"]}
    assert guarded == {"conv", "cat", "fc"}  # one tensor input and no parameters cannot mix devices
    for g in graphs:
        g.lint()
    only = fxdebug.instrument(model, [DeviceCheck(where="fc")], example_inputs=inputs)
    assert {fxdebug.authoring.fx_meta(n).get("observes") for part in only.parts().values() for n in part.graph.nodes
            if fxdebug.authoring.is_instrumentation(n)} == {"fc"}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_runs_unchanged_on_cpu_and_meta(name):
    model, inputs = ZOO[name]()
    model.eval()
    dbg = fxdebug.instrument(model, [DeviceCheck()], example_inputs=inputs)
    torch.testing.assert_close(dbg(*inputs), model(*inputs))
    if name != "control_flow":
        meta_inputs = tuple(t.to("meta") for t in inputs)
        dbg.to("meta")
        dbg(*meta_inputs)


@pytest.mark.cuda
def test_cuda_model_cpu_input():
    model, inputs = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model.cuda(), [DeviceCheck()], example_inputs=tuple(t.cuda() for t in inputs))
    with pytest.raises(fxdebug.DeviceMismatchError, match=r"input 'x' \(2, 3, 16, 16\) on cpu.*on cuda:0"):
        dbg(*inputs)


def test_guards_are_inserted_before_their_op_with_provenance():
    model, inputs = ZOO["residual_cnn"]()
    # the guard's place in a module-level graph (the owner read by get_attr) is the subject: symbolic tracing
    dbg = fxdebug.instrument(model, [DeviceCheck()], example_inputs=inputs, frontend="symbolic")
    order = {n: i for i, n in enumerate(dbg.graph.nodes)}
    guards = [n for n in dbg.graph.nodes if "device-check" in fxdebug.authoring.node_meta(n).probes]
    assert guards
    for g in guards:
        meta = fxdebug.authoring.node_meta(g)
        watched = next(n for n in dbg.graph.nodes if n.name == meta.observes)
        assert order[g] < order[watched]
        assert meta.role == fxdebug.authoring.INSTRUMENTATION and meta.added_by == "device-check"
        assert meta.module == fxdebug.authoring.module_path(watched)
        assert "stack_trace" not in g.meta  # fxdebug writes only under its own key
    # the conv of the stem is guarded by its parameters' owner (get_attr) and the check itself
    stem = [g for g in guards if fxdebug.authoring.node_meta(g).observes == "stem_0"]
    assert sorted(g.op for g in stem) == ["call_function", "get_attr"]
    torch.testing.assert_close(dbg(*inputs), model(*inputs))


@pytest.mark.parametrize("frontend", ["symbolic", "dynamo"])
def test_weights_read_as_graph_inputs_are_named_as_parameters(frontend):
    """Weights that reach the op as ``get_attr`` inputs (``x @ self.weight``; every weight in a Dynamo graph,
    ``torch.linear(x, w, b)``) are named as the model's parameters, with the advice to move the inputs."""
    model, inputs = ZOO["get_attr_params"]()
    dbg = fxdebug.instrument(model, [DeviceCheck()], example_inputs=inputs, frontend=frontend)
    model.to("meta")
    with pytest.raises(fxdebug.DeviceMismatchError) as info:
        dbg(*inputs)
    msg = str(info.value)
    assert info.value.node == "matmul"
    assert "input 'x' (3, 8) on cpu" in msg and "parameters weight on meta" in msg, msg
    assert "input 'weight'" not in msg and "Move the inputs to meta" in msg
