"""Dynamo is a frontend of the registry, and one function chooses the frontend for ``trace`` and ``instrument``
and says why (issue 32 item 2)."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
from torch import nn

import fxdebug
import fxdebug.api
from fxdebug.api import choose_frontend
from fxdebug.capture.base import Capture, TraceOptions
from fxdebug.capture.graphs import SymbolicFrontend
from fxdebug.errors import UsageError
from fxdebug.instrumented.live import LiveInstrumented
from fxdebug.instrumented.pipeline import FRONTENDS
from fxdebug.passes import StatCollector


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_dynamo_is_a_live_frontend_of_the_registry_beside_the_snapshots() -> None:
    assert list(FRONTENDS) == ["dynamo", "symbolic", "export", "subtrees"]
    assert {name: f.live for name, f in FRONTENDS.items()} == {
        "dynamo": True, "symbolic": False, "export": False, "subtrees": False}
    assert all(f.name == name for name, f in FRONTENDS.items())
    # a live frontend captures at each call of its module: there is no snapshot Capture to return, and it says so
    with pytest.raises(UsageError, match="captures Sequential at each call"):
        FRONTENDS["dynamo"].capture(_model(), ((torch.randn(2, 4),), {}), TraceOptions())


def test_api_asks_the_registry_instead_of_comparing_names() -> None:
    # no "dynamo" literal in api.py's code (docstrings and comments aside): the registry entry's `live` decides
    tree = ast.parse(inspect.getsource(fxdebug.api))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    literals = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docstrings
                and isinstance(n.value, str) and n.value == "dynamo"]
    assert literals == [], f"api.py compares with the string 'dynamo' at lines {literals}"


class _Renamed(SymbolicFrontend):
    """A snapshot frontend under another name: registered, it is a choice; its capture is what trace() returns."""

    name = "renamed"
    captured = 0

    def capture(self, model, inputs, options) -> Capture:
        type(self).captured += 1
        return super().capture(model, inputs, options)


def test_the_choices_are_the_registry_plus_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    with pytest.raises(UsageError, match="frontend='renamed' is not one of auto, dynamo, symbolic, export, subtrees"):
        fxdebug.trace(model, frontend="renamed")
    monkeypatch.setitem(FRONTENDS, "renamed", _Renamed())
    assert fxdebug.api.choices() == ("auto", "dynamo", "symbolic", "export", "subtrees", "renamed")
    gm = fxdebug.trace(model, frontend="renamed")
    assert _Renamed.captured == 1 and not isinstance(gm, LiveInstrumented)
    # a live entry builds the live module, whatever its name
    monkeypatch.setitem(FRONTENDS, "also-live", FRONTENDS["dynamo"])
    x = torch.randn(2, 4)
    live = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="also-live")
    assert isinstance(live, LiveInstrumented) and live.trace_info.frontend == "dynamo"
    with pytest.raises(UsageError, match="frontend='bogus'"):
        fxdebug.instrument(model, [StatCollector()], frontend="bogus")


def test_instrument_auto_says_why_it_captured_live_or_took_a_snapshot() -> None:
    x = torch.randn(2, 4)
    live = fxdebug.instrument(_model(), [StatCollector()], example_inputs=(x,))
    assert live.trace_info.frontend == "dynamo"
    assert any(n.startswith("auto: the live Dynamo capture") for n in live.trace_info.notes), live.trace_info.notes
    snap = fxdebug.instrument(_model(), [_Marks()], example_inputs=(x,))  # a transform written for one whole graph
    assert snap.trace_info.frontend == "symbolic"
    assert snap.trace_info.notes[0].startswith("auto: marks transform(s)"), snap.trace_info.notes
    assert sum(n.startswith("auto:") for n in snap.trace_info.notes) == 1  # noted once, not by trace() again
    named = fxdebug.instrument(_model(), [StatCollector()], example_inputs=(x,), frontend="dynamo")
    assert not any(n.startswith("auto:") for n in named.trace_info.notes)  # named, not chosen: nothing to explain


def test_trace_auto_is_the_snapshot_chain_and_says_why() -> None:
    model, x = _model(), torch.randn(2, 4)
    for inputs in (None, (x,)):
        chosen, why = choose_frontend(model, (), {}, "trace", inputs)
        assert chosen == "auto" and why.startswith("auto: trace() runs no passes and returns one graph"), why
        gm = fxdebug.trace(model, inputs)
        assert gm.trace_info.frontend == "symbolic" and gm.trace_info.notes[0] == why
        assert not isinstance(gm, LiveInstrumented)
    # the same model with no passes through instrument(): a module that runs, so live
    assert choose_frontend(model, (), {}, "instrument", (x,))[0] == "dynamo"
    assert isinstance(fxdebug.trace(model, (x,), frontend="dynamo"), LiveInstrumented)
    assert choose_frontend(model, [StatCollector()], {"frontend": "export"}, "instrument") == ("export", "")


@pytest.mark.parametrize("case", ["leaf_modules", "many_modules", "environment"])
def test_a_reason_for_a_snapshot_gives_trace_and_instrument_the_same_choice_and_note(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _model(), torch.randn(2, 4)
    options: dict = {}
    if case == "leaf_modules":
        options = {"leaf_modules": ["2"]}
    elif case == "many_modules":
        monkeypatch.setattr(fxdebug.api, "LIVE_MODULE_LIMIT", 2)
    else:
        monkeypatch.setattr(fxdebug.api, "AUTO_IS_LIVE", False)
    traced = choose_frontend(model, (), options, "trace", (x,))
    instrumented = choose_frontend(model, [StatCollector()], options, "instrument", (x,))
    assert traced == instrumented and traced[0] == "auto" and traced[1].startswith("auto: ")
    gm = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), **options)
    assert gm.trace_info.frontend == "symbolic" and gm.trace_info.notes[0] == traced[1]
    assert fxdebug.trace(model, (x,), **options).trace_info.notes[0] == traced[1]


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
