"""The foundation's promises, checked on every zoo model: exact outputs and gradients, the
model's own parameters, identical state_dict keys, no mutation, any device, copy and save."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fxdebug
from zoo import ZOO


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _flat(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _state_bytes(model: nn.Module):
    return (
        {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        {name: (type(m), m.training) for name, m in model.named_modules()},
        type(model).forward,
    )


def _same_state(a, b) -> bool:
    sa, ma, fa = a
    sb, mb, fb = b
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa) and ma == mb and fa is fb


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_outputs_and_gradients_bitwise_equal(name, mode):
    model, inputs = ZOO[name]()
    getattr(model, mode)()
    reference = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, passes=[], example_inputs=inputs)
    assert dbg.training == (mode == "train")

    torch.manual_seed(7)
    expected = _flat(reference(*inputs))
    torch.manual_seed(7)
    actual = _flat(dbg(*inputs))
    assert len(expected) == len(actual) > 0
    for e, a in zip(expected, actual):
        assert torch.equal(e, a)

    float_out = [o for o in actual if o.is_floating_point()]
    ref_out = [o for o in expected if o.is_floating_point()]
    if float_out:
        sum(o.sum() for o in ref_out).backward()
        sum(o.sum() for o in float_out).backward()
        for (n1, p1), (n2, p2) in zip(reference.named_parameters(), model.named_parameters()):
            assert n1 == n2
            assert (p1.grad is None) == (p2.grad is None), n1
            if p1.grad is not None:
                assert torch.equal(p1.grad, p2.grad), n1


@pytest.mark.parametrize("name", sorted(ZOO))
def test_shares_parameters_and_state_dict_keys(name):
    model, inputs = ZOO[name]()
    dbg = fxdebug.instrument(model, passes=[], example_inputs=inputs)
    assert list(dbg.state_dict()) == list(model.state_dict())
    own = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    assert {id(p) for p in dbg.parameters()} | {id(b) for b in dbg.buffers()} == own
    # A checkpoint of the model loads into the instrumented module and vice versa.
    dbg.load_state_dict(model.state_dict())
    model.load_state_dict(dbg.state_dict())


def test_optimizer_step_on_instrumented_trains_the_model():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, passes=[], example_inputs=(x,))
    before = model.fc.weight.detach().clone()
    opt = torch.optim.SGD(dbg.parameters(), lr=0.1)
    dbg(x).square().mean().backward()
    opt.step()
    assert not torch.equal(model.fc.weight, before)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_instrumenting_never_mutates_the_model(name):
    model, inputs = ZOO[name]()
    model.train()
    before = _state_bytes(model)
    modules_before = dict(model.named_modules())
    dbg = fxdebug.instrument(model, passes=[], example_inputs=inputs)
    assert _same_state(before, _state_bytes(model))  # batch-norm statistics and RNG untouched
    assert dict(model.named_modules()) == modules_before
    assert not hasattr(model, "fxdebug")
    del dbg


def test_example_run_does_not_consume_the_rng():
    model, inputs = ZOO["transformer_block"]()
    torch.manual_seed(3)
    fxdebug.instrument(model, passes=[], example_inputs=inputs)
    after_instrument = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(3), after_instrument)


@pytest.mark.parametrize("name", ["residual_cnn", "transformer_block", "functional_ops", "dict_outputs", "lstm"])
def test_runs_on_meta_device(name):
    model, inputs = ZOO[name]()
    model = model.to("meta").eval()
    meta_inputs = tuple(x.to("meta") for x in inputs)
    dbg = fxdebug.instrument(model, passes=[], example_inputs=meta_inputs)
    out = _flat(dbg(*meta_inputs))
    ref = _flat(model(*meta_inputs))
    assert [o.shape for o in out] == [o.shape for o in ref]
    assert all(o.device.type == "meta" for o in out)
    devices = [r["device"] for r in dbg.report().rows if r["device"] is not None]
    assert devices and set(devices) == {"meta"}


@pytest.mark.cuda
def test_runs_on_cuda():
    model, (x,) = ZOO["residual_cnn"]()
    model = model.cuda().eval()
    dbg = fxdebug.instrument(model, passes=[], example_inputs=(x.cuda(),))
    assert torch.equal(dbg(x.cuda()), model(x.cuda()))


@pytest.mark.parametrize("name", ["residual_cnn", "get_attr_params", "kwargs_inputs", "control_flow"])
def test_deepcopy_and_save_load(name):
    model, inputs = ZOO[name]()
    model.eval()
    dbg = fxdebug.instrument(model, passes=[], example_inputs=inputs)
    expected = _flat(model(*inputs))

    clone = copy.deepcopy(dbg)
    assert isinstance(clone, fxdebug.Instrumented)
    assert list(clone.state_dict()) == list(model.state_dict())
    assert not any(p1 is p2 for p1, p2 in zip(clone.parameters(), model.parameters()))
    for e, a in zip(expected, _flat(clone(*inputs))):
        assert torch.equal(e, a)

    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, fxdebug.Instrumented)
    assert list(loaded.state_dict()) == list(model.state_dict())
    assert loaded.trace_info.auto_leaves.keys() == dbg.trace_info.auto_leaves.keys()
    for e, a in zip(expected, _flat(loaded(*inputs))):
        assert torch.equal(e, a)


def test_keyword_inputs_as_dict():
    model, (x,) = ZOO["kwargs_inputs"]()
    dbg = fxdebug.instrument(model, passes=[], example_inputs={"x": x, "scale": 2.0})
    assert torch.equal(dbg(x, scale=2.0), model(x, scale=2.0))


def test_optional_none_argument_is_pinned_and_named():
    model, (x,) = ZOO["kwargs_inputs"]()
    # pinning a None argument into the graph is symbolic tracing's (a live capture guards on it instead)
    dbg = fxdebug.instrument(model, passes=[], example_inputs=(x,), frontend="symbolic")
    assert torch.equal(dbg(x, mask=None), model(x))
    assert any("mask" in note for note in dbg.trace_info.notes)


def test_report_and_reset_exist_without_passes():
    model, inputs = ZOO["functional_ops"]()
    dbg = fxdebug.instrument(model, passes=[], example_inputs=inputs)
    report = dbg.report()
    assert isinstance(report, fxdebug.Report)
    conv = report.row("conv")
    assert conv["module"] == "conv" and conv["shape"] == (2, 8, 8, 8)
    assert conv["op"] in ("Conv2d", "torch.conv2d")  # the module's class (symbolic) or the function (Dynamo)
    dbg.reset()
    assert "conv" in str(report)


class MakesConstants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + torch.ones(4)  # FX stores this tensor as a graph constant


def test_tensor_constants_do_not_land_on_the_model():
    model = MakesConstants()
    x = torch.randn(2, 4)
    attributes = set(vars(model))
    dbg = fxdebug.instrument(model, passes=[], example_inputs=(x,))
    assert set(vars(model)) == attributes
    assert list(dbg.state_dict()) == list(model.state_dict())
    assert torch.equal(dbg(x), model(x))
    assert torch.equal(copy.deepcopy(dbg)(x), model(x))


def test_moving_the_model_after_instrumenting_moves_the_instrumented_module():
    model, (x,) = ZOO["get_attr_params"]()
    dbg = fxdebug.instrument(model, passes=[], example_inputs=(x,))
    model.to("meta")
    assert dbg.weight.device.type == "meta"
    assert dbg(x.to("meta")).device.type == "meta"
