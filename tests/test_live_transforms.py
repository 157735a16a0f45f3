"""Transforms on the live (Dynamo) capture (issue 32 item 5): SwapActivation, PruneMasks and Fuse change the graphs
Dynamo hands over, so the transformed model follows load_state_dict, train()/eval() and parameter updates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.authoring import graph_record
from fxdebug.passes import Fuse, PruneMasks, StatCollector, SwapActivation


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.conv(x)))
        return self.fc(torch.relu(h.mean((2, 3))))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():  # running statistics that are not the defaults, so a fold really changes the weights
        net.bn.running_mean.uniform_(-1, 1)
        net.bn.running_var.uniform_(0.5, 2)
        net.bn.weight.uniform_(0.5, 2)
        net.bn.bias.uniform_(-1, 1)
    return net.eval()


X = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(1))
TRANSFORMS = [lambda: SwapActivation(0.1), lambda: PruneMasks(0.5), lambda: Fuse()]
IDS = ["swap", "prune", "fuse"]


def _live(model: nn.Module, make) -> fxdebug.Instrumented:
    return fxdebug.instrument(model, [make(), StatCollector()], (X,), frontend="dynamo")


def _fuse_notes(dbg) -> list[str]:
    return [n for part in dbg.parts().values() for r in graph_record(part).passes if r.pass_name == "fuse"
            for n in r.notes]


@pytest.mark.parametrize("make", TRANSFORMS, ids=IDS)
def test_live_transform_matches_snapshot_transform(make):
    live = _live(_net(), make)
    snap = fxdebug.instrument(_net(), [make(), StatCollector()], (X,), frontend="symbolic")
    assert live.trace_info.frontend == "dynamo"
    torch.testing.assert_close(live(X), snap(X), rtol=1e-5, atol=1e-6)
    assert not torch.equal(live(X), _net()(X)) or make is TRANSFORMS[2]  # swap and prune change the output
    auto = fxdebug.instrument(_net(), [make(), StatCollector()], (X,))  # the default rides the live capture too
    assert make().live_capture is True and auto.trace_info.frontend == "dynamo"
    torch.testing.assert_close(auto(X), live(X), rtol=0, atol=0)


def test_structured_pruning_keeps_the_snapshot_under_auto():
    """Channels on Dynamo's graphs are a feed-forward block's only (commit 3aa39cc): auto takes the snapshot."""
    dbg = fxdebug.instrument(_net(), [PruneMasks(0.5, structured="channels")], (X,))
    assert dbg.trace_info.frontend != "dynamo"
    assert any("live_capture is False" in n for n in dbg.trace_info.notes)


def test_live_prune_after_fuse_ranks_and_masks_the_folded_weights():
    """Fuse then PruneMasks: the snapshot prunes the fused layers' weights; the live capture masks the weights the
    folded layer computes with (ranked among all layers as the snapshot ranks them), not only the unfused layers."""
    live = fxdebug.instrument(_net(), [Fuse(), PruneMasks(0.5)], (X,), frontend="dynamo")
    snap = fxdebug.instrument(_net(), [Fuse(), PruneMasks(0.5)], (X,), frontend="symbolic")
    masked = {m.path for part in live.parts().values() for m in part.fxdebug.modules() if type(m).__name__ == "MaskedValue"}
    assert masked == {"conv", "fc"}
    torch.testing.assert_close(live(X), snap(X), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(live.to_module()(X), live(X), rtol=1e-5, atol=1e-6)


def test_live_swap_follows_load_state_dict():
    model = _net(0)
    dbg = _live(model, TRANSFORMS[0])
    model.load_state_dict(_net(5).state_dict())
    fresh = _live(_net(5), TRANSFORMS[0])
    torch.testing.assert_close(dbg(X), fresh(X), rtol=0, atol=0)


def test_live_prune_masks_the_live_weights():
    model = _net(0)
    dbg = _live(model, TRANSFORMS[1])
    masks = {}
    for part in dbg.parts().values():
        for m in part.fxdebug.modules():
            if type(m).__name__ == "MaskedValue":
                masks[m.path] = m.mask_value.clone()
    assert set(masks) == {"conv", "fc"}
    model.load_state_dict(_net(5).state_dict())  # the masks stay (a pruning decision), the weights are the new ones
    want = _net(5)
    with torch.no_grad():
        want.conv.weight.mul_(masks["conv"])
        want.fc.weight.mul_(masks["fc"])
    torch.testing.assert_close(dbg(X), want(X), rtol=1e-6, atol=1e-6)
    rows = {r["node"]: r for r in dbg.report().rows}
    assert rows["conv"]["calls"] >= 1 and rows["fc"]["calls"] >= 1


def test_live_fuse_follows_load_state_dict_where_the_snapshot_does_not():
    model, snap_model = _net(0), _net(0)
    dbg = _live(model, TRANSFORMS[2])
    snap = fxdebug.instrument(snap_model, [Fuse()], (X,), frontend="symbolic")
    new = _net(5).state_dict()
    model.load_state_dict(new)
    snap_model.load_state_dict(new)
    fresh = fxdebug.instrument(_net(5), [Fuse()], (X,), frontend="symbolic")
    torch.testing.assert_close(dbg(X), fresh(X), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dbg(X), _net(5)(X), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(snap(X), fresh(X), atol=1e-3)  # the snapshot's fused copy keeps the old weights
    assert any("folded in the graph" in n for n in _fuse_notes(dbg))


def test_live_fuse_follows_parameter_updates_and_gradients_reach_the_model():
    model = _net(0)
    dbg = _live(model, TRANSFORMS[2])
    dbg(X).sum().backward()
    assert model.conv.weight.grad is not None and model.bn.weight.grad is not None
    with torch.no_grad():
        model.conv.weight.add_(0.5)
        model.bn.running_var.mul_(3)
    torch.testing.assert_close(dbg(X), model(X), rtol=1e-5, atol=1e-5)


def test_live_fuse_follows_train_and_eval():
    model = _net(0)
    dbg = _live(model, TRANSFORMS[2])
    model.train()
    twin = _net(0).train()
    torch.testing.assert_close(dbg(X), twin(X), rtol=1e-5, atol=1e-5)  # batch statistics: the pair is left alone
    assert any("training mode" in n for n in _fuse_notes(dbg))
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean)  # the train call updated the statistics
    model.eval()
    twin.eval()
    fresh = fxdebug.instrument(twin, [Fuse()], (X,), frontend="symbolic")
    torch.testing.assert_close(dbg(X), fresh(X), rtol=1e-5, atol=1e-5)  # and the eval graph folds the new ones
    rows = [r for r in dbg.report().rows if r.get("calls")]
    assert rows


@pytest.mark.parametrize("make", TRANSFORMS, ids=IDS)
def test_to_module_of_a_live_transform_carries_it(make):
    model = _net(0)
    dbg = _live(model, make)
    model.load_state_dict(_net(5).state_dict())
    plain = dbg.to_module()
    torch.testing.assert_close(plain(X), dbg(X), rtol=1e-5, atol=1e-5)
    if make is TRANSFORMS[2]:  # the fold is in the plain module, of the weights loaded after instrument()
        assert "self.bn" not in plain.code and "batch_norm" not in plain.code
        torch.testing.assert_close(plain(X), _net(5)(X), rtol=1e-5, atol=1e-5)


def _pair(kind: str):
    torch.manual_seed(0)
    pairs = {
        "conv_no_bias": (nn.Sequential(nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6)), torch.randn(2, 3, 6, 6)),
        "linear": (nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6)), torch.randn(4, 5)),
        "grouped_transpose": (nn.Sequential(nn.ConvTranspose2d(4, 6, 3, groups=2), nn.BatchNorm2d(6)),
                              torch.randn(2, 4, 5, 5)),
        "bn_without_affine": (nn.Sequential(nn.Conv1d(3, 6, 3), nn.BatchNorm1d(6, affine=False)), torch.randn(2, 3, 7)),
    }
    model, x = pairs[kind]
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model.eval(), x


@pytest.mark.parametrize("kind", ["conv_no_bias", "linear", "grouped_transpose", "bn_without_affine"])
def test_live_fuse_folds_each_kind_of_pair(kind):
    model, x = _pair(kind)
    dbg = fxdebug.instrument(model, [Fuse(), StatCollector()], (x,), frontend="dynamo")
    assert any("folded in the graph" in n for n in _fuse_notes(dbg)), _fuse_notes(dbg)
    snap = fxdebug.instrument(_pair(kind)[0], [Fuse()], (x,), frontend="symbolic")
    torch.testing.assert_close(dbg(x), snap(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model[1].running_var.mul_(2)  # the live fold reads the statistics as they are now
    torch.testing.assert_close(dbg(x), model(x), rtol=1e-5, atol=1e-5)
