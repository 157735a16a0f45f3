"""GradientScale (reverse/stop/scale a gradient) and Freeze (no .grad for some modules), on the zoo."""

from __future__ import annotations

import copy

import pytest
import torch

import fxdebug
from fxdebug.passes import Freeze, GradientScale
from zoo import ZOO


def _grads(model, x, dbg=None):
    model.zero_grad(set_to_none=True)
    out = (dbg or model)(x)
    out.sum().backward()
    grads = {k: (None if p.grad is None else p.grad.clone()) for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


@pytest.fixture
def cnn():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    return model, x


def test_gradient_reversal_at_a_module_output(cnn):
    model, x = cnn
    ref_out, ref = _grads(model, x)
    rev = GradientScale(fxdebug.outputs_of("layer2"), -1.0)
    dbg = fxdebug.instrument(model, [rev], example_inputs=(x,))
    hooks = [fxdebug.authoring.node_meta(n).transforms["gradient-scale"]["scales"] for n in dbg.graph.nodes if fxdebug.authoring.node_meta(n).added_by == "gradient-scale"]
    assert hooks == ["relu_3"]  # layer2's output, once
    out, got = _grads(model, x, dbg)
    assert torch.equal(out, ref_out)  # forward bitwise unchanged
    for name, g in got.items():
        expected = ref[name] if name.startswith("fc.") else -ref[name]  # everything before layer2's output flips
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-7)


def test_plain_module_where_scales_once_at_the_exit_not_per_op(cnn):
    model, x = cnn
    _, ref = _grads(model, x)
    dbg = fxdebug.instrument(model, [GradientScale("layer2", -1.0)], example_inputs=(x,))
    assert [fxdebug.authoring.node_meta(n).transforms["gradient-scale"]["scales"] for n in dbg.graph.nodes if fxdebug.authoring.node_meta(n).added_by == "gradient-scale"] == ["relu_3"]
    _, got = _grads(model, x, dbg)
    torch.testing.assert_close(got["stem.0.weight"], -ref["stem.0.weight"], rtol=1e-5, atol=1e-7)


def test_factor_zero_stops_and_the_switch_works(cnn):
    model, x = cnn
    _, ref = _grads(model, x)
    stop = GradientScale(fxdebug.outputs_of("layer1"), 0.0)
    dbg = fxdebug.instrument(model, [stop], example_inputs=(x,))
    _, got = _grads(model, x, dbg)
    assert float(got["stem.0.weight"].abs().max()) == 0.0 and float(got["layer1.0.conv1.weight"].abs().max()) == 0.0
    torch.testing.assert_close(got["layer2.0.conv1.weight"], ref["layer2.0.conv1.weight"])
    stop.factor = 0.5
    _, half = _grads(model, x, dbg)
    torch.testing.assert_close(half["stem.0.weight"], 0.5 * ref["stem.0.weight"], rtol=1e-5, atol=1e-8)
    stop.enabled = False
    _, plain = _grads(model, x, dbg)
    torch.testing.assert_close(plain["stem.0.weight"], ref["stem.0.weight"])


@pytest.mark.parametrize("name,where,flipped", [
    ("transformer_block", "attn", ("ln1.", "attn.")),  # ln1 reaches the loss only through attn
    ("inplace_ops", "fc1", ("fc1.",)),                 # fc1's output is then modified in place (h += x)
    ("dict_outputs", "body", ("body.",)),
    ("functional_ops", "conv", ("conv.",)),
])
def test_reversal_on_other_zoo_models(name, where, flipped):
    model, (x,) = ZOO[name]()
    model.eval()

    def loss(out):
        return sum(v.sum() for v in (out.values() if isinstance(out, dict) else [out]))

    model.zero_grad(set_to_none=True)
    ref_out = model(x)
    loss(ref_out).backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    dbg = fxdebug.instrument(model, [GradientScale(fxdebug.outputs_of(where), -1.0)], example_inputs=(x,))
    out = dbg(x)
    for a, b in zip(*(list(o.values()) if isinstance(o, dict) else [o] for o in (out, ref_out))):
        assert torch.equal(a, b)
    loss(out).backward()
    for k, p in model.named_parameters():
        expected = -ref[k] if k.startswith(flipped) else ref[k]
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-7, msg=k)


