"""report.origin_samples / origin_tokens: which rows and (batch, position) tokens carried the first NaN."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck
from syncs import CountSyncs


class LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.log(x))


class TokenNet(nn.Module):
    """(batch, sequence, features) activations; ``sqrt`` goes NaN at the tokens whose input is negative."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sqrt(x) * 2
        return self.out(torch.relu(self.proj(h))).mean(1)


def positive(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) + 0.5


def test_origin_samples_names_the_rows_of_the_first_bad_call() -> None:
    x = positive(6, 4)
    dbg = fxdebug.instrument(LogNet(), passes=[NaNCheck(samples=True)], example_inputs=(x,))
    dbg(x)
    bad = x.clone()
    bad[4, 1] = -1.0
    bad[1, 3] = -2.0
    dbg(bad)
    later = x.clone()
    later[0, 0] = -1.0  # a later bad call does not overwrite the first one's rows
    dbg(later)
    rep = dbg.report()
    assert rep.first_nonfinite == "log"
    assert rep.origin_samples == [1, 4]
    assert rep.origin_tokens is None  # a 2-d activation has no positions
    assert rep["x"].get("nonfinite_samples") is None  # the input itself was finite


def test_origin_tokens_names_batch_and_position_and_the_mask_grows_with_the_batch() -> None:
    x = positive(2, 5, 8)
    dbg = fxdebug.instrument(TokenNet(), passes=[NaNCheck(samples=True)], example_inputs=(x,))
    dbg(x)
    bad = positive(3, 7, 8, seed=1)  # a larger batch and sequence than before
    bad[2, 6, 0] = -1.0
    bad[0, 2, 5] = -3.0
    bad[0, 3, 1] = -3.0
    dbg(bad)
    rep = dbg.report()
    assert rep.first_nonfinite == "sqrt"
    assert rep.origin_samples == [0, 2]
    assert rep.origin_tokens == [(0, 2), (0, 3), (2, 6)]



def test_recording_the_rows_does_not_sync() -> None:
    x = positive(2, 5, 8)
    dbg = fxdebug.instrument(TokenNet(), passes=[NaNCheck(samples=True)], example_inputs=(x,))
    bad = x.clone()
    bad[1, 1, 1] = -1.0
    with CountSyncs() as counter:
        for inp in (x, bad, x):
            dbg(inp)
    assert counter.syncs == 0
    assert dbg.report().origin_tokens == [(1, 1)]


def test_collect_says_which_batch_of_the_loader_carried_it() -> None:
    loader = [positive(4, 4, seed=i) for i in range(5)]
    loader[3] = loader[3].clone()
    loader[3][2, 0] = -5.0
    dbg = fxdebug.instrument(LogNet(), passes=[NaNCheck(samples=True)], example_inputs=(loader[0],))
    rep = fxdebug.collect(dbg, loader, progress=False)
    assert rep.origin_batch == 3
    assert rep.origin_samples == [2]
    assert any("batch 3" in n for n in rep.notes)
    again = fxdebug.collect(dbg, loader[:2], progress=False)
    assert again.origin_batch is None and again.origin_samples is None


def test_without_samples_nothing_extra_is_recorded() -> None:
    x = positive(3, 4)
    dbg = fxdebug.instrument(LogNet(), passes=[NaNCheck()], example_inputs=(x,))
    x[1, 1] = -1.0
    dbg(x)
    rep = dbg.report()
    assert rep.first_nonfinite == "log"
    assert rep.origin_samples is None
