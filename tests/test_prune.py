"""PruneMasks: exact sparsity, masks in the graph, masked gradients, coupled channels kept consistent."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import PruneMasks
from fxdebug.passes.prune import sparsity, unmask
from fxdebug.passes.prune_groups import channel_groups
from zoo import ZOO




def _masks(dbg):
    """``{layer: weight mask}`` from every captured graph (the live capture's parts, or a snapshot's one graph)."""
    out = {}
    for part in dbg.parts().values():
        for n in part.graph.nodes:
            info = fxdebug.authoring.node_meta(n).transforms.get("prune-masks")
            mod = fxdebug.authoring.get_module(part, n) if info else None
            if mod is None or getattr(mod, "name", "weight") != "weight":
                continue
            mask = mod.mask("weight") if hasattr(mod, "mask") else getattr(mod, "mask_value", None)
            out.setdefault(info["layer"], mask if mask is not None else mod._fxdebug_masks["weight"])
    return out


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_unstructured_sparsity_is_exact_and_weights_untouched(scope):
    model, (x,) = ZOO["residual_cnn"]()
    state = copy.deepcopy(model.state_dict())
    dbg = fxdebug.instrument(model, [PruneMasks(0.3, scope=scope)], example_inputs=(x,))
    masks = _masks(dbg)
    assert len(masks) == 11
    counts = {p: int((m == 0).sum()) for p, m in masks.items()}
    if scope == "layer":
        for p, m in masks.items():
            assert abs(counts[p] - 0.3 * m.numel()) <= 1, p
    total = sum(m.numel() for m in masks.values())
    assert abs(sum(counts.values()) - 0.3 * total) <= 1
    stats = sparsity(dbg)
    assert stats["weights"] == total and stats["global"] == pytest.approx(sum(counts.values()) / total)
    assert any(n.startswith("global:") for n in dbg.pass_results[0].notes)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])
    assert set(dbg.state_dict()) == set(model.state_dict())
    # the masked model computes with weight * mask
    masked = copy.deepcopy(model)
    with torch.no_grad():
        for p, m in masks.items():
            masked.get_submodule(p).weight.mul_(m)
        torch.testing.assert_close(dbg(x), masked(x))
        if dbg.trace_info.frontend == "dynamo":  # the live default: its graphs are Dynamo's, an edit would not run
            with pytest.raises(fxdebug.UsageError, match="live"):
                unmask(dbg)
            dbg = fxdebug.instrument(model, [PruneMasks(0.3, scope=scope)], example_inputs=(x,), frontend="symbolic")
        unmask(dbg)
        torch.testing.assert_close(dbg(x), model(x))


def test_masked_gradients_are_zero_and_masked_weights_never_move():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(10, 6)
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, scope="layer")], example_inputs=(x,))
    masks = _masks(dbg)
    before = model[0].weight.detach().clone()
    opt = torch.optim.SGD(dbg.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        dbg(x).pow(2).sum().backward()
        assert torch.equal(model[0].weight.grad[masks["0"] == 0], torch.zeros(int((masks["0"] == 0).sum())))
        opt.step()
    moved = model[0].weight.detach() != before
    assert not moved[masks["0"] == 0].any() and moved[masks["0"] == 1].any()


def test_bake_zeroes_copies_that_stay_zero_through_training():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(10, 6)
    original = model[0].weight.detach().clone()
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, bake=True)], example_inputs=(x,))
    baked = [dbg.get_submodule(str(n.target)) for n in dbg.graph.nodes if "prune-masks" in fxdebug.authoring.node_meta(n).transforms]
    assert len(baked) == 2 and all(b is not model[0] and b is not model[2] for b in baked)
    opt = torch.optim.AdamW(dbg.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        dbg(x).pow(2).sum().backward()
        opt.step()
    for b in baked:
        zero = b._fxdebug_masks["weight"] == 0
        assert zero.any() and torch.equal(b.weight[zero], torch.zeros(int(zero.sum())))
    assert torch.equal(model[0].weight, original)


def _importance_model():
    lin = nn.Linear(8, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.full((2, 8), 0.1))
        lin.weight[:, :2] = 5.0  # large weights on two features that the data never uses
    x = torch.randn(16, 8)
    x[:, :2] = 0.0
    return nn.Sequential(lin), x


@pytest.mark.parametrize("importance", ["grad", "activation"])
def test_data_driven_importance_prunes_unused_features_first(importance):
    lin, x = _importance_model()
    kw = {"loss_fn": lambda out: out.pow(2).sum()} if importance == "grad" else {}
    dbg = fxdebug.instrument(lin, [PruneMasks(0.25, importance=importance, **kw)], example_inputs=(x,))
    mask = next(iter(_masks(dbg).values()))
    assert (mask[:, :2] == 0).all() and (mask[:, 2:] == 1).all()
    by_size = fxdebug.instrument(lin, [PruneMasks(0.25)], example_inputs=(x,))
    assert (next(iter(_masks(by_size).values()))[:, :2] == 1).all()


def test_grad_importance_needs_a_loss():
    with pytest.raises(fxdebug.UsageError, match="loss_fn"):
        PruneMasks(0.5, importance="grad")


def test_structured_channels_keep_residual_couplings_consistent():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels", scope="layer")], example_inputs=(x,))
    chans = {fxdebug.authoring.node_meta(n).transforms["prune-masks"]["layer"]: fxdebug.authoring.node_meta(n).transforms["prune-masks"]["channels"]
             for n in dbg.graph.nodes if "prune-masks" in fxdebug.authoring.node_meta(n).transforms}
    trunk1 = chans["stem.0"]
    assert trunk1 and chans["layer1.0.conv2"] == trunk1 == chans["layer1.1.conv2"] == chans["stem.1"]
    assert chans["layer2.0.down.0"] == chans["layer2.0.conv2"] == chans["layer2.1.conv2"]
    for layer in ("stem.0", "layer1.0.conv1", "layer2.1.conv1"):
        c = dbg.get_submodule(layer.replace(".", ".")).weight.shape[0]
        assert abs(len(chans[layer]) - 0.5 * c) <= 1
    assert "fc" not in chans  # the classifier's outputs are the model's outputs: kept by default
    values = fxdebug.authoring.node_values(dbg, fxdebug.PassContext((x,)), ["iadd", "iadd_1", "layer1_0_bn1"])
    assert values["iadd"][:, trunk1].abs().max() == 0 and values["iadd_1"][:, trunk1].abs().max() == 0
    assert values["layer1_0_bn1"][:, chans["layer1.0.conv1"]].abs().max() == 0
    assert values["iadd"][:, [c for c in range(8) if c not in trunk1]].abs().max() > 0


class CatAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 2, 1), nn.Conv2d(3, 3, 1), nn.Conv2d(3, 5, 1)
        self.d = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = torch.cat([self.a(x), self.b(x)], dim=1) + self.c(x)
        return y, self.d(x) + x


def test_channel_groups_follow_concatenation_and_pin_inputs():
    model, x = CatAdd(), torch.randn(1, 3, 4, 4)
    gm = fxdebug.trace(model, (x,))
    groups = channel_groups(gm, fxdebug.PassContext((x,)), {"a": 2, "b": 3, "c": 5, "d": 3})
    as_sets = {frozenset(g) for g in groups.groups}
    assert frozenset({("a", 1), ("c", 1)}) in as_sets and frozenset({("b", 0), ("c", 2)}) in as_sets
    pinned = [groups.pinned[i] for i, g in enumerate(groups.groups) if g[0][0] == "d"]
    assert pinned and all(p and "adds a value" in p for p in pinned)
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels")], example_inputs=(x,))
    assert "d" not in {fxdebug.authoring.node_meta(n).transforms.get("prune-masks", {}).get("layer") for n in dbg.graph.nodes}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_prunes_without_breaking(name):
    model, inputs = ZOO[name]()
    dbg = fxdebug.instrument(model, [PruneMasks(0.5)], example_inputs=inputs)
    for part in dbg.parts().values():  # the live default may hold several graphs (a graph break)
        part.graph.lint()
    out = dbg(*inputs)
    leaves = out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else [out]
    assert all(torch.isfinite(t).all() for t in leaves)


def test_structured_pruning_keeps_the_output_layer_by_default_and_says_so():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels")], example_inputs=(x,))
    pruned = {fxdebug.authoring.node_meta(n).transforms["prune-masks"]["layer"] for n in dbg.graph.nodes if "prune-masks" in fxdebug.authoring.node_meta(n).transforms}
    assert "fc" not in pruned and "stem.0" in pruned
    assert any(n.startswith("kept fc: its output channels are the model's outputs") for n in dbg.pass_results[-1].notes)
    with torch.no_grad():
        assert (dbg(x) != 0).all(dim=0).all()  # no class is pinned to logit 0
    opted = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels", prune_outputs=True)], example_inputs=(x,))
    zero = {fxdebug.authoring.node_meta(n).transforms["prune-masks"]["layer"]: fxdebug.authoring.node_meta(n).transforms["prune-masks"]["channels"]
            for n in opted.graph.nodes if "prune-masks" in fxdebug.authoring.node_meta(n).transforms}["fc"]
    assert zero and torch.equal(opted(x)[:, zero], torch.zeros(x.shape[0], len(zero)))


@pytest.mark.parametrize("structured", [False, "channels"])
def test_baked_masks_keep_the_models_state_dict_keys(structured):
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, structured=structured, bake=True)], example_inputs=(x,))
    assert list(dbg.state_dict()) == list(model.state_dict())
    model.load_state_dict(dbg.state_dict())
    dbg.load_state_dict(model.state_dict())
    assert any(p.requires_grad for n, p in dbg.named_parameters() if n.startswith("fxdebug."))  # the copies train


def test_export_graphs_are_masked_like_module_graphs_or_refused_clearly():
    """B3: on an export (aten-level) graph PruneMasks masks the weights the aten ops read (the same
    masks as on the symbolic graph); what it cannot do there yet it refuses, naming the way out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 16), nn.ReLU(),
                          nn.Linear(16, 4)).eval()
    x = torch.randn(2, 3, 8, 8)
    sym = fxdebug.instrument(model, [PruneMasks(0.5)], example_inputs=(x,))
    exp = fxdebug.instrument(model, [PruneMasks(0.5)], example_inputs=(x,), frontend="export")
    assert exp.trace_info.frontend == "export"
    masked = {fxdebug.authoring.node_meta(n).stands_for: fxdebug.authoring.node_meta(n).transforms["prune-masks"]
              for n in exp.graph.nodes if "prune-masks" in fxdebug.authoring.node_meta(n).transforms}
    assert set(masked) == {"0", "3", "5"} and all(info["masked"] > 0 for info in masked.values())
    torch.testing.assert_close(exp(x), sym(x))
    torch.testing.assert_close(exp.to_module()(x), sym(x))
    assert torch.equal(model[0].weight, sym.get_submodule("0").weight)  # the model keeps its weights
    # issue 35 B13: channels of a linear -> activation -> linear pair are pruned on such graphs too (rows of the
    # first, input columns of the second); the conv is kept whole, and the notes say why
    chan = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels")], example_inputs=(x,), frontend="export")
    masks = {(m.path, m.name): m.mask_value for m in chan.modules() if type(m).__name__ == "MaskedValue"}
    assert set(masks) == {("3", "weight"), ("3", "bias"), ("5", "weight")}
    assert torch.equal((masks[("3", "weight")] == 0).all(1), (masks[("5", "weight")] == 0).all(0))
    assert int((masks[("3", "bias")] == 0).sum()) == 8
    notes = next(r for r in chan.pass_results if r.pass_name == "prune-masks").notes
    assert any("0 (a conv called as a function" in n for n in notes)
    with pytest.raises(fxdebug.PassError, match="bake=True.*What works on this graph"):
        fxdebug.instrument(model, [PruneMasks(0.5, structured="channels", bake=True)], example_inputs=(x,), frontend="export")
