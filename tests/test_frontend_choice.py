"""One function chooses the frontend for ``trace`` and ``instrument`` and says why (issue 32 item 2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.api import choose_frontend
from fxdebug.errors import UsageError
from fxdebug.passes import StatCollector


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_instrument_auto_says_why_it_captured_live_or_took_a_snapshot() -> None:
    x = torch.randn(2, 4)
    live = fxdebug.instrument(_model(), [StatCollector()], example_inputs=(x,))
    assert live.trace_info.frontend == "dynamo"
    assert any(n.startswith("auto: the live Dynamo capture") for n in live.trace_info.notes), live.trace_info.notes
    snap = fxdebug.instrument(_model(), [_Marks()], example_inputs=(x,))  # a transform written for one whole graph
    assert snap.trace_info.frontend == "symbolic"
    assert snap.trace_info.notes[0].startswith("auto: marks transform(s)"), snap.trace_info.notes
    named = fxdebug.instrument(_model(), [StatCollector()], example_inputs=(x,), frontend="dynamo")
    assert not any(n.startswith("auto:") for n in named.trace_info.notes)  # named, not chosen: nothing to explain


def test_trace_and_instrument_share_the_choice() -> None:
    model = _model()
    assert choose_frontend(model, (), {}, "trace") == ("auto", "")  # trace(): the snapshot chain
    assert choose_frontend(model, [StatCollector()], {}, "instrument")[0] == "dynamo"
    assert choose_frontend(model, [StatCollector()], {"frontend": "export"}, "instrument") == ("export", "")
    assert fxdebug.trace(model).trace_info.frontend == "symbolic"
    with pytest.raises(UsageError, match="frontend='bogus' is not one of auto, dynamo, symbolic"):
        fxdebug.trace(model, frontend="bogus")
    with pytest.raises(UsageError, match="frontend='bogus'"):
        fxdebug.instrument(model, [StatCollector()], frontend="bogus")


class _Marks(fxdebug.Pass):
    """A transform that adds nothing: what the auto choice reads is its ``live_capture`` switch."""

    name = "marks"

    def run(self, gm, ctx):
        return fxdebug.PassResult(gm)


def test_auto_asks_each_pass_whether_it_works_on_the_live_capture() -> None:
    x = torch.randn(2, 4)
    # a transform without the switch: the snapshot chain, as before
    assert choose_frontend(_model(), [_Marks()], {}, "instrument")[0] == "auto"
    # the same transform saying it works on Dynamo's graphs: live
    live = _Marks()
    live.live_capture = True
    chosen, why = choose_frontend(_model(), [StatCollector(), live], {}, "instrument")
    assert chosen == "dynamo" and why.startswith("auto: the live Dynamo capture")
    assert fxdebug.instrument(_model(), [live], example_inputs=(x,)).trace_info.frontend == "dynamo"
    # an observe-only pass that opts out: a snapshot, and the note names it
    shy = StatCollector()
    shy.live_capture = False
    chosen, why = choose_frontend(_model(), [shy], {}, "instrument")
    assert chosen == "auto" and why.startswith("auto: stat-collector") and "live_capture is False" in why
