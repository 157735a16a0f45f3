"""The flight recorder: Recorder(history=N) / NaNCheck(history=N, on_nonfinite=...)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, Recorder, Shadow, StatCollector
from zoo import ZOO
from syncs import CountSyncs



class LossScale(nn.Module):
    """Scenario 11 in small: a log whose input goes negative on one batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return torch.log(x[:, :1] + 1.0) + h


def _batches(n: int, bad: int):
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        x = torch.rand(3, 8, generator=g)
        if i == bad:
            x[1, 0] = -4.0  # log(-3): NaN at call `bad`
        yield x


def test_recorder_returns_the_calls_before_a_planted_nan():
    model = LossScale()
    fired = []
    dbg = fxdebug.instrument(model, [NaNCheck(history=5, on_nonfinite=fired.append)], example_inputs=(torch.rand(3, 8),))
    for i, x in enumerate(_batches(12, bad=9)):
        dbg(x)
        assert len(fired) == (1 if i >= 9 else 0)  # at the end of the bad call, once
    history = fired[0].history
    assert history.calls == [5, 6, 7, 8, 9]  # the 4 calls before the NaN and the NaN call itself
    assert history.first_nonfinite == (9, "log")
    assert [c.call for c in history.before(9)] == [5, 6, 7, 8]
    assert all(not r.nonfinite for r in history.before(9))
    before, bad = history.at(8).nodes["log"], history.at(9).nodes["log"]
    assert not before["nonfinite"] and before["nan"] == 0 and math.isfinite(before["mean"])
    assert bad["nonfinite"] and bad["nan"] == 1 and math.isnan(bad["mean"])
    assert history.at(9).nodes["fc"]["nan"] == 0  # the Linear stayed finite in the bad call
    assert fired[0].first_nonfinite == "log"
    later = dbg.report().history  # the ring moved on: the last 5 calls
    assert later.calls == [7, 8, 9, 10, 11]
    last = list(_batches(12, bad=9))[11]
    with torch.no_grad():
        assert later.at(11).nodes["fc"]["mean"] == pytest.approx(float(model.fc(last).mean()), rel=1e-5)


def test_recorded_statistics_match_the_tensor():
    model, (x,) = ZOO["transformer_block"]()
    model.eval()
    dbg = fxdebug.instrument(model, [Recorder(history=3), Shadow()], example_inputs=(x,))
    xs = [x * (i + 1) for i in range(4)]
    for xi in xs:
        dbg(xi)
    h = dbg.report().history
    assert h.calls == [1, 2, 3]
    ln = h.at(2).nodes["ln1"]
    ref = model.ln1(xs[2]).detach()
    assert ln["mean"] == pytest.approx(float(ref.mean()), abs=1e-6)
    assert ln["std"] == pytest.approx(float(ref.std(unbiased=False)), rel=1e-4)
    assert ln["norm"] == pytest.approx(float(ref.norm()), rel=1e-6)
    so_far = torch.cat([model.ln1(xi).detach().flatten() for xi in xs[:3]])
    assert ln["max_so_far"] == pytest.approx(float(so_far.max())) and ln["min_so_far"] == pytest.approx(float(so_far.min()))
    assert [c for c, _ in h.node("attn_qkv")] == [1, 2, 3]
    assert "history" not in str(dbg.report()).split("\n")[1]  # a hidden column: not in the table


def test_no_host_sync_per_call_and_one_with_on_nonfinite():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [Recorder(history=4), StatCollector()], example_inputs=(x,))
    mode = CountSyncs()
    with mode:
        for _ in range(6):
            dbg(x)
    assert mode.syncs == 0
    dbg = fxdebug.instrument(model, [NaNCheck(history=4, on_nonfinite=lambda r: None)], example_inputs=(x,))
    mode = CountSyncs()
    with mode:
        for _ in range(6):
            dbg(x)
    assert mode.syncs == 6  # the one documented flag read per call


def test_shadow_does_not_sync():
    model, (x,) = ZOO["transformer_block"]()
    dbg = fxdebug.instrument(model, [Shadow()], example_inputs=(x,))
    mode = CountSyncs()
    with mode:
        dbg(x)
    assert mode.syncs == 0


def test_on_nonfinite_path_dumps_the_report(tmp_path):
    path = tmp_path / "nan.json"
    dbg = fxdebug.instrument(LossScale(), [Recorder(history=3, on_nonfinite=str(path))], example_inputs=(torch.rand(3, 8),))
    for x in _batches(6, bad=4):
        dbg(x)
    data = json.loads(path.read_text())
    rows = {r["node"]: r for r in data["rows"]}
    assert [c for c, _ in rows["log"]["history"]] == [2, 3, 4]
    assert rows["log"]["history"][-1][1]["nonfinite"] is True


def test_reset_rearms_and_bad_options():
    fired = []
    dbg = fxdebug.instrument(LossScale(), [NaNCheck(history=2, on_nonfinite=fired.append)], example_inputs=(torch.rand(3, 8),))
    bad = list(_batches(2, bad=0))[0]
    dbg(bad)
    dbg(bad)
    assert len(fired) == 1
    dbg.reset()
    dbg(bad)
    assert len(fired) == 2
    with pytest.raises(fxdebug.UsageError):
        Recorder(history=0)
    with pytest.raises(fxdebug.UsageError):
        NaNCheck(history=4, on_nonfinite=3)
    assert fxdebug.instrument(LossScale(), [NaNCheck()], example_inputs=(torch.rand(3, 8),)).report().history is None


def test_tiny_gpt2_recorder_keeps_the_calls_before_a_corrupted_embedding():
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(1, 100, (2, 8))
    fired = []
    dbg = fxdebug.instrument(model, [NaNCheck(history=3, on_nonfinite=fired.append)], example_inputs={"input_ids": ids})
    for step in range(6):
        batch = ids.clone()
        if step == 4:
            batch[0, 3] = 0
            with torch.no_grad():
                model.transformer.wte.weight[0, 5] = float("inf")  # one corrupted embedding entry
        dbg(input_ids=batch)
        assert len(fired) == (1 if step >= 4 else 0)
    history = fired[0].history
    assert history.calls == [2, 3, 4]
    call, node = history.first_nonfinite
    assert call == 4 and fired[0].row(node)["module"] == "transformer.wte"
    assert all(not r.nonfinite for r in history.before(4))
