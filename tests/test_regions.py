"""Regional capture (issue 33): a repeated block is traced once by Dynamo, each instance keeps its own rows, and the
instrumented model stays the model (outputs, gradients, a replaced block, another mode)."""

from __future__ import annotations

import re
import shutil

import torch
from torch import nn

import fxdebug
from fxdebug.capture.dynamo_regions import REGION_NAME, find_regions
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector
import pytest


@pytest.fixture(autouse=True)
def _regions_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXDEBUG_REGIONS", "1")  # opt-in in this release


class Block(nn.Module):
    def __init__(self, d: int, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.relu(self.fc1(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, n: int = 32, d: int = 8, p: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Linear(d, d)
        self.layers = nn.ModuleList(Block(d, p) for _ in range(n))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _block_graphs(dbg: fxdebug.Instrumented, block: str = "Block") -> set[object]:
    """The graphs Dynamo handed over for the block's region (one per trace; call sites share their base)."""
    return {getattr(g, "base", None) or g for g in dbg.graphs() if REGION_NAME + block + "_" in g.code}


def test_a_32_layer_model_traces_its_block_once_and_keeps_a_row_per_layer() -> None:
    torch.manual_seed(0)
    model = Stack(32)
    x = torch.randn(2, 8)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector(), ShapeAssert()], x, frontend="dynamo")
    assert len(_block_graphs(dbg)) == 1  # Dynamo traced the block's code once for the 32 layers
    assert torch.equal(dbg(x), model(x))
    rows = {(r["module"], r["op"]): r for r in dbg.report().rows}
    for i in range(32):
        row = rows[(f"layers.{i}.fc1", "torch.linear")]
        assert row["calls"] == 1 and row["shape"] == (2, 16)
    # each layer's statistics are its own: two layers' fc1 outputs differ
    assert rows[("layers.0.fc1", "torch.linear")]["mean"] != rows[("layers.31.fc1", "torch.linear")]["mean"]
    assert any("regional capture: 32 repeated block(s)" in n for n in dbg.report().notes)
    assert not any("graph break at module.py" in n for n in dbg.report().notes)  # the regions' own boundaries


def test_gradients_and_a_replaced_block_are_the_models() -> None:
    torch.manual_seed(1)
    model = Stack(6)
    twin = Stack(6)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(3, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], x, frontend="dynamo")
    dbg(x).sum().backward()
    twin(x).sum().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad), name
    new = Block(8)
    model.layers[3] = new  # the live model: the next call runs the new block
    twin.layers[3] = new
    with torch.no_grad():
        assert torch.equal(dbg(x), twin(x))


def test_model_train_retraces_the_block_once_not_per_layer() -> None:
    torch.manual_seed(2)
    model = Stack(8, p=0.5).eval()
    x = torch.randn(2, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], x, frontend="dynamo")
    assert len(_block_graphs(dbg)) == 1
    model.train()
    torch.manual_seed(3)
    out = dbg(x)
    torch.manual_seed(3)
    assert torch.equal(out, model(x))  # dropout draws the model's own numbers
    assert len(_block_graphs(dbg)) == 2  # one more trace of the block for train mode, for all eight layers


def test_two_structures_of_one_class_are_two_groups_and_unrepeated_models_have_no_regions() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(*[Block(8) for _ in range(3)])
            self.b = nn.Sequential(*[Block(4) for _ in range(3)])
            self.proj = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.proj(self.a(x)))

    model = Two()
    regions = find_regions(model)
    assert regions.blocks == 6 and len(set(regions.paths.values())) == 2
    x = torch.randn(2, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], x, frontend="dynamo")
    assert torch.equal(dbg(x), model(x))
    # one trace per structure, and one more for the model's first block, whose input needs no gradient (Dynamo
    # guards requires_grad); the other five blocks reuse those graphs
    assert len(_block_graphs(dbg)) == 3
    assert not find_regions(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))


class Slots:
    """A per-call state object read per layer, as Hugging Face's DynamicCache is (``cache.layers[self.idx]``)."""

    def __init__(self, n: int) -> None:
        self.layers = [torch.zeros(1) for _ in range(n)]


