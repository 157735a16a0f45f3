"""What naming a graph by its call site (issue 34 item 1) and recording what Dynamo skipped (item 2) cost per call.

Live frontend, CPU, one thread.

``capture.dynamo_sites.at_site`` runs for every graph Dynamo hands over, at every call: for the root
forward's own graph it compares one code key; for any other graph it walks the stack from the
graph's frame up to the innermost module call (a handful of frames; one ``f_locals`` read). Measured
here in isolation (the function alone, from a frame as deep as a real call's) and as the share of a
whole instrumented call of a model whose helper runs behind a graph break at two sites (the R-CNN
pattern of tests/test_call_sites.py): per-call medians over interleaved rounds.

    python tools/bench_call_sites.py
    python tools/bench_call_sites.py --rounds 7 --calls 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import fxdebug
from fxdebug.capture import dynamo_sites
from fxdebug.passes import NaNCheck, StatCollector


def clip_boxes(boxes):
    torch._dynamo.graph_break()
    return boxes.clamp(min=0.0) * 2.0


class Head(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(64, width)

    def forward(self, feats):
        return clip_boxes(self.fc(feats)).relu()


class MiniRCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        self.box_head, self.mask_head = Head(4), Head(5)

    def forward(self, x):
        feats = self.backbone(x).relu()
        return self.box_head(feats).sum(-1) + self.mask_head(feats).mean(-1)


def _per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    opts = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MiniRCNN()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], frontend="dynamo")
    x = torch.randn(32, 64)
    dbg(x)
    original = dynamo_sites._locate
    spent = [0.0, 0]

    def timed(*a, **k):  # the look-up as it runs in a real call (its own frame adds one to the walk)
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += 1

    whole, looked = [], []
    for _ in range(opts.rounds):
        whole.append(_per_call(lambda: dbg(x), opts.calls))
        dynamo_sites._locate = timed
        spent[:] = [0.0, 0]
        _per_call(lambda: dbg(x), opts.calls)
        dynamo_sites._locate = original
        looked.append(spent[0] / opts.calls)
        per_call = spent[1] // opts.calls
    w, a = statistics.median(whole), statistics.median(looked)
    print(f"whole instrumented call: {w * 1e6:.0f} us (median of {opts.rounds} rounds x {opts.calls} calls)")
    print(f"site look-ups: {per_call} per call (every graph run), {a * 1e6:.1f} us per call in all "
          f"= {a / w:.1%} of the call")
    # what every live call pays for the notes of item 2 (skipped frames, graph breaks no graph ends at): the
    # recording around Dynamo's entry, measured around an entry that does nothing
    from fxdebug.instrumented.live_skips import watched

    noop = watched(dbg, lambda *a, **k: None)
    wrapped = statistics.median(_per_call(lambda: noop(x), opts.calls * 10) for _ in range(opts.rounds))
    print(f"skip/break recording around each call: {wrapped * 1e6:.1f} us = {wrapped / w:.1%} of the call")


if __name__ == "__main__":
    main()
