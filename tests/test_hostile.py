"""Hostile and unusual input: each row of the table in docs/reliability.md, tested.

Every case either works (outputs equal to the plain model) or raises a typed fxdebug error whose
message is a sentence naming what went wrong.
"""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdebug
from fxdebug.passes import DeviceCheck, NaNCheck, ShapeAssert, StatCollector

X = torch.randn(2, 4)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def observe() -> list[fxdebug.Pass]:
    return [ShapeAssert(), NaNCheck(backward=True), StatCollector(grads=True), DeviceCheck()]


def sentence(err: BaseException) -> str:
    """The message reads as sentences: it ends with a full stop and has no doubled ones."""
    msg = str(err)
    assert msg.rstrip().endswith("."), msg
    assert ".." not in msg.replace("...", ""), msg
    return msg


class Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("broken forward")


class VarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, *args, **kwargs):
        return self.lin(args[0]) * kwargs.get("scale", 1.0)


class IntFlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, x):
        idx = (x.abs() * 3).long().clamp(max=9)
        mask = x > 0
        y = self.emb(idx).sum(-1) * mask
        return y.argmax(-1), mask.sum(), y


class NoFloat(nn.Module):
    def forward(self, x):
        return x.argmax(-1), x > 0


class DropFn(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=self.training)


# -- wrong things given to instrument() -------------------------------------------------------------
def test_not_a_module() -> None:
    with pytest.raises(fxdebug.UsageError, match="needs a torch.nn.Module instance; got function") as e:
        fxdebug.instrument(lambda x: x, passes=[])
    sentence(e.value)
    with pytest.raises(fxdebug.UsageError, match="instantiate it first"):
        fxdebug.instrument(nn.Linear, passes=[])


def test_forward_that_raises_is_a_trace_error() -> None:
    with pytest.raises(fxdebug.TraceError, match="broken forward") as e:
        dbg = fxdebug.instrument(Boom(), passes=[])  # a snapshot frontend traces here ...
        dbg(X)  # ... a live one runs nothing before the first call: the TraceError comes there
    sentence(e.value)
    with pytest.raises(fxdebug.TraceError, match="Boom's own forward raised RuntimeError") as e:
        fxdebug.instrument(Boom(), passes=[], example_inputs=(X,))  # regression: was a raw RuntimeError
    assert isinstance(e.value.__cause__, RuntimeError)
    sentence(e.value)


@pytest.mark.parametrize("x, error, words", [
    (torch.randn(2, 5), fxdebug.ShapeMismatchError, "set in_features=5"),
    (torch.randn(2, 4).long(), fxdebug.ShapeMismatchError, "same dtype"),
    (torch.randn(2, 4).double(), fxdebug.ShapeMismatchError, "same dtype"),
    (torch.randn(2, 4, device="meta"), fxdebug.DeviceMismatchError, "one device"),
], ids=["shape", "int-dtype", "double-dtype", "device"])
def test_wrong_example_inputs_name_the_node(x, error, words) -> None:
    with pytest.raises(error, match=words) as e:
        fxdebug.instrument(mlp(), passes=observe(), example_inputs=(x,))
    assert e.value.node == "_0" and e.value.module == "0"
    # the op is the module's class in a symbolic graph, the function Dynamo records in a live one
    assert re.search(r"node '_0' \(module 0, (Linear|torch\.linear)\)", sentence(e.value))


def test_example_inputs_with_nan_work_and_are_reported() -> None:
    model = mlp()
    bad = torch.full((2, 4), float("nan"))
    dbg = fxdebug.instrument(model, passes=observe(), example_inputs=(bad,))
    torch.testing.assert_close(dbg(X), model(X))
    dbg(bad)
    report = dbg.report()
    assert report.first_nonfinite == "input_1" and report.row("input_1")["nonfinite_calls"] == 1


def test_pass_list_errors() -> None:
    with pytest.raises(fxdebug.PassError, match="passes\\[1\\] is str") as e:
        fxdebug.instrument(mlp(), passes=[StatCollector(), "nan"], example_inputs=(X,))
    sentence(e.value)
    with pytest.raises(fxdebug.PassError, match="write StatCollector\\(\\)") as e:
        fxdebug.instrument(mlp(), passes=[StatCollector], example_inputs=(X,))
    sentence(e.value)


def test_same_pass_twice_composes() -> None:
    model = mlp()
    once = fxdebug.instrument(model, passes=[StatCollector(), NaNCheck()], example_inputs=(X,))
    twice = fxdebug.instrument(model, passes=[StatCollector(), NaNCheck(), StatCollector(), NaNCheck()],
                               example_inputs=(X,))
    assert len(twice.observers()) == len(once.observers())
    assert {k: sorted(o.probes) for k, o in twice.observers().items()} == \
        {k: sorted(o.probes) for k, o in once.observers().items()}
    assert torch.equal(twice(X), model(X))


