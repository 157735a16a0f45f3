"""A region's later instances are renamed copies of its first instance's instrumented part (issue 33,
``instrumented/live_copies.py``): the passes run once per block, and each copy is exactly what the passes
would have made for that instance — the same graph, names, metadata, observers and probes, with the copy's
own module paths, modules and parameters — and its statistics are its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.fx import GraphModule, Node

import fxdebug
from fxdebug.authoring.context import NAMESPACE
from fxdebug.errors import NonFiniteError, ShapeMismatchError
from fxdebug.passes import DeviceCheck, Histograms, NaNCheck, ParamGrads, ShapeAssert, StatCollector


@pytest.fixture(autouse=True)
def _regions_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXDEBUG_REGIONS", "1")


class Block(nn.Module):
    """A pre-norm residual MLP: parameters, a buffer-free norm, a residual add, a functional activation."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(n)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _passes(raise_mode: bool = False) -> list[Any]:
    return [ShapeAssert(), NaNCheck(mode="raise" if raise_mode else "record"), StatCollector(grads=True), DeviceCheck()]


def _instrument(model: nn.Module, x: torch.Tensor, copies: bool, monkeypatch: pytest.MonkeyPatch,
                passes: list[Any] | None = None) -> Any:
    monkeypatch.setenv("FXDEBUG_REGION_COPIES", "1" if copies else "0")
    return fxdebug.instrument(model, passes if passes is not None else _passes(), example_inputs=(x,),
                              frontend="dynamo")


def _both(monkeypatch: pytest.MonkeyPatch, passes: Any = _passes) -> tuple[nn.Module, torch.Tensor, Any, Any]:
    """``(model, x, copied, ran)``: one seeded ``Net(6)`` instrumented with copies and without (``passes()`` each)."""
    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)
    return model, x, _instrument(model, x, True, monkeypatch, passes()), _instrument(model, x, False, monkeypatch, passes())


_VOLATILE = {"seconds", "instrument_seconds", "table", "_tick", "_host", "_ticks", "_host_calls"}


def _same(a: Any, b: Any, own: tuple[Any, Any], where: str, seen: dict[tuple[int, int], Any]) -> None:
    """``a`` (in the copy) is what ``b`` (the passes' own work) is, recursively; the parts ``own`` stand for each other."""
    if (id(a), id(b)) in seen:
        return
    seen[(id(a), id(b))] = (a, b)  # kept alive: a temporary's id is reused
    if isinstance(a, GraphModule) and (a is own[0] or b is own[1]):
        assert a is own[0] and b is own[1], where  # (each GraphModule has a class of its own)
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, Node):
        assert a.name == b.name and a.graph is own[0].graph and b.graph is own[1].graph, where
    elif isinstance(a, (dict,)) or type(a).__name__ == "immutable_dict":
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            if k not in _VOLATILE:
                _same(a[k], b[k], own, f"{where}[{k!r}]", seen)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {a} vs {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, own, f"{where}[{i}]", seen)
    elif isinstance(a, (set, frozenset)):
        assert a == b, where
    elif type(a) is nn.Module:  # a holder of fxdebug's (the Dynamo constants): what it holds
        _same([dict(a._modules), dict(a._parameters), dict(a._buffers)],
              [dict(b._modules), dict(b._parameters), dict(b._buffers)], own, where, seen)
    elif isinstance(a, torch.Tensor) or (isinstance(a, nn.Module) and not type(a).__module__.startswith("fxdebug")):
        assert a is b, f"{where}: another object"  # the same model: its very modules and parameters
    elif isinstance(a, (str, int, float, bool, type(None), torch.dtype, torch.device)) or callable(a) and not hasattr(
            a, "__dict__"):
        assert a == b, f"{where}: {a!r} vs {b!r}"
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _same({k: v for k, v in vars(a).items() if k not in ("_calls", "states", "_devices")},
              {k: v for k, v in vars(b).items() if k not in ("_calls", "states", "_devices")}, own, where, seen)
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _compare_parts(copied: Any, ran: Any) -> int:
    """Every part of ``copied`` is exactly the part of ``ran`` with its key; returns how many parts were compared."""
    pa, pb = copied.parts(), ran.parts()
    assert list(pa) == list(pb)
    for key in pa:
        a, b = pa[key], pb[key]
        assert a.code == b.code, key
        seen: dict[tuple[int, int], Any] = {}
        for x, y in zip(a.graph.nodes, b.graph.nodes, strict=True):
            assert (x.op, x.name, x.target) == (y.op, y.name, y.target), key
            _same(x.args, y.args, (a, b), f"{key}:{x.name}.args", seen)
            _same(x.meta.get("fxdebug"), y.meta.get("fxdebug"), (a, b), f"{key}:{x.name}.meta", seen)
        _same(dict(a.__dict__[NAMESPACE]._modules), dict(b.__dict__[NAMESPACE]._modules), (a, b), f"{key}:fxdebug", seen)
        _same(a.meta, b.meta, (a, b), f"{key}:meta", seen)
    return len(pa)


