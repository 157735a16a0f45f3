"""Nothing unobserved without a word (issue 34, item 2): a frame Dynamo skips (a data-dependent ``if`` inside a
loop: "graph break in loop ... skipping frame") is a note naming the function, its file:line and Dynamo's
reason; when the model's whole forward was skipped, the report still has rows, observed through a snapshot of
its submodules, and a note says so."""

import copy

import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector


def _line(fn):
    return f"test_skipped_frames.py:{fn.__code__.co_firstlineno}"


class LoopBranch(nn.Module):
    """A forward Dynamo skips whole: its loop holds a data-dependent branch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(3):
            x = self.fc(x)
            if x.sum() > 0:
                x = x * 0.5
        return x


def loop_helper(t):
    for _ in range(2):
        if t.sum() > 0:
            t = t - 1
    return t


class CallsAHelper(nn.Module):
    """A forward Dynamo captures, around a helper it skips."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(loop_helper(self.a(x).relu()))


def _skip_notes(report):
    return [n for n in report.notes if "skipped frame" in n]


def test_skipped_forward_is_named_and_observed_through_a_snapshot():
    torch.manual_seed(0)
    model = LoopBranch()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], frontend="dynamo")
    x = torch.randn(2, 4)
    for _ in range(3):
        assert torch.equal(dbg(x), ref(x))
    report = dbg.report()
    (note,) = _skip_notes(report)
    assert f"forward ({_line(LoopBranch.forward)})" in note
    assert "graph break in loop" in note and "Data-dependent branching" in note and "if x.sum() > 0:" in note
    assert any("observed instead through a snapshot" in n and "subtrees" in n and "fc" in n for n in report.notes)
    rows = {r["node"]: r for r in report.rows}
    assert rows["fc/linear"]["module"] == "fc"
    assert rows["fc/linear"]["calls"] == 6  # three per call, the calls after the first (which found the skip)
    assert report.calls == 3


def test_with_example_inputs_every_call_is_observed():
    torch.manual_seed(0)
    model = LoopBranch()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="dynamo")
    assert torch.equal(dbg(x), ref(x))
    report = dbg.report()
    assert _skip_notes(report)
    assert {r["node"]: r["calls"] for r in report.rows}["fc/linear"] == 3
    dbg.eval()
    ref.eval()
    assert torch.equal(dbg(x), ref(x))


def test_a_second_module_of_the_class_learns_the_skip_too():
    """Dynamo skips the code for good after the first time: the second live module hears no skip of its own."""
    torch.manual_seed(0)
    first = fxdebug.instrument(LoopBranch(), [StatCollector()], frontend="dynamo")
    first(torch.randn(2, 4))
    model = LoopBranch()
    ref = copy.deepcopy(model)
    second = fxdebug.instrument(model, [StatCollector()], frontend="dynamo")
    x = torch.randn(2, 4)
    assert torch.equal(second(x), ref(x))
    assert torch.equal(second(x), ref(x))
    report = second.report()
    assert _skip_notes(report)
    assert {r["node"] for r in report.rows} >= {"fc/linear"}


def test_a_skipped_helper_is_a_note_while_the_graphs_around_it_are_observed():
    torch.manual_seed(0)
    model = CallsAHelper()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [StatCollector()], frontend="dynamo")
    x = torch.randn(3, 4)
    assert torch.equal(dbg(x), ref(x))
    assert torch.equal(dbg(x), ref(x))
    report = dbg.report()
    (note,) = _skip_notes(report)
    assert f"loop_helper ({_line(loop_helper)})" in note and "graph break in loop" in note
    assert "if t.sum() > 0:" in note
    assert "a" in {r["node"] for r in report.rows}
    assert not any("snapshot" in n for n in report.notes)  # the forward itself was captured: no fallback


class HoldsALoop(nn.Module):
    """A forward Dynamo captures, whose submodule's forward it skips."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = LoopBranch(), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.inner(x).relu())


def test_a_skipped_submodule_is_observed_through_a_snapshot_of_it():
    torch.manual_seed(0)
    model = HoldsALoop()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], frontend="dynamo")
    x = torch.randn(2, 4)
    for _ in range(3):
        assert torch.equal(dbg(x), ref(x))
        assert "forward" not in model.inner.__dict__  # routed only during the live call
    report = dbg.report()
    assert any(f"forward ({_line(LoopBranch.forward)})" in n for n in _skip_notes(report))
    assert any(n.startswith("dynamo: inner (LoopBranch)") and "snapshot" in n for n in report.notes)
    rows = {r["node"]: r for r in report.rows}
    assert rows["inner.fc/linear"]["module"] == "inner.fc"
    assert rows["inner.fc/linear"]["calls"] == 6  # three per call, from the second call on
    assert any(r["module"] == "out" for r in report.rows)  # the graphs around it still observed
    assert "0 recompile(s)" in next(n for n in report.notes if "captured over" in n)


def breaks_first(t):
    torch._dynamo.graph_break()
    return t.relu() * 2


class CheckpointedBreak(nn.Module):
    """A graph break inside torch.utils.checkpoint: no graph ends there, the checkpointed block runs eagerly."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 1)

    def block(self, x):
        return breaks_first(self.fc(x))

    def forward(self, x):
        return self.out(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))


def test_a_break_no_graph_ends_at_is_a_note_and_dynamo_s_log_stays_quiet(caplog):
    import logging

    torch.manual_seed(0)
    model = CheckpointedBreak()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [StatCollector()], frontend="dynamo")
    x = torch.randn(3, 4)
    with caplog.at_level(logging.DEBUG):
        for _ in range(2):
            assert torch.equal(dbg(x), ref(x))
    line = breaks_first.__code__.co_firstlineno + 1
    notes = [n for n in dbg.report().notes if f"graph break at test_skipped_frames.py:{line} in breaks_first" in n]
    assert len(notes) == 1 and "ran eagerly, unobserved" in notes[0] and "graph_break()" in notes[0]
    assert not any("Graph break in user code" in r.getMessage() for r in caplog.records)