class CachedBlock(Block):
    def __init__(self, d: int, idx: int) -> None:
        super().__init__(d)
        self.idx = idx

    def forward(self, x: torch.Tensor, past_key_values: Slots | None = None) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)
        if past_key_values is not None:
            past_key_values.layers[self.idx] = past_key_values.layers[self.idx] + out.sum().detach()
        return out


class CachedStack(nn.Module):
    def __init__(self, n: int = 8, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Linear(d, d)
        self.layers = nn.ModuleList(CachedBlock(d, i) for i in range(n))

    def forward(self, x: torch.Tensor, use_cache: bool = False) -> tuple[torch.Tensor, Slots | None]:
        cache = Slots(len(self.layers)) if use_cache else None
        x = self.emb(x)
        for layer in self.layers:
            x = layer(x, past_key_values=cache)
        return x, cache


def test_a_block_taking_a_cache_is_a_region_only_for_calls_that_pass_none() -> None:
    torch.manual_seed(4)
    model = CachedStack(8)
    x = torch.randn(2, 8)
    assert find_regions(model).stateful  # the group is known to take a per-call state
    dbg = fxdebug.instrument(model, [StatCollector()], {"x": x, "use_cache": False}, frontend="dynamo")
    assert len(_block_graphs(dbg, "CachedBlock")) == 1  # no cache: the eight layers share one trace
    graphs = len(dbg.graphs())
    out, cache = dbg(x, use_cache=True)  # a cache: the layers are inlined for this call (one capture, not eight)
    want, want_cache = model(x, use_cache=True)
    assert torch.equal(out, want)
    assert [float(t) for t in cache.layers] == [float(t) for t in want_cache.layers]
    assert len(_block_graphs(dbg, "CachedBlock")) == 1 and len(dbg.graphs()) == graphs + 1
    assert torch.equal(dbg(x)[0], model(x)[0])  # and without, the shared trace again
    calls = [r["calls"] for r in dbg.report().rows if (r["module"], r["op"]) == ("layers.7.fc1", "torch.linear")]
    assert sum(calls) == 2  # the layer observed in both calls (the instrument() call is not counted)
    assert not any("needs a graph per instance" in n for n in dbg.report().notes)


_HF_LLAMA = """
import os, torch, transformers, fxdebug
from fxdebug.capture.dynamo_regions import REGION_NAME
from fxdebug.passes import NaNCheck, StatCollector
cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=100, use_cache=False)
torch.manual_seed(5)
model = transformers.LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 100, (1, 6))
dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], {"input_ids": ids}, frontend="dynamo")
layer = {getattr(g, "base", None) or g for g in dbg.graphs() if REGION_NAME + "LlamaDecoderLayer_" in g.code}
assert len(layer) == 1, len(layer)
with torch.no_grad():
    assert torch.equal(dbg(input_ids=ids).logits, model(input_ids=ids).logits)
modules = {r["module"] for r in dbg.report().rows}
missing = {f"model.layers.{i}.mlp.down_proj" for i in range(4)} - modules
assert not missing, missing
# HF's forward wrappers (one code object for every HF model class) are frames Dynamo skipped here: a GPT-2 after it
# still has its transformer traced into its own graph, not routed to a snapshot as if Dynamo skipped it there
gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100)).eval()
os.environ["FXDEBUG_REGIONS"] = "0"
dbg2 = fxdebug.instrument(gpt2, [StatCollector()], {"input_ids": ids}, frontend="dynamo")
with torch.no_grad():
    assert torch.equal(dbg2(input_ids=ids).logits, gpt2(input_ids=ids).logits)
assert not [k for k in dbg2.parts() if k.startswith("snapshot:")], list(dbg2.parts())  # its own graphs only
assert not any("observed instead through a snapshot" in n for n in dbg2.report().notes), dbg2.report().notes
print("ok")
"""


def test_hf_llama_without_cache_traces_its_decoder_layer_once() -> None:
    # in a fresh process: a regional capture of an HF decoder leaves Dynamo skipping HF's shared forward wrappers
    # for later models of other classes in the same process (a known gap of the opt-in regions, see the notes)
    pytest.importorskip("transformers")
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _HF_LLAMA], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "FXDEBUG_REGIONS": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_regions_off_captures_inlined(monkeypatch: object) -> None:
    monkeypatch.setenv("FXDEBUG_REGIONS", "0")  # type: ignore[attr-defined]
    model = Stack(4)
    x = torch.randn(2, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], x, frontend="dynamo")
    assert not _block_graphs(dbg)
    assert torch.equal(dbg(x), model(x))