@pytest.mark.parametrize("raise_mode", [False, True])
def test_a_copied_part_is_what_the_passes_make_for_that_instance(monkeypatch: pytest.MonkeyPatch,
                                                                  raise_mode: bool) -> None:
    model, x, copied, ran = _both(monkeypatch, lambda: _passes(raise_mode))
    assert copied._live_state.region_copies >= 4  # the first instance (or two: the chain's first input) ran them
    assert ran._live_state.region_copies == 0
    assert _compare_parts(copied, ran) >= 8
    # raise mode's probes blame the instance's own weights, not the template's
    if raise_mode:
        part = copied.parts()[next(k for k in copied.parts() if k.endswith("@blocks.4"))]
        probe = next(p for o in part.__dict__[NAMESPACE].children() for p in getattr(o, "probes", {}).values()
                     if getattr(p, "param_inputs", None) and p.node_name == "blocks_4_up")
        assert sorted(probe.param_inputs.values()) == ["blocks.4.up.bias", "blocks.4.up.weight"]


def test_copies_keep_their_own_statistics_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, copied, ran = _both(monkeypatch)
    outs = []
    for dbg in (copied, ran):
        y = dbg(x)
        y.sum().backward()
        outs.append(y.detach())
        model.zero_grad()
    plain = model(x).detach()
    assert torch.equal(outs[0], plain) and torch.equal(outs[1], plain)
    rows_a, rows_b = copied.report().rows, ran.report().rows
    assert rows_a == rows_b
    per_block = {r["module"] for r in rows_a if r["module"].startswith("blocks.")}
    assert {f"blocks.{i}.up" for i in range(6)} <= per_block
    means = {r["module"]: r.get("mean") for r in rows_a if r["module"].endswith(".down")}
    assert len(set(means.values())) == 6  # each instance's own rows: the blocks' weights differ


def test_a_copy_names_its_own_nodes_in_shape_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, copied, ran = _both(monkeypatch)
    messages = []
    for dbg in (copied, ran):
        part = dbg.parts()[next(k for k in dbg.parts() if k.endswith("@blocks.3"))]
        guard = next(o for o in part.__dict__[NAMESPACE].children() if "shape-assert" in getattr(o, "probes", {})
                     and o.op == "placeholder").probes["shape-assert"]
        with pytest.raises(ShapeMismatchError) as err:
            guard.probe.check(torch.zeros(2, 5), ())
        messages.append(str(err.value))
        assert guard.guard.gm is part
    assert messages[0] == messages[1]
    assert "blocks_3" in messages[0] and "blocks.3" in messages[0]


