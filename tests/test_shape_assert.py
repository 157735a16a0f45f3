"""ShapeAssert: the first node whose shape differs raises a message in the documented format;
symbolic dims; op failures re-raised as ShapeMismatchError (scenario 1); meta tensors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, ShapeAssert
from zoo import BROKEN, ZOO


class Flexible(nn.Module):
    """Accepts any spatial size: a wrong input size flows through without torch complaining."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, padding=1)

    def forward(self, x):
        out = self.conv1(x)
        return self.conv2(out)


def test_message_format_with_symbolic_batch_and_source_line():
    model = Flexible()
    x = torch.randn(2, 3, 8, 8)
    dbg = fxdebug.instrument(model, [ShapeAssert(where=["conv*"])], example_inputs=(x,))
    torch.testing.assert_close(dbg(torch.randn(5, 3, 8, 8)).shape, torch.Size([5, 4, 4, 4]))  # batch may vary
    with pytest.raises(fxdebug.ShapeMismatchError) as info:
        dbg(torch.randn(5, 3, 6, 6))
    err = info.value
    assert (err.node, err.module) == ("conv1", "conv1") and err.op in ("Conv2d", "torch.conv2d")  # symbolic / Dynamo
    assert isinstance(err, ValueError)
    assert re.match(
        r"node 'conv1' \(module conv1, (Conv2d|torch\.conv2d)\) produced \(N, 4, 6, 6\); expected \(N, 4, 8, 8\)\. "
        r"Inputs: \(N, 3, 6, 6\)\. Defined at test_shape_assert\.py:\d+ `out = self\.conv1\(x\)`\.", str(err)), str(err)


def test_input_node_checked_first_and_names_its_user():
    model, inputs = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, [ShapeAssert()], example_inputs=inputs)
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"node 'x' .* produced \(N, 1, 16, 16\); expected "
                       r"\(N, 3, 16, 16\)\. It feeds node 'stem_0' \(module stem\.0, (Conv2d|torch\.conv2d)\)"):
        dbg(torch.randn(2, 1, 16, 16))


def test_dims_differing_between_two_example_inputs_are_symbolic():
    model, (x,) = ZOO["transformer_block"]()
    model.eval()  # dropout off, so outputs compare
    longer = torch.randn(3, 9, 16)
    dbg = fxdebug.instrument(model, [ShapeAssert(other_inputs=(longer,))], example_inputs=(x,))
    torch.testing.assert_close(dbg(longer), model(longer))
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"produced \(N, L, 8\); expected \(N, L, 16\)"):
        dbg(torch.randn(3, 9, 8))
    strict = fxdebug.instrument(model, [ShapeAssert(dynamic_dims=())], example_inputs=(x,))
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"node 'x' .* produced \(3, 5, 16\); expected \(2, 5, 16\)"):
        strict(torch.randn(3, 5, 16))


# A live module's bad width: ShapeAssert's own message, or — when Dynamo's per-class cache (other instances' calls in
# this process) hands over a graph with a dynamic last dim, on which its fake-tensor check cannot run — the op's
# failure, typed and named (the layer norm, the sizes it got): either way a ShapeMismatchError naming the width
_BAD_WIDTH = (r"produced \(N, L, 8\); expected \(N, L, 16\)|node 'ln1' .*normalized_shape=\[16\].* got input of "
              r"size\[\d+, \d+, 8\]")


def test_a_live_module_learns_the_other_inputs_at_instrument_time():
    # a live graph is specialised to its capture's sizes: the other example is captured quietly at instrument(),
    # so a third length (neither example's) already passes, and the dims that did not differ are still checked
    model, (x,) = ZOO["transformer_block"]()
    model.eval()
    dbg = fxdebug.instrument(model, [ShapeAssert(other_inputs=(torch.randn(3, 9, 16),))], example_inputs=(x,),
                             frontend="dynamo")
    assert dbg.report().rows and all(r["calls"] == 0 for r in dbg.report().rows)  # the quiet captures count no call
    third = torch.randn(4, 7, 16)
    torch.testing.assert_close(dbg(third), model(third))
    with pytest.raises(fxdebug.ShapeMismatchError, match=_BAD_WIDTH):
        dbg(torch.randn(4, 7, 8))


def test_other_inputs_on_a_graph_dynamo_already_made_dynamic():
    # Dynamo's cache is per model class: after another instance ran two lengths, this module's example and other
    # example both run one graph with dynamic sizes; its dynamic dims are the ones that vary
    first, (x,) = ZOO["transformer_block"]()
    seen = fxdebug.instrument(first.eval(), [NaNCheck()], example_inputs=(x,), frontend="dynamo")
    seen(torch.randn(3, 6, 16))
    seen(torch.randn(4, 7, 16))
    model, _ = ZOO["transformer_block"]()
    model.eval()
    dbg = fxdebug.instrument(model, [ShapeAssert(other_inputs=(torch.randn(3, 9, 16),))], example_inputs=(x,),
                             frontend="dynamo")
    assert len(dbg.parts()) == 1  # one graph served both examples
    third = torch.randn(4, 11, 16)
    torch.testing.assert_close(dbg(third), model(third))
    with pytest.raises(fxdebug.ShapeMismatchError, match=_BAD_WIDTH):
        dbg(torch.randn(4, 7, 8))


