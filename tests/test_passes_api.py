"""The pass framework: custom passes (the documented example), provenance, error wrapping."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdebug
from zoo import ZOO

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _doc_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.S)


def test_writing_passes_doc_example_runs_and_is_short():
    blocks = _doc_blocks("writing-passes.md")
    definition = blocks[0]
    assert len([ln for ln in definition.strip().splitlines() if ln.strip()]) < 25
    namespace: dict = {}
    exec(compile(definition, "writing-passes.md", "exec"), namespace)
    exec(compile(blocks[1].replace("print(", "_ = ("), "writing-passes.md", "exec"), namespace)
    dbg, x = namespace["dbg"], namespace["x"]
    relu_out = torch.relu(namespace["model"][0](x))
    assert dbg.report().row("_1")["zeros"] == int((relu_out == 0).sum())


def test_insert_before_doc_example_guards_every_module_call():
    blocks = _doc_blocks("writing-passes.md")
    namespace: dict = {"__name__": "__main__"}  # as in the user's script: FX names functions by module
    for i, block in enumerate(blocks[:3]):
        exec(compile(block.replace("print(", "_ = ("), f"writing-passes.md[{i}]", "exec"), namespace)
    dbg, x, guard = namespace["dbg"], namespace["x"], namespace["finite_input"]
    order = [n.name for n in dbg.graph.nodes]
    guards = [n for n in dbg.graph.nodes if n.target is guard]
    assert [g.args[1] for g in guards] == ["_0", "_1", "_2"]
    assert all(order.index(g.name) < order.index(g.args[1]) for g in guards)
    assert dbg.report().ok
    with pytest.raises(FloatingPointError, match="_0 got a non-finite input"):
        dbg(torch.full_like(x, float("nan")))


def test_custom_pass_through_instrument_counts_and_provenance():
    zero_count = _load_zero_count()
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, passes=[zero_count(where="layer1.*")], example_inputs=(x,))
    rows = dbg.report().rows
    observed = {r["node"] for r in rows}
    assert observed and all(r["module"].startswith("layer1.") for r in rows)
    assert "layer1_0_conv1" in observed and "fc" not in observed
    result = dbg.pass_results[0]
    assert result.pass_name == "zero-count" and len(result.added) == len(observed)
    obs_nodes = [n for part in dbg.parts().values() for n in part.graph.nodes
                 if fxdebug.authoring.fx_meta(n).get("role") == "instrumentation"]
    assert {fxdebug.authoring.fx_meta(n)["added_by"] for n in obs_nodes} == {"zero-count"}


def _load_zero_count():
    namespace: dict = {}
    exec(compile(_doc_blocks("writing-passes.md")[0], "writing-passes.md", "exec"), namespace)
    return namespace["zero_count"]


def test_same_probe_twice_does_not_double_instrument():
    zero_count = _load_zero_count()
    model, (x,) = ZOO["shared_module"]()
    once = fxdebug.instrument(model, passes=[zero_count], example_inputs=(x,))
    twice = fxdebug.instrument(model, passes=[zero_count, zero_count], example_inputs=(x,))
    assert len(list(once.graph.nodes)) == len(list(twice.graph.nodes))
    again = fxdebug.instrument(once, passes=[zero_count], example_inputs=(x,))
    assert len(list(again.graph.nodes)) == len(list(once.graph.nodes))
    assert torch.equal(again(x), model(x))


class Broken(fxdebug.Pass):
    name = "broken"

    def run(self, gm, ctx):
        raise ValueError("boom")


class Dangling(fxdebug.Pass):
    name = "dangling"

    def run(self, gm, ctx):
        first = next(n for n in gm.graph.nodes if n.op == "call_module")
        with gm.graph.inserting_after(first):
            gm.graph.call_function(torch.neg, (first,))
        return fxdebug.PassResult(gm)


class Invalid(fxdebug.Pass):
    name = "invalid"

    def run(self, gm, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        first = next(n for n in gm.graph.nodes if n.op == "call_module")
        with gm.graph.inserting_before(first):
            bad = gm.graph.call_function(torch.neg, (out.args[0],))  # used before it is defined
        first.args = (bad,)
        return fxdebug.PassResult(gm)


@pytest.mark.parametrize("bad, needle", [(Broken(), "raised ValueError: boom"),
                                         (Dangling(), "nothing uses it"),
                                         (Invalid(), "invalid graph")])
def test_broken_passes_become_pass_errors_naming_the_pass(bad, needle):
    model, (x,) = ZOO["shared_module"]()
    with pytest.raises(fxdebug.PassError) as err:
        fxdebug.instrument(model, passes=[bad], example_inputs=(x,))
    assert err.value.pass_name == bad.name
    assert f"pass '{bad.name}'" in str(err.value) and needle in str(err.value)
    if isinstance(bad, Dangling):
        assert err.value.node == "neg"


def test_pass_list_validation():
    model = nn.Linear(2, 2)
    with pytest.raises(fxdebug.PassError, match="not a pass"):
        fxdebug.instrument(model, passes=["nan-check"])
    with pytest.raises(fxdebug.PassError, match=r"not an instance: write Broken\(\)"):
        fxdebug.instrument(model, passes=[Broken])
    with pytest.raises(fxdebug.PassError, match="list of fxdebug passes"):
        fxdebug.instrument(model, passes=3)


def test_node_pass_records_replacements():
    @fxdebug.node_pass(name="tanh-to-hardtanh")
    def swap(node, ctx):
        if node.op == "call_module" and isinstance(fxdebug.authoring.get_module(node.graph.owning_module, node), nn.Tanh):
            return ctx.replace_with_module(node, nn.Hardtanh())
        return None

    model, (x,) = ZOO["shared_module"]()
    dbg = fxdebug.instrument(model, passes=[swap], example_inputs=(x,))
    result = dbg.pass_results[0]
    assert list(result.replaced) == ["block_1", "block_3"]  # the shared block is called twice
    new = next(n for n in dbg.graph.nodes if n.name == result.replaced["block_1"])
    assert fxdebug.authoring.fx_meta(new)["changed_by"] == ["tanh-to-hardtanh"]
    assert fxdebug.authoring.fx_meta(new)["module"] == "block.1"
    assert isinstance(model.block[1], nn.Tanh)  # the model keeps its own module
    expected = model.out(nn.Hardtanh()(model.block[0](nn.Hardtanh()(model.block[0](x)))) + nn.Hardtanh()(model.block[0](x)))
    torch.testing.assert_close(dbg(x), expected)


def test_instruments_see_every_pass():
    seen = []

    class Recorder:
        def after_pass(self, p, gm, result):
            seen.append((p.name, result.seconds >= 0))

    model, (x,) = ZOO["shared_module"]()
    gm = fxdebug.trace(model)
    ctx = fxdebug.PassContext((x,), instruments=[Recorder()])
    fxdebug.PassManager([_load_zero_count()]).run(gm, ctx)
    assert seen == [("zero-count", True)]


def test_a_pass_subclass_without_run_is_refused_before_any_capture() -> None:
    from fxdebug.authoring import Pass

    class Forgot(Pass):
        name = "forgot"

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(fxdebug.PassError, match=r"passes\[0\]: Forgot subclasses Pass but defines no run") as info:
        fxdebug.instrument(model, [Forgot()], example_inputs=(torch.randn(1, 2),))
    assert info.value.pass_name == "forgot"
