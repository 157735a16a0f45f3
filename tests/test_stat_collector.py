"""StatCollector: numbers equal a direct computation on the captured tensors, over several
calls, forward and backward; dead channels; no_grad, eval, in-place ops."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import Capture, StatCollector
from zoo import ZOO


def direct(tensors: list[torch.Tensor]) -> dict[str, float]:
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    return {
        "count": flat.numel(), "mean": flat.mean().item(), "std": flat.std(unbiased=False).item(),
        "min": flat.min().item(), "max": flat.max().item(), "mean_abs": flat.abs().mean().item(),
        "zero_frac": (flat == 0).double().mean().item(),
        "norm": sum(t.double().norm().item() for t in tensors) / len(tensors),
    }


def assert_stats(row: dict, tensors: list[torch.Tensor], prefix: str = "") -> None:
    want = direct(tensors)
    rms = math.sqrt(want["std"] ** 2 + want["mean"] ** 2)
    assert row[prefix + "count"] == want["count"]
    for key in ("mean", "min", "max", "mean_abs", "zero_frac", "norm"):
        assert row[prefix + key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (row["node"], key)
    assert row[prefix + "std"] == pytest.approx(want["std"], rel=1e-4, abs=2e-3 * rms), row["node"]


@pytest.mark.parametrize("name", ["residual_cnn", "transformer_block", "inplace_ops"])
def test_stats_equal_direct_computation_forward_and_backward(name):
    model, inputs = ZOO[name]()
    probe_nodes = fxdebug.instrument(model, [StatCollector()], example_inputs=inputs).report().rows
    names = [r["node"] for r in probe_nodes if r["node"] != "x"]
    cap = Capture(names, grads=True)
    dbg = fxdebug.instrument(model, [StatCollector(grads=True), cap], example_inputs=inputs)
    seen: dict[str, list] = {n: [] for n in names}
    grads: dict[str, list] = {n: [] for n in names}
    for i in range(3):
        xs = tuple(x * (1 + i) for x in inputs)
        dbg(*xs).sum().backward()
        for n in names:
            seen[n].append(cap[n])
            if cap.grad(n) is not None:
                grads[n].append(cap.grad(n))
            cap._observers[n][1].states.pop(("capture", "grad"), None)
    report = dbg.report()
    checked = 0
    for n in names:
        assert_stats(report[n], seen[n])
        if grads[n]:
            assert_stats(report[n], grads[n], prefix="grad_")
            assert report[n]["grad_norm"] > 0
            checked += 1
    assert checked >= 3


def test_dead_channels_and_channel_dims():
    conv = nn.Sequential(nn.Conv2d(2, 4, 1), nn.ReLU())
    with torch.no_grad():
        conv[0].weight.zero_()
        conv[0].bias.copy_(torch.tensor([-1.0, 1.0, -2.0, 0.5]))
    x = torch.randn(3, 2, 5, 5)
    dbg = fxdebug.instrument(conv, [StatCollector()], example_inputs=(x,))
    dbg(x)
    row = dbg.report()["_1"]
    assert row["dead_frac"] == 0.5 and row["channels"] == 4
    assert row["zero_frac"] == 0.5

    lin = nn.Sequential(nn.Linear(3, 6), nn.ReLU())  # (N, T, D): channels are the last dim
    with torch.no_grad():
        lin[0].weight.zero_()
        lin[0].bias.copy_(torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0, -1.0]))
    t = torch.randn(2, 7, 3)
    dbg = fxdebug.instrument(lin, [StatCollector()], example_inputs=(t,))
    dbg(t)
    row = dbg.report()["_1"]
    assert row["channels"] == 6 and row["dead_frac"] == pytest.approx(4 / 6)


def test_dead_fraction_is_over_everything_seen():
    relu = nn.Sequential(nn.Identity(), nn.ReLU())
    x1 = torch.tensor([[1.0, -1.0, -1.0]])
    x2 = torch.tensor([[-1.0, 1.0, -1.0]])
    dbg = fxdebug.instrument(relu, [StatCollector()], example_inputs=(x1,))
    dbg(x1)
    assert dbg.report()["_1"]["dead_frac"] == pytest.approx(2 / 3)
    dbg(x2)
    assert dbg.report()["_1"]["dead_frac"] == pytest.approx(1 / 3)
    dbg.reset()
    dbg(x2)
    assert dbg.report()["_1"]["dead_frac"] == pytest.approx(2 / 3)


def test_no_grad_eval_counts_and_many_calls():
    model, inputs = ZOO["residual_cnn"]()
    model.eval()
    dbg = fxdebug.instrument(model, [StatCollector(grads=True, counts=True)], example_inputs=inputs)
    x = inputs[0].clone()
    x[0, 0, 0, 0] = math.inf
    with torch.no_grad():
        for _ in range(70):  # crosses the fold threshold
            out = dbg(x)
    torch.testing.assert_close(out, model(x), equal_nan=True)
    row = dbg.report()["x"] if "x" in [r["node"] for r in dbg.report().rows] else dbg.report()["stem_0"]
    assert row["calls"] == 70
    stem = dbg.report()["stem_0"]
    assert stem["count"] == 70 * 2 * 8 * 16 * 16
    assert stem["inf"] + stem["nan"] > 0
    assert "grad_mean" not in stem  # no backward under no_grad


def test_where_limits_and_half_precision():
    model, inputs = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector(where="layer1.0")], example_inputs=inputs)
    assert dbg.report().rows and all(r["module"].startswith("layer1.0") for r in dbg.report().rows)
    lin = nn.Linear(4, 4).to(torch.bfloat16)
    x = torch.randn(8, 4, dtype=torch.bfloat16) * 300
    dbg = fxdebug.instrument(lin, [StatCollector()], example_inputs=(x,))
    y = dbg(x)
    row = dbg.report()["_0" if "_0" in [r["node"] for r in dbg.report().rows] else dbg.report().rows[0]["node"]]
    assert row["max"] == pytest.approx(y.float().max().item())
    assert row["mean"] == pytest.approx(y.float().mean().item(), rel=1e-3, abs=1e-2)
