"""instrument() at scale (issues 26/27): what makes it cheap per node, checked as behaviour.

Code is generated once, at the first call; erased observer nodes are freed; observers make no
nn.Module containers until something uses them; watching passes are checked without a full lint
each. The figures themselves live in tools/bench_instrument.py and docs/performance.md.
"""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch
from torch import nn
from torch.fx import GraphModule

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector


def _chain(n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) if i % 2 == 0 else nn.ReLU() for i in range(n)])


def _observers(dbg):
    return list(dbg.observers().values())


def test_code_is_generated_once_at_the_first_call(monkeypatch):
    real = GraphModule.recompile
    made = []

    def counting(self):
        made.append(type(self).__name__)
        return real(self)

    monkeypatch.setattr(GraphModule, "recompile", counting)
    model, x = _chain(40), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    assert made == []  # capture, passes and lowering edit the graph; none of them generated code
    assert torch.equal(dbg(x), model(x))
    assert len(made) == 1
    dbg(x)
    assert "def forward" in dbg.code and "observe_many" in dbg.code
    assert len(made) == 1  # reading .code after the call generates nothing more
    assert dbg.report().rows[0]["calls"] == 2


def test_code_read_before_any_call_is_the_current_graph():
    model, x = _chain(6), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,), frontend="symbolic")
    assert "observe" in dbg.code and "observe" in str(dbg)
    assert torch.equal(dbg(x), model(x))


def test_erased_observer_nodes_are_freed():
    model, x = _chain(64), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    gc.collect()
    graph = dbg.graph
    erased = [o for o in gc.get_objects() if type(o) is torch.fx.Node and o.graph is graph and o._erased]
    assert erased == []  # FX's name table kept each erased observer node (and its metadata) alive
    assert sum(1 for n in graph.nodes if "observe_many" in str(n.target)) >= 4  # they were batched


def test_observers_make_no_module_containers_until_used():
    model, x = _chain(8), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    observers = _observers(dbg)
    assert observers
    for obs in observers:
        assert not {"_parameters", "_buffers", "_modules", "_forward_hooks", "states"} & set(obs.__dict__)
    dbg(x)
    rows = len(dbg.report().rows)
    assert list(dbg.state_dict()) == list(model.state_dict())
    twin = copy.deepcopy(dbg)
    assert torch.equal(twin(x), model(x)) and len(twin.report().rows) == rows
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), model(x)) and len(loaded.report().rows) == rows
    seen = []
    handle = observers[0].register_forward_hook(lambda *a: seen.append(1))  # still a module when asked
    assert len(observers[0]._forward_hooks) == 1 and len(observers[1].__dict__.get("_forward_hooks", ())) == 0
    handle.remove()
    dbg.reset()
    assert dbg.report().rows[0].get("calls", 0) == 0


class _ReadsLater(fxdebug.Pass):
    """A watching pass that (wrongly) inserts an instrumentation node reading a value defined after it."""

    name = "reads-later"
    observe_only = True

    def run(self, gm, ctx):
        nodes = [n for n in gm.graph.nodes if n.op == "call_module"]
        with gm.graph.inserting_before(nodes[0]):
            bad = gm.graph.call_function(torch.neg, (nodes[-1],))
        bad.meta["fxdebug"] = {"role": "instrumentation", "observes": nodes[-1].name}
        return fxdebug.PassResult(gm, added=[bad])


def test_a_watching_pass_that_breaks_the_graph_is_named():
    model, x = _chain(6), torch.randn(2, 4)
    with pytest.raises(fxdebug.PassError) as err:
        fxdebug.instrument(model, [NaNCheck(), _ReadsLater(), StatCollector()], example_inputs=(x,),
                           frontend="symbolic")
    assert err.value.pass_name == "reads-later" and "invalid graph" in str(err.value)


def test_instrumenting_an_instrumented_module_keeps_batches_and_rows():
    model, x = _chain(40), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,), frontend="symbolic")
    again = fxdebug.instrument(dbg, [StatCollector()], example_inputs=(x,))  # unlowers, unbatches, lowers again
    direct = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    assert torch.equal(again(x), model(x)) and torch.equal(direct(x), model(x))
    rows, want = again.report().rows, direct.report().rows
    assert len(rows) == len(want) == 41
    for row, ref in zip(rows, want):
        # (per-channel maxima, and the dead fraction read from them, are not added to a node whose
        # row was laid out without them: as before these changes)
        assert row.keys() <= ref.keys() and ref.keys() - row.keys() <= {"channels", "dead_frac"}
        assert {k: row[k] for k in row} == pytest.approx({k: ref[k] for k in row})
    assert sum(1 for n in again.graph.nodes if "observe_many" in str(n.target)) >= 2


def test_no_collection_runs_inside_a_large_instrument_and_frozen_objects_stay_frozen():
    # the build's objects join the oldest generation unscanned (gc.freeze + unfreeze): no young collection walks
    # the graph on resuming; a process that froze objects itself keeps them frozen (unfreeze would release them)
    model, x = _chain(3000), torch.randn(2, 4)
    runs: list[int] = []

    def seen(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    gc.collect()
    gc.callbacks.append(seen)
    try:
        dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,), frontend="symbolic")
    finally:
        gc.callbacks.remove(seen)
    assert runs == []
    assert torch.equal(dbg(x), model(x))
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        fxdebug.instrument(_chain(3000), [NaNCheck()], example_inputs=(x,), frontend="symbolic")
        assert gc.get_freeze_count() > 0.9 * frozen  # (a few frozen objects may die by reference counting)
    finally:
        gc.unfreeze()