def test_a_module_called_twice_has_both_outputs_scaled():
    model, (x,) = ZOO["shared_module"]()
    dbg = fxdebug.instrument(model, [GradientScale(fxdebug.outputs_of("block"), 0.0)], example_inputs=(x,))
    assert sorted(fxdebug.authoring.node_meta(n).transforms["gradient-scale"]["scales"] for n in dbg.graph.nodes if fxdebug.authoring.node_meta(n).added_by == "gradient-scale") == \
        ["block_1", "block_3"]
    dbg(x).sum().backward()
    assert float(model.block[0].weight.grad.abs().max()) == 0.0 and float(model.out.weight.grad.abs().max()) > 0


def test_gradient_scale_needs_a_selection_that_exists(cnn):
    model, x = cnn
    with pytest.raises(fxdebug.FxDebugError, match="(matches|selects) no node"):
        fxdebug.instrument(model, [GradientScale(fxdebug.outputs_of("nope"), -1.0)], example_inputs=(x,))
    with pytest.raises(fxdebug.UsageError, match="where="):
        GradientScale(None, -1.0)
    with pytest.raises(fxdebug.UsageError, match="number"):
        GradientScale("layer1", "half")


def test_freeze_leaves_grad_none_without_touching_requires_grad(cnn):
    model, x = cnn
    ref_out, ref = _grads(model, x)
    freeze = Freeze("layer1")
    dbg = fxdebug.instrument(model, [freeze], example_inputs=(x,))
    out, got = _grads(model, x, dbg)
    assert torch.equal(out, ref_out)
    assert all(p.requires_grad for p in model.parameters())
    for name, g in got.items():
        if name.startswith("layer1."):
            assert g is None, name
        else:  # gradients still flow through layer1 to the stem
            torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-7)
    assert list(dbg.state_dict()) == list(model.state_dict())


def test_frozen_parameters_do_not_move_under_an_optimizer_and_switch_back(cnn):
    model, x = cnn
    freeze = Freeze(["layer1.0", "fc"])
    dbg = fxdebug.instrument(model, [freeze], example_inputs=(x,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # every parameter, frozen ones included
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt.zero_grad(set_to_none=True)
    dbg(x).sum().backward()
    opt.step()
    for k, p in model.named_parameters():
        frozen = k.startswith(("layer1.0.", "fc."))
        assert torch.equal(p, before[k]) == frozen, k
    freeze.enabled = False
    opt.zero_grad(set_to_none=True)
    dbg(x).sum().backward()
    assert model.fc.weight.grad is not None and model.layer1[0].conv1.weight.grad is not None


def test_freeze_parameters_read_directly_and_by_outputs_of():
    model, (x,) = ZOO["get_attr_params"]()
    dbg = fxdebug.instrument(model, [Freeze("weight")], example_inputs=(x,))
    torch.testing.assert_close(dbg(x), model(x))
    dbg(x).sum().backward()
    assert model.weight.grad is None and model.bias.grad is not None

    cnn, (y,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(cnn, [Freeze(fxdebug.outputs_of("stem"))], example_inputs=(y,))
    dbg(y).sum().backward()
    assert all(p.grad is None for p in cnn.stem.parameters())
    assert all(p.grad is not None for p in cnn.layer1.parameters())


def test_freeze_survives_copy_and_names_what_it_froze(cnn):
    model, x = cnn
    dbg = fxdebug.instrument(model, [Freeze("layer2.1")], example_inputs=(x,))
    notes = [n for r in dbg.pass_results for n in r.notes]
    assert any("layer2.1.conv1.weight" in n for n in notes)
    twin = copy.deepcopy(dbg)
    torch.testing.assert_close(twin(x), model(x))
    with pytest.raises(fxdebug.FxDebugError, match="matches no parameter"):
        fxdebug.instrument(model, [Freeze("pool")], example_inputs=(x,))