def test_an_inlined_capture_of_a_class_after_a_regional_one_captures(monkeypatch: object) -> None:
    # a regional nn.Sequential's entry breaks at each block inside Sequential.forward's loop, so Dynamo skips the
    # entry's code for good: a later inlined nn.Sequential through the same code captured nothing (no parts, no rows)
    x = torch.randn(2, 8)
    regional = nn.Sequential(*[Block(8) for _ in range(4)])
    fxdebug.instrument(regional, [StatCollector()], x, frontend="dynamo")(x)
    monkeypatch.setenv("FXDEBUG_REGIONS", "0")  # type: ignore[attr-defined]
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    dbg = fxdebug.instrument(plain, [StatCollector(grads=True)], x, frontend="dynamo")
    dbg(x).sum().backward()
    assert len(dbg.parts()) == 1
    assert any(k.startswith("grad") for row in dbg.report().rows for k in row)


def _sequence_with_heads() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), *[Block(8) for _ in range(6)], nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                         nn.Linear(8, 3))


def test_an_nn_sequential_of_blocks_observes_its_other_children_and_is_not_traced_itself(monkeypatch: object) -> None:
    # nn.Sequential's forward is a loop: Dynamo broke at the first block, ran the loop eagerly, and the children that
    # are not blocks (the stem, the nested head, the last layer) ran unobserved, with no word
    from torch._dynamo.utils import counters

    model = _sequence_with_heads()
    x = torch.randn(2, 8)
    counters.clear()
    dbg = fxdebug.instrument(model, [StatCollector(grads=True)], x, frontend="dynamo")
    assert not counters["graph_break"]  # the root's loop was not traced up to a block and broken there
    out = dbg(x)
    assert torch.equal(out, model(x))
    out.sum().backward()
    rows = {r["module"]: r for r in dbg.report().rows}
    assert {"0", "7.0", "7.1", "8", "1.fc1", "6.fc2"} <= set(rows)
    monkeypatch.setenv("FXDEBUG_REGIONS", "0")  # type: ignore[attr-defined]
    inlined = fxdebug.instrument(_sequence_with_heads(), [StatCollector(grads=True)], x, frontend="dynamo")
    inlined(x).sum().backward()
    want = {r["module"]: r for r in inlined.report().rows}
    for path in ("0", "7.0", "8", "3.fc2"):
        for column in ("mean", "std", "grad_norm"):
            assert rows[path][column] == pytest.approx(want[path][column], rel=1e-5), (path, column)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_render_joins_the_regions_graphs_by_their_data_and_draws_a_copys_nan_origin(tmp_path) -> None:
    """Several graphs (a region per block) are drawn as one picture: each block's input is the node of the block
    before that made it (no dangling ``layers_3_x``), and a NaN that starts in a copied instance is the origin
    there, found first in time beside the other graphs' rows (a copy's clock counted its first call as 1)."""
    torch.manual_seed(0)
    model, x = Stack(6), torch.randn(2, 8)
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], x, frontend="dynamo")
    assert len(dbg.parts()) > 6
    with torch.no_grad():
        model.layers[3].fc2.weight.view(-1)[0] = float("nan")
        dbg(x)
    report = dbg.report()
    assert report.first_nonfinite == "layers_3_fc2"
    first_calls = {r["node"]: r["nonfinite_first_call"] for r in report.rows if r.get("nonfinite_calls")}
    assert first_calls and set(first_calls.values()) == {0}
    dbg.render(str(tmp_path / "stack.svg"), fold=False, depth=4)
    dot = (tmp_path / "stack.dot").read_text(encoding="utf-8")
    edges = set(re.findall(r'^\s*"?([\w/.]+)"? -> "?([\w/.]+)"?', dot, re.M))
    for i in range(5):
        assert (f"layers_{i}_add", f"layers_{i + 1}_norm") in edges, i
    assert ("emb_linear", "layers_0_norm") in edges and ("layers_5_add", "head_linear") in edges
    assert not any(f"layers_{i}_x" in dot for i in range(6))
    assert re.search(r"live: \d+ graphs, joined", dot)