def test_a_replaced_layer_of_a_copied_instance_is_learnt_again_not_a_shape_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy's shape expectations belong to its own instance's modules: a wider layer put in place of one of them
    is learnt anew at the next call (as for the template's instance), not reported as a shape mismatch."""
    for copies in (True, False):
        torch.manual_seed(0)
        model, x = Net(6), torch.randn(2, 4)
        dbg = _instrument(model, x, copies, monkeypatch, [ShapeAssert(), StatCollector()])
        block = model.blocks[4]
        block.up, block.down = nn.Linear(8, 32), nn.Linear(32, 8)
        with torch.no_grad():
            assert torch.equal(dbg(x), model(x))
        shapes = {r["module"]: r["shape"] for r in dbg.report().rows}
        assert shapes["blocks.4.up"] == (2, 32) and shapes["blocks.4.down"] == (2, 8), copies
        assert shapes["blocks.3.up"] == (2, 16), copies
        block.up = nn.Linear(8, 24)  # a real mismatch in that instance: named there, not at a block's input
        with pytest.raises(ShapeMismatchError) as err:
            dbg(x)
        assert "blocks.4.down" in str(err.value) and "in_features" in str(err.value), copies


def test_a_nan_in_a_copied_instance_is_found_there(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)
    dbg = _instrument(model, x, True, monkeypatch, _passes(raise_mode=True))
    assert dbg._live_state.region_copies >= 4
    with torch.no_grad():
        model.blocks[4].down.bias[0] = float("nan")
    with pytest.raises(NonFiniteError) as err:
        dbg(x)
    assert err.value.module == "blocks.4.down"


class Opaque(fxdebug.Pass):
    """A user pass that does not say its work is the same on every instance."""

    observe_only = True

    def run(self, gm: GraphModule, ctx: fxdebug.PassContext) -> fxdebug.PassResult:
        self.seen = getattr(self, "seen", 0) + 1
        return fxdebug.PassResult(gm)


def test_a_pass_that_does_not_share_runs_on_every_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)
    opaque = Opaque()
    dbg = _instrument(model, x, True, monkeypatch, [StatCollector(), opaque])
    assert dbg._live_state.region_copies == 0
    assert opaque.seen == len(dbg.parts())
    selected = _instrument(model, x, True, monkeypatch, [StatCollector(where="blocks.*")])
    assert selected._live_state.region_copies == 0  # where= names paths: per instance


def test_auto_captures_a_large_model_of_repeated_blocks_live_with_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``LIVE_MODULE_LIMIT`` modules ``"auto"`` took the snapshot; a model whose repeated blocks hold most of
    its modules is now captured live with regional capture (copies), and one without stays on the snapshot."""
    monkeypatch.delenv("FXDEBUG_REGIONS")
    monkeypatch.setattr(fxdebug.api, "LIVE_MODULE_LIMIT", 20)
    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)  # 28 modules, 26 of them in regions
    dbg = fxdebug.instrument(model, _passes(), example_inputs=(x,))
    assert dbg.trace_info.frontend == "dynamo" and dbg._live_state.regional
    assert any(n.startswith("auto: the live Dynamo capture with regional capture") for n in dbg.trace_info.notes)
    assert dbg._live_state.region_copies >= 4
    assert torch.equal(dbg(x), model(x))
    assert {f"blocks.{i}.up" for i in range(6)} <= {r["module"] for r in dbg.report().rows}
    again = fxdebug.instrument(dbg, [NaNCheck()])  # more passes: the same capture kind
    assert again._live_state.regional
    flat = nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)])  # no repeated block: the snapshot, as before
    snap = fxdebug.instrument(flat, _passes(), example_inputs=(x,))
    assert snap.trace_info.frontend == "symbolic"
    small = fxdebug.instrument(Net(2), _passes(), example_inputs=(x,))  # below the limit: inlined, as before
    assert small.trace_info.frontend == "dynamo" and not small._live_state.regional


def test_dynamo_by_name_on_a_large_block_model_is_regional_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``frontend="dynamo"`` above the limit captured every block inlined (57 s at 10,000 nodes where ``"auto"`` takes
    3 s); it takes regional capture as ``"auto"`` does, and ``FXDEBUG_REGIONS=0`` keeps it inlined."""
    monkeypatch.delenv("FXDEBUG_REGIONS")
    monkeypatch.setattr(fxdebug.api, "LIVE_MODULE_LIMIT", 20)
    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, _passes(), example_inputs=(x,), frontend="dynamo")
    assert dbg._live_state.regional and dbg._live_state.region_copies >= 4
    assert any(n.startswith("dynamo: the live capture with regional capture") for n in dbg.trace_info.notes)
    assert torch.equal(dbg(x), model(x))
    monkeypatch.setenv("FXDEBUG_REGIONS", "0")
    inlined = fxdebug.instrument(model, _passes(), example_inputs=(x,), frontend="dynamo")
    assert not inlined._live_state.regional
    small = fxdebug.instrument(Net(2), _passes(), example_inputs=(x,), frontend="dynamo")
    assert not small._live_state.regional


