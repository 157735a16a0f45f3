"""ParamUpdates: per-parameter update norm and update/weight ratio, kept without a sync; an lr spike
on one parameter group is an update_spike finding for that group's parameters only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import ParamUpdates
from syncs import CountSyncs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def data(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, 6, generator=gen) for _ in range(n)]


def setup(lr: float = 1e-2) -> tuple[nn.Module, Any, torch.optim.Optimizer, ParamUpdates]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([{"params": model.fc1.parameters()}, {"params": model.fc2.parameters()}], lr=lr)
    watch = ParamUpdates(opt)
    dbg = fxdebug.instrument(model, passes=[watch], example_inputs=(data(1)[0],))
    return model, dbg, opt, watch


def step(dbg: Any, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    dbg(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_update_norm_and_ratio_are_the_last_steps_change() -> None:
    model, dbg, opt, watch = setup()
    xs = data(4)
    for x in xs[:3]:
        step(dbg, opt, x)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    step(dbg, opt, xs[3])
    rows = {r["param"]: r for r in watch.rows()}
    assert set(rows) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert rows["fc2.bias"]["group"] == 1
    for name, p in model.named_parameters():
        change = float((p.detach() - before[name]).norm())
        assert rows[name]["update_norm"] == pytest.approx(change, rel=1e-5)
        assert rows[name]["update_ratio"] == pytest.approx(change / float(before[name].norm()), rel=1e-5)
    rep = dbg.report()
    fc2 = rep["fc2"]
    assert fc2["param_updates"]["fc2.weight"]["update_norm"] == pytest.approx(rows["fc2.weight"]["update_norm"])
    both = (rows["fc2.weight"]["update_norm"] ** 2 + rows["fc2.bias"]["update_norm"] ** 2) ** 0.5
    assert fc2["update_norm"] == pytest.approx(both, rel=1e-5)
    assert not [f for f in rep.findings() if f.kind == "update_spike"]  # a steady run has no spike


def test_an_lr_spike_on_one_group_is_a_finding_for_that_group_only() -> None:
    model, dbg, opt, watch = setup()
    for i, x in enumerate(data(10)):
        opt.param_groups[1]["lr"] = 1.0 if i == 7 else 1e-2  # 100x for one step, on fc2's group
        step(dbg, opt, x)
    rows = {r["param"]: r for r in watch.rows()}
    assert rows["fc2.weight"]["update_spike"] >= 10 and rows["fc2.weight"]["update_spike_step"] == 7
    assert rows["fc1.weight"]["update_spike"] < 10 and rows["fc1.bias"]["update_spike"] < 10
    rep = dbg.report()
    spikes = [f for f in rep.findings() if f.kind == "update_spike"]
    assert [f.node for f in spikes] == ["fc2"]
    assert "fc2." in spikes[0].message and "step 7" in spikes[0].message



def test_watching_the_steps_adds_no_sync() -> None:
    model, dbg, opt, watch = setup()
    with CountSyncs() as counter:
        for x in data(6):
            step(dbg, opt, x)
    assert counter.syncs == 0
    assert watch.table.steps == 6


def test_works_through_a_guard_and_names_parameters_without_a_graph_use() -> None:
    torch.manual_seed(0)
    model = Net()
    extra = nn.Parameter(torch.ones(2))
    g = fxdebug.guard(torch.optim.Adam(list(model.parameters()) + [extra], lr=1e-2))
    watch = ParamUpdates(g)
    dbg = fxdebug.instrument(model, passes=[watch], example_inputs=(data(1)[0],))
    for x in data(3):
        dbg(x).sum().backward()
        g.step()
        g.zero_grad()
    rows = {r["param"]: r for r in watch.rows()}
    assert rows["param4"]["update_norm"] is None  # never had a gradient: never updated
    assert rows["fc1.weight"]["update_norm"] > 0
    with pytest.raises(fxdebug.UsageError, match="Optimizer"):
        ParamUpdates([extra])


def test_history_keeps_each_parameters_recent_ratios_in_step_order() -> None:
    model, dbg, opt, watch = setup()
    for i, x in enumerate(data(70)):
        opt.param_groups[1]["lr"] = 1.0 if i == 68 else 1e-2
        step(dbg, opt, x)
    hist = watch.history()
    assert set(hist) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    ratios = hist["fc2.weight"]
    assert len(ratios) == 64  # the last 64 of 70 steps, oldest first: step 68 is second to last
    assert ratios[-2] == max(ratios) and ratios[-2] > 10 * ratios[-3]
    assert ratios[-1] == pytest.approx(watch.rows()[2]["update_ratio"])


def test_each_steps_update_reaches_the_flight_recorders_history() -> None:
    from fxdebug.passes import Recorder

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    watch = ParamUpdates(opt)
    dbg = fxdebug.instrument(model, passes=[Recorder(history=4), watch], example_inputs=(data(1)[0],))
    changes = []
    for x in data(6):
        before = [p.detach().clone() for p in model.fc2.parameters()]
        step(dbg, opt, x)
        changes.append(sum(float((p.detach() - b).norm()) ** 2 for p, b in zip(model.fc2.parameters(), before)) ** 0.5)
    hist = dbg.report().history
    assert hist.calls == [2, 3, 4, 5]  # the recorder's last 4 calls; each step follows its call
    for call in hist.calls:
        fc2 = hist.at(call).nodes["fc2"]
        assert fc2["update_norm"] == pytest.approx(changes[call], rel=1e-5)
        assert fc2["update_skipped"] is False and "mean" in fc2  # beside the recorder's own statistics
        assert set(fc2["param_updates"]) == {"fc2.weight", "fc2.bias"}
    assert "update_norm" not in hist.at(5).nodes.get("relu", {})  # only the nodes whose parameters moved


@pytest.mark.parametrize("kind", ["sgd", "adamw-fused"])
@pytest.mark.parametrize("watch_inner", [False, True])
def test_a_step_the_guard_took_back_shows_no_update(kind: str, watch_inner: bool) -> None:
    from fxdebug.passes import Recorder

    torch.manual_seed(0)
    model = Net()
    opt = (torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9) if kind == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    g = fxdebug.guard(opt)
    watch = ParamUpdates(opt if watch_inner else g)
    dbg = fxdebug.instrument(model, passes=[Recorder(history=8), watch], example_inputs=(data(1)[0],))
    xs = data(7)
    xs[4] = xs[4].clone()
    xs[4][1, 2] = float("nan")  # step 4 is taken back
    for i, x in enumerate(xs):
        dbg(x).square().mean().backward()
        g.step()
        g.zero_grad()
        if i == 4:
            rows = {r["param"]: r for r in watch.rows()}
            assert all(r["update_norm"] == 0.0 and r["update_ratio"] == 0.0 and r["update_skipped"] for r in rows.values())
            assert dbg.report()["fc1"]["update_skipped"] is True
    assert int(g.skipped) == 1
    rows = {r["param"]: r for r in watch.rows()}
    assert all(r["update_norm"] > 0 and not r["update_skipped"] for r in rows.values())  # step 6 moved them again
    assert all(r["update_spike"] < 10 for r in rows.values())  # the rejected update is no spike either
    ratios = watch.history()["fc1.weight"]
    assert ratios[4] is None and all(v is not None and v > 0 for i, v in enumerate(ratios) if i != 4)
    hist = dbg.report().history
    bad, good = hist.at(4).nodes["fc1"], hist.at(5).nodes["fc1"]
    assert bad["update_skipped"] is True and bad["update_norm"] == 0.0
    assert good["update_skipped"] is False and good["update_norm"] > 0
    assert hist.at(4).nonfinite  # the recorder itself still shows the NaN call


def test_figures_folded_in_blocks_equal_a_step_by_step_reference_without_a_sync() -> None:
    """The table folds its pending steps every 64 steps and when read: the figures, spikes and
    history must be those of a plain per-step computation, across folds and mid-run reads."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD([{"params": model.fc1.parameters()}, {"params": model.fc2.parameters()}], lr=1e-2,
                          momentum=0.9)
    watch = ParamUpdates(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    ratios: list[list[float]] = [[] for _ in params]
    spike = [(0.0, -1)] * len(params)
    syncs = 0
    for i, x in enumerate(data(140)):
        opt.param_groups[1]["lr"] = 1.0 if i in (70, 130) else 1e-2
        before = [p.detach().clone() for p in params]
        model(x).square().mean().backward()
        with CountSyncs() as counter:
            opt.step()
        syncs += counter.syncs
        opt.zero_grad()
        for j, (p, b) in enumerate(zip(params, before)):
            r = float((p.detach() - b).norm() / b.norm())
            prev = torch.tensor(ratios[j][-64:])
            if len(prev) >= 3 and float(prev.nanmedian()) > 0 and r / float(prev.nanmedian()) > spike[j][0]:
                spike[j] = (r / float(prev.nanmedian()), i)
            ratios[j].append(r)
        if i in (40, 100):  # a read between folds
            assert [r["update_ratio"] for r in watch.rows()] == pytest.approx([rs[-1] for rs in ratios], rel=1e-4)
    assert syncs == 0
    rows = watch.rows()
    assert [r["update_ratio"] for r in rows] == pytest.approx([rs[-1] for rs in ratios], rel=1e-4)
    assert [r["update_spike_step"] for r in rows] == [s[1] for s in spike]
    assert [r["update_spike"] for r in rows] == pytest.approx([s[0] for s in spike], rel=1e-3)
    assert all(s[1] in (70, 130) and s[0] >= 10 for s in spike[2:])  # the lr spikes on group 1 (fc2)
    assert list(watch.history().values()) == [pytest.approx(rs[-64:], rel=1e-4) for rs in ratios]
