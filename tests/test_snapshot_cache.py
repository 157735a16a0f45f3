"""The one cache of a snapshot module (issue 32 item 6): one key (training flags, attribute values read,
export call signature), one store (``Recipe.snapshots``), one check per call (``snapshot_cache.check_call``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fxdebug
from fxdebug.capture.staleness import StalenessGuard
from fxdebug.instrumented.snapshot_cache import other_signatures
from fxdebug.instrumented.snapshot_recipe import recipe
from fxdebug.passes import StatCollector


class _Config:
    def __init__(self) -> None:
        self.scale = 2.0


class Scaled(nn.Module):
    """Dropout (the training flag), a config attribute and a keyword that changes export's signature."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = _Config()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        return F.dropout(self.fc(x), 0.5, self.training) * self.cfg.scale * scale


def _notes(dbg: nn.Module, word: str) -> int:
    return sum(word in n for n in dbg.trace_info.notes)  # type: ignore[union-attr]


def test_a_call_of_another_signature_in_another_mode_is_one_capture() -> None:
    """A routed call does not also capture the root's own graph for the call's modes (it did: two captures)."""
    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(4, 6)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="export")
    rec = recipe(dbg)
    assert rec is not None
    dbg.train()
    dbg(x, scale=2.0)
    assert len(other_signatures(dbg)) == 1
    assert [s.flags for s in rec.snapshots if s.routed is None] == [rec.snapshots[0].flags]  # no train graph of its own
    assert rec.current is rec.snapshots[0] and rec.current.flags is not None and rec.current.flags[0] is False
    assert _notes(dbg, "modes: captured again") == 0 and _notes(dbg, "export: captured again") == 1


def test_one_store_holds_every_key_and_each_key_is_captured_once() -> None:
    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(4, 6)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="export")
    rec = recipe(dbg)
    assert rec is not None
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(dbg(x), model(x))  # the example key
            model.cfg.scale = 3.0  # an attribute value read: a key of its own
            assert torch.equal(dbg(x), model(x))
            model.cfg.scale = 2.0
            assert torch.equal(dbg(x, scale=0.5), model(x, scale=0.5))  # another signature: a module of its own
    # three keys, each captured once, all in the one store; the second round found each in it
    assert len(rec.snapshots) == 3 and sum(s.routed is not None for s in rec.snapshots) == 1
    assert rec.current is rec.snapshots[1]  # the routed call left the root's own graph as it was (scale=3.0's)
    dbg.reset()
    routed = other_signatures(dbg)[0]
    assert routed.report().calls == 0  # reset() reaches the capture of the other signature through the store


def test_the_check_runs_the_current_snapshots_staleness_guard(monkeypatch) -> None:
    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(4, 6)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="symbolic")
    seen: list[StalenessGuard] = []
    original = StalenessGuard.check

    def counting(self: StalenessGuard, gm: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append(self)
        original(self, gm, args, kwargs)

    monkeypatch.setattr(StalenessGuard, "check", counting)
    dbg(x)
    dbg.train()
    dbg(x)  # training mode: the graph captured for it, with its own guard
    rec = recipe(dbg)
    assert rec is not None and len(rec.snapshots) == 2
    # the first call: the eval graph's guard; the switching call: the eval graph's, then the new graph's own
    assert seen == [rec.snapshots[0].staleness, rec.snapshots[0].staleness, rec.snapshots[1].staleness]
    assert seen[0] is not seen[2]
    dbg(x)
    assert seen[3:] == [rec.snapshots[1].staleness]  # one check per call once nothing changes
    model.fc = nn.Linear(6, 6)  # the new snapshot's guard still refuses a replaced submodule
    try:
        dbg(x)
    except fxdebug.TraceError as exc:
        assert "submodule 'fc'" in str(exc)
    else:
        raise AssertionError("a replaced submodule after a mode switch ran the old graph")