def test_a_recompile_instruments_the_block_once_and_copies_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another batch size: Dynamo traces the region again, the passes run on one instance, the others are copies,
    and each instance's rows merge with its first capture's."""
    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)
    dbg = _instrument(model, x, True, monkeypatch, [ShapeAssert(), NaNCheck(), StatCollector()])
    before, parts = dbg._live_state.region_copies, len(dbg.parts())
    ran = []
    monkeypatch.setattr(ShapeAssert, "run", lambda self, gm, ctx, _run=ShapeAssert.run: ran.append(gm) or _run(self, gm, ctx))
    bigger = torch.randn(5, 4)
    dbg(x)
    torch.testing.assert_close(dbg(bigger), model(bigger))
    assert len(dbg.parts()) > parts
    assert dbg._live_state.region_copies - before >= 4  # the new graph's later instances: copies
    assert len(ran) <= 4  # stem, head, the block's first instance (two: the chain's first input)
    calls = {r["module"]: r["calls"] for r in dbg.report().rows if r["module"].endswith(".up")}
    assert calls == {f"blocks.{i}.up": 2 for i in range(6)}


class _NodeProbe(fxdebug.authoring.Probe):
    """A user probe that keeps its node (an identity the copy must map to the copy's own node)."""

    key = "keeps-node"

    def __init__(self, node: Node) -> None:
        self.node = node


class KeepsNodes(fxdebug.Pass):
    """A user pass that says its work is the same on every instance, and keeps nodes in its probes."""

    observe_only = True
    shares_instances = True

    def run(self, gm: GraphModule, ctx: fxdebug.PassContext) -> fxdebug.PassResult:
        added = [ctx.observe(n, _NodeProbe(n)) for n in gm.graph.nodes if n.op == "call_function"]
        return fxdebug.PassResult(gm, added=added)


def test_a_user_pass_that_shares_gets_its_probes_copied_with_the_copys_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)
    dbg = _instrument(model, x, True, monkeypatch, [KeepsNodes(), StatCollector()])
    assert dbg._live_state.region_copies >= 4
    for key, part in dbg.parts().items():
        for obs in part.__dict__[NAMESPACE].children():
            probe = getattr(obs, "probes", {}).get("keeps-node")
            if probe is not None:
                assert probe.node.graph is part.graph and probe.node.name == obs.node_name, key


def test_hf_llama_decoder_layers_are_copies_equal_to_the_passes_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real block (Hugging Face's LlamaDecoderLayer: attention with GQA, rotary embeddings as inputs, RMSNorm,
    an MLP): every copied layer is what the passes make for it, and the outputs are the model's."""
    transformers = pytest.importorskip("transformers")
    import warnings

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))

    def run(copies: bool) -> Any:
        monkeypatch.setenv("FXDEBUG_REGION_COPIES", "1" if copies else "0")
        return fxdebug.instrument(model, _passes(), example_inputs=(ids,), frontend="dynamo")

    copied, ran = run(True), run(False)
    assert copied._live_state.region_copies >= 3 and ran._live_state.region_copies == 0
    _compare_parts(copied, ran)
    with torch.no_grad():
        want = model(ids).last_hidden_state
        assert torch.equal(copied(ids).last_hidden_state, want)
    layers = {r["module"] for r in copied.report().rows if ".mlp.down_proj" in r["module"]}
    assert layers == {f"layers.{i}.mlp.down_proj" for i in range(5)}


def test_copies_of_the_passes_options_are_what_the_passes_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """Histograms, NaN samples, counts, gradient probes: copies equal the passes' own work for each option."""
    def passes() -> list[Any]:
        return [NaNCheck(backward=True, counts=True, samples=True), StatCollector(grads=True, histograms=8, counts=True),
                ShapeAssert(dynamic_dims=(0,), check_dtype=False), ParamGrads(),
                Histograms(bins=4, grads=True)]

    model, x, copied, ran = _both(monkeypatch, passes)
    assert copied._live_state.region_copies >= 4
    _compare_parts(copied, ran)
    for dbg in (copied, ran):
        for _ in range(2):  # the one-shot gradient hooks again at the second step
            dbg(x).sum().backward()
            model.zero_grad()
    assert copied.report().rows == ran.report().rows
    grads = {r["param_module"]: r["param_grad_calls"] for r in copied.report().rows if r.get("param_module")}
    assert {f"blocks.{i}.up" for i in range(6)} <= set(grads) and set(grads.values()) == {2}