def test_instrumenting_an_instrumented_module_composes() -> None:
    model = mlp()
    first = fxdebug.instrument(model, passes=[StatCollector()], example_inputs=(X,))
    second = fxdebug.instrument(first, passes=[StatCollector(), NaNCheck()], example_inputs=(X,))
    watched = [a.name for part in second.parts().values() for n in part.graph.nodes
               if fxdebug.authoring.fx_meta(n).get("role") == "instrumentation"
               for a in (n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]])]  # batched calls hold several
    assert len(watched) == len(set(watched)) == len(second.observers())  # one observer per node
    assert all(sorted(o.probes) == ["nan-check", "stats"] for k, o in second.observers().items() if k in first.observers())
    assert second.get_submodule("0") is model[0]  # still the model's own layers
    assert torch.equal(second(X), model(X))
    assert second.report().calls == 1 and first.report().calls == 0


def test_reinstrumenting_leaves_the_first_report_alone() -> None:
    """Regression: the copy shared node.meta dicts, so new example shapes leaked into the first."""
    first = fxdebug.instrument(mlp(), passes=[StatCollector()], example_inputs=(X,))
    fxdebug.instrument(first, passes=[StatCollector()], example_inputs=(torch.randn(7, 4),))
    assert first.report().row("_0")["shape"] == (2, 3)


def test_reinstrumenting_an_export_capture_does_not_warn() -> None:
    """Regression: deep-copying an export graph's pytree codegen raised a FutureWarning."""
    model = mlp()
    first = fxdebug.instrument(model, passes=[], example_inputs=(X,), frontend="export")
    second = fxdebug.instrument(first, passes=[StatCollector()], example_inputs=(X,))
    assert torch.equal(second(X), model(X))


# -- unusual models --------------------------------------------------------------------------------
def test_no_floating_point_outputs() -> None:
    model = NoFloat()
    dbg = fxdebug.instrument(model, passes=observe(), example_inputs=(X,))
    got, want = dbg(X), model(X)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert [r["node"] for r in dbg.report().rows if "mean" in r] == []  # no float value is computed


def test_integer_and_bool_tensors_flow_through() -> None:
    model = IntFlow()
    dbg = fxdebug.instrument(model, passes=observe(), example_inputs=(X,))
    got, want = dbg(X), model(X)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    rows = {r["node"]: r for r in dbg.report().rows}
    assert "mean" in rows["mul"] and "mean" not in rows["long"] and "mean" not in rows["gt"]


def test_zero_size_batches() -> None:
    """Regression: NaNCheck called an empty tensor non-finite (its min/max are +inf/-inf)."""
    model = mlp()
    empty = torch.randn(0, 4)
    dbg = fxdebug.instrument(model, passes=observe(), example_inputs=(empty,))
    x = empty.clone().requires_grad_()
    out = dbg(x)
    out.sum().backward()
    assert out.shape == (0, 2) and torch.equal(dbg(X), model(X))
    report = dbg.report()
    assert report.ok and report.first_nonfinite is None and report.first_nonfinite_grad is None
    raising = fxdebug.instrument(model, passes=[NaNCheck(mode="raise")], example_inputs=(X,))
    assert raising(empty).shape == (0, 2)


def test_forward_with_star_args_and_kwargs() -> None:
    """Regression: the shape run fed ``*args`` packed in a tuple to the first op."""
    model = VarArgs()
    dbg = fxdebug.instrument(model, passes=observe(), example_inputs=(X,))
    assert torch.equal(dbg(X), model(X)) and torch.equal(dbg(X, scale=2.0), model(X, scale=2.0))
    assert dbg.report().calls == 2


def test_functional_training_flag_is_fixed_at_trace_time() -> None:
    """Documented limitation: ``training=self.training`` in a functional call is read while tracing.

    A limitation of the snapshot frontends (the live one guards on ``training``): pinned to symbolic tracing."""
    model = DropFn().train()
    dbg = fxdebug.instrument(model, passes=[], example_inputs=(X,), frontend="symbolic")
    node = next(n for n in dbg.graph.nodes if n.op == "call_function")
    assert node.kwargs["training"] is True
    again = fxdebug.instrument(model.eval(), passes=[], example_inputs=(X,), frontend="symbolic")  # the fix: instrument in eval
    assert torch.equal(again(X), X)


# -- passes that misbehave -------------------------------------------------------------------------
@fxdebug.graph_pass(name="explodes")
def explodes(gm, ctx):
    raise KeyError("no such thing")


