"""Fuse: batch-norm folded into conv / conv-transpose / linear, checked, never mutating the model."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import Fuse, PruneMasks, StatCollector, SwapActivation
from zoo import ZOO



BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def _randomise_bn(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            c = m.num_features
            m.running_mean.copy_(torch.rand(c, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
            if m.affine:
                with torch.no_grad():
                    m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                    m.bias.copy_(torch.rand(c, generator=g) - 0.5)
    return model.eval()


CASES = [
    (nn.Conv1d(3, 4, 3, bias=True), 1), (nn.Conv2d(3, 4, 3, bias=False), 2), (nn.Conv3d(2, 4, 2, groups=2), 3),
    (nn.ConvTranspose1d(3, 4, 3), 1), (nn.ConvTranspose2d(4, 6, 2, groups=2, bias=False), 2), (nn.ConvTranspose3d(2, 3, 2), 3),
]


@pytest.mark.parametrize("layer,dim", CASES, ids=lambda c: type(c).__name__ if isinstance(c, nn.Module) else str(c))
def test_conv_and_transpose_fuse_exactly_enough(layer, dim):
    model = _randomise_bn(nn.Sequential(layer, BN[dim](layer.out_channels), nn.ReLU()))
    x = torch.randn(2, layer.in_channels, *([5] * dim))
    state = copy.deepcopy(model.state_dict())
    # the subject is the snapshot's fused copy (dbg.graph, its module, its own tensors); live: test_live_transforms.py
    dbg = fxdebug.instrument(model, [Fuse()], example_inputs=(x,), frontend="symbolic")
    assert not any(fxdebug.authoring.is_batchnorm(n, dbg) for n in dbg.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(dbg(x), model(x), atol=1e-5, rtol=1e-5)
    fused = next(n for n in dbg.graph.nodes if "fuse" in fxdebug.authoring.node_meta(n).transforms)
    info = fxdebug.authoring.node_meta(fused).transforms["fuse"]
    assert info["from"] == ["_0", "_1"] and info["max_abs_diff"] < 1e-5
    assert fxdebug.authoring.fx_meta(fused)["changed_by"] == ["fuse"] and fxdebug.authoring.fx_meta(fused)["module"] == "1"
    assert str(fused.target).startswith("fxdebug.")
    new = dbg.get_submodule(str(fused.target))
    assert new.weight.data_ptr() != layer.weight.data_ptr()
    for k, v in model.state_dict().items():  # the model keeps its own tensors, unchanged
        assert torch.equal(v, state[k])
    assert isinstance(model[1], BN[dim]) and model[0] is layer
    assert any("max |diff|" in n for n in dbg.pass_results[0].notes)


def test_linear_batchnorm1d_fuses_on_2d_and_is_left_alone_on_3d():
    model = _randomise_bn(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)))
    x = torch.randn(6, 5)
    dbg = fxdebug.instrument(model, [Fuse()], example_inputs=(x,))
    assert dbg.pass_results[0].replaced == {"_1": dbg.pass_results[0].replaced["_0"], "_0": dbg.pass_results[0].replaced["_0"]}
    with torch.no_grad():
        torch.testing.assert_close(dbg(x), model(x), atol=1e-5, rtol=1e-5)
    odd = _randomise_bn(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(3)))
    dbg = fxdebug.instrument(odd, [Fuse()], example_inputs=(torch.randn(2, 3, 4),))
    assert not dbg.pass_results[0].replaced
    assert any("normalises dim 1" in n for n in dbg.pass_results[0].notes), dbg.pass_results[0].notes


class TwoUsers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


def test_pairs_that_cannot_fuse_are_left_alone_with_the_reason():
    model = _randomise_bn(TwoUsers())
    x = torch.randn(2, 3, 4, 4)
    dbg = fxdebug.instrument(model, [Fuse()], example_inputs=(x,))
    assert not dbg.pass_results[0].changed
    assert any("feeds 2 users" in n and "conv" in n for n in dbg.pass_results[0].notes)
    train = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).train()
    dbg = fxdebug.instrument(train, [Fuse()], example_inputs=(x,))
    assert not dbg.pass_results[0].changed and "training mode" in dbg.pass_results[0].notes[0]
    assert dbg.report().notes and any("training mode" in n for n in dbg.report().notes)


class BrokenFuse(Fuse):
    def fold(self, layer, bn):
        fused = super().fold(layer, bn)
        with torch.no_grad():
            fused.bias.add_(1.0)
        return fused


def test_a_wrong_fold_raises_instead_of_returning_a_wrong_model():
    model = _randomise_bn(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    with pytest.raises(fxdebug.PassError, match="changes the output by up to") as info:  # fold() is the snapshot's copy
        fxdebug.instrument(model, [BrokenFuse()], example_inputs=(torch.randn(2, 3, 4, 4),), frontend="symbolic")
    assert info.value.node == "_1"


def test_residual_cnn_fuses_every_pair_and_composes_with_other_passes():
    model, (x,) = ZOO["residual_cnn"]()
    _randomise_bn(model)
    dbg = fxdebug.instrument(model, [Fuse()], example_inputs=(x,), frontend="symbolic")  # counts the snapshot graph's fused nodes
    assert len([n for n in dbg.graph.nodes if "fuse" in fxdebug.authoring.node_meta(n).transforms]) == 10
    swapped = fxdebug.instrument(model, [SwapActivation()], example_inputs=(x,))
    both = fxdebug.instrument(model, [Fuse(), SwapActivation(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    with torch.no_grad():
        torch.testing.assert_close(dbg(x), model(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(both(x), swapped(x), atol=1e-5, rtol=1e-5)
    rows = {r["node"]: r for r in both.report().rows}
    fused_names = [n.name for n in both.graph.nodes if "fuse" in fxdebug.authoring.node_meta(n).transforms]
    assert all(rows[name]["calls"] == 1 for name in fused_names)
    pruned = fxdebug.instrument(model, [Fuse(), PruneMasks(0.25, structured="channels"), SwapActivation()], example_inputs=(x,))
    assert torch.isfinite(pruned(x)).all()
    assert sum("prune-masks" in fxdebug.authoring.node_meta(n).transforms for n in pruned.graph.nodes) == 10  # every conv; fc (the output) kept


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_outputs_unchanged_in_eval(name):
    model, inputs = ZOO[name]()
    model.eval()
    dbg = fxdebug.instrument(model, [Fuse()], example_inputs=inputs)
    with torch.no_grad():
        torch.testing.assert_close(dbg(*inputs), model(*inputs), atol=1e-5, rtol=1e-5)


def test_transforms_doc_example_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "transforms.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    ns: dict = {}
    exec(compile(block.replace("print(", "_ = ("), "transforms.md", "exec"), ns)
    note = ns["dbg"].pass_results[0].notes[0]  # the live default folds in the graph; a snapshot names a fused copy
    assert note.startswith("fused ") and "stem_0" in note and "stem_1" in note and "max |diff|" in note
    assert abs(ns["sparsity"](ns["dbg"])["global"] - 0.3) < 1e-3


def test_fused_layers_keep_the_models_state_dict_keys():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    dbg = fxdebug.instrument(model, [Fuse()], example_inputs=(x,), frontend="symbolic")
    assert any(n.startswith("fxdebug.") for n, _ in dbg.named_parameters())  # the snapshot's fused copies exist
    assert list(dbg.state_dict()) == list(model.state_dict())
    model.load_state_dict(dbg.state_dict())
    dbg.load_state_dict(model.state_dict())
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert list(loaded.state_dict()) == list(model.state_dict())
    assert torch.equal(loaded(x), dbg(x))


def test_export_graphs_are_fused_too():
    """B3: an export (aten-level) graph's aten.conv2d → aten.batch_norm and aten.linear → batch_norm
    pairs are folded like module pairs, instead of being left alone without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 16),
                          nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).eval()
    for bn in (model[1], model[5]):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8, 8)
    dbg = fxdebug.instrument(model, [Fuse()], example_inputs=(x,), frontend="export")
    assert dbg.trace_info.frontend == "export"
    fused = [n for n in dbg.graph.nodes if "fuse" in fxdebug.authoring.node_meta(n).transforms]
    assert [fxdebug.authoring.node_meta(n).stands_for for n in fused] == ["0", "4"]
    assert not [n for n in dbg.graph.nodes if fxdebug.authoring.is_batchnorm(n, dbg)]
    dbg.graph.lint()
    torch.testing.assert_close(dbg(x), model(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dbg.to_module()(x), model(x), atol=1e-5, rtol=1e-5)