def test_a_call_under_a_dispatch_mode_runs_the_regions_it_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the user's TorchDispatchMode a call took a path that did not route the regions: Dynamo captured every
    block again as a frame of its own, under other names, and the first capture's rows stayed at 0 calls."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Counting.ops += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)
    dbg = _instrument(model, x, True, monkeypatch, [NaNCheck(), StatCollector()])
    parts = list(dbg.parts())
    with Counting():
        for _ in range(3):
            torch.testing.assert_close(dbg(x), model(x))
    assert list(dbg.parts()) == parts  # nothing captured again
    assert Counting.ops > 0
    assert {r["calls"] for r in dbg.report().rows} == {3}


def test_a_device_mismatch_under_regions_names_the_first_op_that_sees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The typed error comes from the part a call starts in: with regions several parts take an input of the
    model's input shape, and the newest-first search named the head."""
    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)
    dbg = _instrument(model, x, True, monkeypatch, [DeviceCheck()])
    with pytest.raises(fxdebug.DeviceMismatchError) as info:
        dbg(x.to("meta"))
    assert info.value.module == "stem" and "parameters stem.weight" in str(info.value)


def test_on_nonfinite_reads_one_flag_per_call_over_every_region(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each region is a graph with its own recorder: each read its "went non-finite" flag, one host sync per block
    per call. The live call now reads them all at its end, once; the callback still fires for the NaN."""
    from syncs import CountSyncs

    torch.manual_seed(0)
    model, x = Net(6), torch.randn(2, 4)
    fired: list[Any] = []
    dbg = _instrument(model, x, True, monkeypatch, [NaNCheck(history=4, on_nonfinite=fired.append)])
    assert len(dbg.parts()) >= 8
    mode = CountSyncs()
    with mode:
        for _ in range(3):
            dbg(x)
    assert mode.syncs == 3 and not fired
    with torch.no_grad():
        model.blocks[3].down.bias[0] = float("nan")
    dbg(x)
    assert len(fired) >= 1 and fired[0].first_nonfinite is not None
    assert "blocks_3_down" in fired[0].first_nonfinite


def test_a_recipe_is_used_only_while_its_container_holds_what_it_was_made_from() -> None:
    """A copy repeats the first copy's recipes; a container of the template changed since (a list grown, a key
    added, a field reassigned) is walked afresh, its new values renamed too, never copied with the template's names."""
    import dataclasses as dc
    import re

    from fxdebug.instrumented.copy_walk import Renamer

    @dc.dataclass
    class Template:  # what the walk reads of live_copies.Template
        pattern: Any = re.compile("n1")
        inert: set = dc.field(default_factory=set)
        same: dict = dc.field(default_factory=dict)
        plans: dict = dc.field(default_factory=dict)
        originals: frozenset = frozenset({"n1"})

    t = Template()
    meta = {"module": "blocks.0", "nodes": ["n1", "kept"], "shape": (2, 4), "pair": ("n1", 3)}

    def copy(to: str) -> Any:
        return Renamer({"n1": f"n{to}", "blocks.0": f"blocks.{to}"}, t, ("fxdebug.",)).planned(meta)

    first = copy("2")
    assert first == {"module": "blocks.2", "nodes": ["n2", "kept"], "shape": (2, 4), "pair": ("n2", 3)}
    assert first["shape"] is meta["shape"] and first["nodes"] is not meta["nodes"]
    assert copy("3") == {"module": "blocks.3", "nodes": ["n3", "kept"], "shape": (2, 4), "pair": ("n3", 3)}
    meta["nodes"].append("n1_obs")  # the list changed: walked afresh (the derived name renamed by its node's)
    meta["extra"] = "blocks.0"  # a key added: the mapping walked afresh
    again = copy("4")
    assert again == {"module": "blocks.4", "nodes": ["n4", "kept", "n4_obs"], "shape": (2, 4), "pair": ("n4", 3),
                     "extra": "blocks.4"}
    meta["nodes"][1] = "n1"  # the list alone changed, under a mapping whose recipe was made anew
    assert copy("5") == {"module": "blocks.5", "nodes": ["n5", "n5", "n5_obs"], "shape": (2, 4), "pair": ("n5", 3),
                         "extra": "blocks.5"}
