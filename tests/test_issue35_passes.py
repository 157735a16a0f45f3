"""Issue 35, the pass library's items: what a new user with real models and the docs met.

B10 NaN already in the data; B8 ShapeAssert after a replaced head; B5 Fuse on an instrumented model;
B13 structured pruning of a BERT's FFN channels. (B11/B12, the option rule: tests/test_pass_options.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxdebug
from fxdebug.passes import NaNCheck


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# -- B10: NaN in the data ------------------------------------------------------------------------
@pytest.mark.parametrize("frontend", ["auto", "symbolic"])
def test_nan_in_the_batch_is_blamed_on_the_data_not_on_an_op(frontend):
    model, x = _mlp(), torch.randn(3, 4)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,), frontend=frontend)
    bad = x.clone()
    bad[1, 2] = float("nan")
    dbg(bad)
    report = dbg.report()
    origin = report.row(report.first_nonfinite)
    assert origin["op"] == "placeholder"  # first_nonfinite keeps its meaning: the first non-finite node
    finding = next(f for f in report.findings() if f.kind == "nonfinite_origin")
    assert "turned finite inputs" not in finding.message
    assert "already carried NaN/Inf when it came in" in finding.message
    assert "check the data" in finding.fix and "origin_samples" in finding.fix
    assert "log" not in finding.fix.split("(")[0]  # not an op's domain advice first

    raising = fxdebug.instrument(model, [NaNCheck(mode="raise")], example_inputs=(x,), frontend=frontend)
    with pytest.raises(fxdebug.NonFiniteError) as info:
        raising(bad)
    message = str(info.value)
    assert "an input of the model's graph" in message and "Check the data" in message
    assert "check its domain" not in message and "this op made them" not in message
    assert info.value.node == report.first_nonfinite


def test_nan_made_by_an_op_is_still_blamed_on_the_op():
    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x - 10)

    x = torch.rand(3, 4)
    dbg = fxdebug.instrument(Log(), [NaNCheck()], example_inputs=(x,), frontend="symbolic")
    dbg(x)
    finding = next(f for f in dbg.report().findings() if f.kind == "nonfinite_origin")
    assert "turned finite inputs into NaN/Inf" in finding.message and "clamp" in finding.fix


# -- B5: Fuse on an instrumented model -------------------------------------------------------------
def _conv_bn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model, torch.randn(2, 3, 8, 8)


def _calls_batchnorm(gm) -> bool:
    def module(n):
        try:
            return gm.get_submodule(str(n.target))
        except AttributeError:  # a live part resolves fxdebug's own modules elsewhere
            return None

    return any("batch_norm" in str(n.target) or (n.op == "call_module" and isinstance(module(n), nn.BatchNorm2d))
               for n in gm.graph.nodes if n.op in ("call_module", "call_function"))


@pytest.mark.parametrize("frontend", ["auto", "symbolic"])
@pytest.mark.parametrize("first", [
    lambda: [NaNCheck(backward=True), fxdebug.passes.StatCollector()],
    lambda: [NaNCheck(mode="raise")],  # an input-wanting probe: the batch-norm's observer reads the conv too
], ids=["record", "raise"])
def test_fuse_folds_an_already_instrumented_conv_bn(frontend, first):
    from fxdebug.passes import Fuse

    model, x = _conv_bn()
    dbg = fxdebug.instrument(model, first(), example_inputs=(x,), frontend=frontend)
    fused = fxdebug.instrument(dbg, [Fuse()], example_inputs=(x,))
    result = next(r for r in fused.pass_results if r.pass_name == "fuse")
    assert result.replaced, result.notes  # fused, not "feeds 2 users (_1, fxdebug_obs__0)"
    assert any("dropped the observation" in n for n in result.notes)
    gm = fused if isinstance(fused, torch.fx.GraphModule) else fused.graph
    gm = gm if isinstance(gm, torch.fx.GraphModule) else gm.owning_module
    gm.graph.lint()
    assert not _calls_batchnorm(gm)
    y = fused(x)
    torch.testing.assert_close(y, model(x), atol=1e-5, rtol=1e-5)
    rows = fused.report().rows
    assert len(rows) == len(dbg.report().rows) - 1  # the conv's own row went with its value


def test_fuse_still_refuses_a_conv_that_the_model_reads_twice():
    from fxdebug.passes import Fuse

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y

    model, x = Twice().eval(), torch.randn(2, 3, 8, 8)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,), frontend="symbolic")
    fused = fxdebug.instrument(dbg, [Fuse()], example_inputs=(x,))
    result = next(r for r in fused.pass_results if r.pass_name == "fuse")
    assert not result.replaced and any("alone" in n for n in result.notes)


# -- B8: ShapeAssert after a legitimately replaced head --------------------------------------------
class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.fc = nn.Linear(16, 10)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(self.body(x)))


def test_shape_assert_learns_a_replaced_head_again():
    from fxdebug.passes import ShapeAssert

    model = _Head()
    dbg = fxdebug.instrument(model, [ShapeAssert()], example_inputs=(torch.randn(4, 8),))
    assert dbg(torch.randn(4, 8)).shape == (4, 10)
    model.fc = nn.Linear(16, 5)  # 10 classes -> 5: the expectation belonged to the old module
    assert dbg(torch.randn(4, 8)).shape == (4, 5)
    assert dbg(torch.randn(6, 8)).shape == (6, 5)  # was: "fc produced (N, 5); expected (N, 10)"
    torch.testing.assert_close(dbg(x := torch.randn(3, 8)), model(x))


def test_shape_assert_keeps_the_expectations_of_modules_that_were_not_replaced():
    from fxdebug.passes import ShapeAssert

    model = _Head()
    dbg = fxdebug.instrument(model, [ShapeAssert(dynamic_dims=())], example_inputs=(torch.randn(4, 8),))
    dbg(torch.randn(4, 8))
    model.fc = nn.Linear(16, 5)
    assert dbg(torch.randn(4, 8)).shape == (4, 5)
    with pytest.raises(fxdebug.ShapeMismatchError) as info:  # the batch dim is fixed: the input still breaks it
        dbg(torch.randn(6, 8))
    assert "fc" not in (info.value.module or "") and "(4, 8)" in str(info.value)


# -- B13: structured pruning of a BERT's feed-forward channels -------------------------------------
def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval(), torch.randint(0, 64, (2, 8))


def _masked_values(dbg):
    from fxdebug.passes.prune import MaskedValue

    return [m for part in dbg.parts().values() for m in getattr(part, "fxdebug").modules() if isinstance(m, MaskedValue)]


def test_prune_channels_prunes_berts_feed_forward_channels():
    import copy

    from fxdebug.passes import PruneMasks

    model, ids = _tiny_bert()
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels")], example_inputs=(ids,))
    masks = {(m.path, m.name): m.mask_value for m in _masked_values(dbg)}
    for layer in range(2):
        inter, out = f"encoder.layer.{layer}.intermediate.dense", f"encoder.layer.{layer}.output.dense"
        rows = (masks[(inter, "weight")] == 0).all(1)
        cols = (masks[(out, "weight")] == 0).all(0)
        assert torch.equal(rows, cols) and torch.equal(rows, masks[(inter, "bias")] == 0)  # one channel, both sides
        assert 0 < int(rows.sum()) < 32
    assert sum(int((masks[(f"encoder.layer.{i}.intermediate.dense", "bias")] == 0).sum()) for i in range(2)) == 32
    assert not any("attention" in path for path, _ in masks)  # attention and residual writers are kept whole
    notes = next(r for r in dbg.pass_results if r.pass_name == "prune-masks").notes
    assert any("kept" in n and "attention.self.query" in n for n in notes)
    # what the instrumented model computes is the model with those weights zeroed, exactly
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for (path, name), mask in masks.items():
            getattr(ref.get_submodule(path), name).mul_(mask)
    torch.testing.assert_close(dbg(ids).last_hidden_state, ref(ids).last_hidden_state)
    assert not torch.allclose(ref(ids).last_hidden_state, model(ids).last_hidden_state)
    assert model.encoder.layer[0].intermediate.dense.weight.abs().min() > 0  # the model keeps its weights


def test_prune_channels_without_a_feed_forward_block_says_what_works():
    from fxdebug.passes import PruneMasks

    model, ids = _tiny_bert()
    with pytest.raises(fxdebug.PassError, match=r"Use structured=False here") as info:
        fxdebug.instrument(model, [PruneMasks(0.5, structured="channels", where="*attention*")], example_inputs=(ids,))
    assert "frontend=" not in str(info.value)  # no recommending frontends that fail on this model
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, where="*attention*")], example_inputs=(ids,))  # what it named works
    assert _masked_values(dbg)
    with pytest.raises(fxdebug.PassError, match="What works on this graph"):
        fxdebug.instrument(model, [PruneMasks(0.5, structured="channels", importance="activation")], example_inputs=(ids,))