@fxdebug.graph_pass(name="dangles")
def dangles(gm, ctx):
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    with gm.graph.inserting_after(node):
        gm.graph.call_function(torch.neg, (node,))
    return fxdebug.PassResult(gm)


def test_a_pass_that_raises() -> None:
    with pytest.raises(fxdebug.PassError, match="pass 'explodes' raised KeyError") as e:
        fxdebug.instrument(mlp(), passes=[explodes], example_inputs=(X,))
    assert e.value.pass_name == "explodes" and isinstance(e.value.__cause__, KeyError)
    sentence(e.value)


def test_a_pass_that_leaves_a_dangling_node() -> None:
    with pytest.raises(fxdebug.PassError, match="nothing uses it") as e:
        fxdebug.instrument(mlp(), passes=[dangles], example_inputs=(X,))
    assert e.value.pass_name == "dangles" and e.value.node == "neg"
    sentence(e.value)


def test_replacing_dead_code_is_not_a_dangling_node() -> None:
    """Regression: SwapActivation / Fuse on a value the model never reads raised PassError."""
    from fxdebug.passes import Fuse, SwapActivation

    class Dead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn, self.act = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU()

        def forward(self, x):
            self.act(x)
            self.bn(self.lin(x))
            return x * 2

    model = Dead().eval()
    dbg = fxdebug.instrument(model, passes=[SwapActivation(), Fuse()], example_inputs=(X,))
    assert torch.equal(dbg(X), model(X))
    assert {r.pass_name: bool(r.replaced) for r in dbg.pass_results} == {"swap-activation": True, "fuse": True}


# -- moving, saving, copying -----------------------------------------------------------------------
def test_model_moved_to_meta_after_instrumenting() -> None:
    model = mlp()
    dbg = fxdebug.instrument(model, passes=observe(), example_inputs=(X,))
    dbg(X)
    model.to("meta")  # parameters are shared: the instrumented module moves with the model
    out = dbg(torch.randn(2, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 2)
    assert dbg.report().calls == 2
    with pytest.raises(fxdebug.DeviceMismatchError, match="Move the inputs to meta") as e:
        dbg(X)
    assert e.value.node == "_0"
    sentence(e.value)


def test_saved_and_loaded() -> None:
    model = mlp()
    dbg = fxdebug.instrument(model, passes=observe(), example_inputs=(X,))
    dbg(X).sum().backward()
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, fxdebug.Instrumented)
    assert loaded.report().rows == dbg.report().rows
    assert torch.equal(loaded(X), model(X))
    assert loaded.report().calls == 2 and dbg.report().calls == 1
    assert list(loaded.state_dict()) == list(model.state_dict())


def test_deepcopied_is_independent() -> None:
    model = mlp()
    dbg = fxdebug.instrument(model, passes=observe(), example_inputs=(X,))
    dbg(X)
    twin = copy.deepcopy(dbg)
    assert twin.get_submodule("0").weight is not model[0].weight and torch.equal(twin(X), model(X))
    with torch.no_grad():  # the last layer's bias: a dead ReLU cannot hide the edit, whatever the init
        twin.get_submodule("0").weight.add_(1.0)
        twin.get_submodule("2").bias.add_(1.0)
    assert not torch.equal(twin(X), model(X)) and torch.equal(dbg(X), model(X))
    assert twin.report().calls == 2 and dbg.report().calls == 2


def test_deepcopied_pruned_model_masks_its_own_layer() -> None:
    from fxdebug.passes import PruneMasks

    model = mlp()
    # the subject is a snapshot's Masked layer calls after a deepcopy (the live capture masks weight reads instead)
    dbg = fxdebug.instrument(model, passes=[PruneMasks(0.5)], example_inputs=(X,), frontend="symbolic")
    twin = copy.deepcopy(dbg)
    with torch.no_grad():
        twin.get_submodule("2").bias.add_(1.0)  # the copy's own layer: its masked call must see the change
    masked = [m for m in twin.modules() if type(m).__name__ == "Masked"]
    assert masked and all(m.layer is twin.get_submodule(m.path) for m in masked)
    assert not torch.equal(twin(X), dbg(X))


def test_fuse_a_chain_of_pairs() -> None:
    """Regression (found by the fuzzer): linear -> bn -> linear -> bn left an unordered graph."""
    from fxdebug.passes import Fuse

    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2), nn.BatchNorm1d(2)).eval()
    dbg = fxdebug.instrument(model, passes=[Fuse()], example_inputs=(X,))
    assert sum(n.startswith("fused ") for n in dbg.pass_results[0].notes) == 2
    with torch.no_grad():
        torch.testing.assert_close(dbg(X), model(X), rtol=1e-4, atol=1e-4)