def test_a_new_graph_failing_on_bad_sizes_gives_the_shape_assert_message():
    # after another instance's bad call, Dynamo's per-class cache takes such sizes into a new graph whose shapes cannot
    # be learnt (layer_norm fails on them): the earlier graphs' ShapeAssert names the input, not the op that failed
    seen, (x,) = ZOO["transformer_block"]()
    other = (torch.randn(3, 9, 16),)
    first = fxdebug.instrument(seen.eval(), [ShapeAssert(other_inputs=other)], example_inputs=(x,), frontend="dynamo")
    with pytest.raises(fxdebug.ShapeMismatchError, match=_BAD_WIDTH):
        first(torch.randn(3, 9, 8))
    model, _ = ZOO["transformer_block"]()
    dbg = fxdebug.instrument(model.eval(), [ShapeAssert(other_inputs=other)], example_inputs=(x,), frontend="dynamo")
    dbg(torch.randn(4, 7, 16))
    with pytest.raises(fxdebug.ShapeMismatchError, match=_BAD_WIDTH):
        dbg(torch.randn(4, 7, 8))


def test_dtype_is_checked():
    model = nn.Linear(4, 2)
    dbg = fxdebug.instrument(model, [ShapeAssert()], example_inputs=(torch.randn(3, 4),))
    model.double()
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"produced float64 \(N, 4\); expected float32 \(N, 4\)"):
        dbg(torch.randn(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_passes_unchanged_on_cpu_and_meta(name):
    model, inputs = ZOO[name]()
    dbg = fxdebug.instrument(model, [ShapeAssert()], example_inputs=inputs)
    model.eval()
    torch.testing.assert_close(dbg(*inputs), model(*inputs))
    if name == "control_flow":
        return  # branches on a tensor value: cannot run on meta at all
    meta_model = model.to("meta")
    meta_inputs = tuple(t.to("meta") for t in inputs)
    meta = fxdebug.instrument(meta_model, [ShapeAssert()], example_inputs=meta_inputs)
    out = meta(*meta_inputs)
    first = out if isinstance(out, torch.Tensor) else next(iter(out.values())) if isinstance(out, dict) else out[0]
    assert first.device.type == "meta"


def test_scenario_1_linear_mismatch_names_fc1_and_the_fix():
    model, inputs = BROKEN["mnist_mismatch"]()
    with pytest.raises(fxdebug.ShapeMismatchError) as info:
        fxdebug.instrument(model, [ShapeAssert()], example_inputs=inputs)
    msg = str(info.value)
    assert info.value.node == "fc1" and info.value.module == "fc1"
    assert "(2, 1440)" in msg and "in_features=1440" in msg and "'view'" in msg
    assert isinstance(info.value.__cause__, RuntimeError)
    traced = fxdebug.trace(model)
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"node 'fc1'.*set in_features=1440"):
        traced(torch.randn(4, 1, 28, 28))


class MatmulCat(nn.Module):
    def forward(self, a, b, c):
        return torch.cat([a @ b, c], dim=1)


def test_matmul_and_cat_failures_name_node_and_every_input_shape():
    model = MatmulCat()
    ok = (torch.randn(2, 3), torch.randn(3, 4), torch.randn(2, 5))
    dbg = fxdebug.instrument(model, [ShapeAssert()], example_inputs=ok)
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"node 'matmul'.*Inputs: \(2, 3\) float32 cpu; \(2, 4\) float32 cpu"):
        dbg(torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"node 'cat'.*\(2, 4\) float32 cpu; \(3, 5\) float32 cpu") as info:
        dbg(torch.randn(2, 3), torch.randn(3, 4), torch.randn(3, 5))
    assert info.value.__cause__ is not None


def test_without_example_inputs_the_pass_is_refused_before_it_runs():
    model, _ = ZOO["residual_cnn"]()
    # a snapshot capture has no shapes without example inputs (the live one learns them at the first call)
    with pytest.raises(fxdebug.MissingInputsError, match="pass 'shape-assert' requires example inputs") as info:
        fxdebug.instrument(model, [ShapeAssert()], frontend="symbolic")
    assert info.value.pass_name == "shape-assert"


def test_shapes_are_checked_once_per_input_signature_without_a_probe_per_node(monkeypatch):
    from fxdebug.passes import NaNCheck, StatCollector
    from fxdebug.passes import shape_assert as sa

    model = Flexible()
    x = torch.randn(2, 3, 8, 8)
    dbg = fxdebug.instrument(model, [ShapeAssert(where=["conv*"]), NaNCheck(mode="record"), StatCollector()],
                             example_inputs=(x,), frontend="symbolic")
    (gm,) = dbg.parts().values()
    python_observers = [n for n in gm.graph.nodes if n.op == "call_module" and "obs" in str(n.target)]
    assert [n.args[0].name for n in python_observers] == ["x"]  # every other node: the fused op, lowered
    runs = []
    real = sa._ShapeGuard._fake_run
    monkeypatch.setattr(sa._ShapeGuard, "_fake_run", lambda self, sig, check: runs.append(sig) or real(self, sig, check))
    for _ in range(3):
        dbg(torch.randn(5, 3, 8, 8))  # a new batch size: checked once, then remembered
    assert len(runs) == 1
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"node 'conv1'.*produced \(N, 4, 6, 6\)"):
        dbg(torch.randn(5, 3, 6, 6))
    with pytest.raises(fxdebug.ShapeMismatchError):
        dbg(torch.randn(5, 3, 6, 6))  # a failing signature is never remembered
    assert dbg.report().row("conv1")["calls"] == 3
