"""``fxdebug.to_networkx``: the model's own graph, with what fxdebug knows on every node."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from zoo import ZOO, GraphBreakPair


def test_structure_matches_the_fx_graph():
    model, (x,) = ZOO["residual_cnn"]()
    gm = fxdebug.trace(model)
    g = fxdebug.to_networkx(gm)
    assert isinstance(g, nx.DiGraph)
    assert list(g.nodes) == [n.name for n in gm.graph.nodes]
    expected = {(a.name, n.name) for n in gm.graph.nodes for a in n.all_input_nodes}
    assert set(g.edges) == expected
    assert nx.is_directed_acyclic_graph(g)
    conv = g.nodes["layer1_0_conv1"]
    assert (conv["op"], conv["target"], conv["label"], conv["module"]) == ("call_module", "layer1.0.conv1", "Conv2d",
                                                                         "layer1.0.conv1")
    assert g.nodes["iadd"]["op"] == "call_function" and g.nodes["iadd"]["module"] == "layer1.0"


def test_instrumented_nodes_carry_shapes_and_statistics():
    model, (x,) = ZOO["transformer_block"]()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(x,))
    dbg(x)
    report = dbg.report()
    g = fxdebug.to_networkx(dbg)
    observers = [n.name for part in dbg.parts().values() for n in part.graph.nodes if fxdebug.authoring.is_instrumentation(n)]
    assert observers and not set(observers) & set(g.nodes)  # folded into the nodes they watch
    for row in report.rows:
        attrs = g.nodes[row["node"]]
        assert attrs["shape"] == row["shape"]
        measured = {k: v for k, v in row.items() if k not in ("node", "module", "op", "shape", "dtype", "device")}
        assert attrs["stats"] == measured
        assert attrs["probes"]  # which probes watched it
    assert sum("mean" in g.nodes[n]["stats"] for n in g) >= 5  # StatCollector's numbers arrived
    some_edge = next(iter(g.edges(data=True)))
    assert some_edge[2]["shape"] == g.nodes[some_edge[0]]["shape"]
    full = fxdebug.to_networkx(dbg, instrumentation=True)
    assert set(observers) <= set(full.nodes)
    assert full.nodes[observers[-1]]["role"] in ("instrumentation", "clock")


def test_nan_origin_is_a_graph_attribute():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.log(x) + 1

    dbg = fxdebug.instrument(M(), [NaNCheck()], example_inputs=(torch.tensor([1.0, -1.0]),))
    dbg(torch.tensor([1.0, -1.0]))
    g = fxdebug.to_networkx(dbg)
    assert g.graph["first_nonfinite"] == "log" and g.nodes["log"]["origin"]
    assert not g.nodes["add"]["origin"] and g.nodes["add"]["stats"]["nonfinite_calls"] == 1


def test_a_live_module_gives_its_captured_graph():
    """A Dynamo capture's own graph is empty: the DiGraph is its (largest) captured graph, with the report."""
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [StatCollector()], frontend="dynamo")
    with pytest.raises(fxdebug.UsageError, match="nothing captured yet"):
        fxdebug.to_networkx(dbg)
    dbg(x)
    g = fxdebug.to_networkx(dbg)
    assert {r["node"] for r in dbg.report().rows} <= set(g.nodes)
    conv = g.nodes["layer1_0_conv1"]
    assert conv["module"] == "layer1.0.conv1" and conv["stats"]["mean"] == dbg.report()["layer1_0_conv1"]["mean"]
    assert nx.is_directed_acyclic_graph(g) and "layer1_0_bn1" in g.successors("layer1_0_conv1")


def test_rejects_non_graph_modules():
    with pytest.raises(fxdebug.UsageError, match="GraphModule"):
        fxdebug.to_networkx(torch.nn.Linear(2, 2))


def test_a_live_module_with_a_graph_break_gives_every_graph():
    # it gave the largest captured graph only: the nodes after a graph break (or in other block regions) were missing
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(GraphBreakPair(), [StatCollector()], example_inputs=(x,), frontend="dynamo")
    dbg(x)
    assert len(dbg.parts()) == 2
    g = fxdebug.to_networkx(dbg)
    rows = {r["node"] for r in dbg.report().rows}
    assert rows <= set(g.nodes) and {"a", "b"} <= rows
    assert g.nodes["b"]["stats"]["mean"] == dbg.report()["b"]["mean"]
    assert list(g.successors("b")) and list(g.successors("a")) and nx.is_directed_acyclic_graph(g)
