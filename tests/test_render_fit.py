"""Pictures that fit a screen: real architectures render at most ``FIT_PT`` points on the long side by
default, with the NaN origin drawn (not hidden in a collapsed box), parameters folded onto the ops
that read them, mask plumbing folded into the cluster that consumes it, and repeated blocks folded
into one block labelled ``first–last ×N`` except the block holding the problem.

Sizes are measured on the SVG graphviz writes (its ``width``/``height`` in points).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from fxdebug.render.draw import FIT_PT, svg_size
from fxdebug.render.dot import COLORS

pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
SVG = "{http://www.w3.org/2000/svg}"
TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _resnet50() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    """ResNet-50's layout ([3, 4, 6, 3] bottlenecks) at small width, from tools/bench_models.py."""
    if "bench_models" not in sys.modules:
        sys.path.insert(0, str(TOOLS))
        spec = importlib.util.spec_from_file_location("bench_models", TOOLS / "bench_models.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_models"] = mod
        spec.loader.exec_module(mod)
    model = sys.modules["bench_models"].ResNetStyle(base=8, classes=10)
    return model, (torch.randn(1, 3, 64, 64),), {}, "layers.2.3.conv2"


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("transformers")


SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _ids(seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 100, (2, seq))


def _bert() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    t = _transformers()
    model = t.BertModel(t.BertConfig(vocab_size=100, max_position_embeddings=32, **SMALL))
    return model, (), {"input_ids": _ids(), "attention_mask": torch.ones(2, 8, dtype=torch.long)}, \
        "encoder.layer.1.attention.self.key"


def _gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    t = _transformers()
    cfg = t.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                       bos_token_id=0, eos_token_id=0)
    return t.GPT2LMHeadModel(cfg), (), {"input_ids": _ids()}, "transformer.h.1.attn.c_attn"


def _llama() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    t = _transformers()
    cfg = t.LlamaConfig(vocab_size=100, max_position_embeddings=32, num_key_value_heads=2, use_cache=False, **SMALL)
    return t.LlamaForCausalLM(cfg), (), {"input_ids": _ids()}, "model.layers.1.self_attn.k_proj"


def _t5() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    t = _transformers()
    cfg = t.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                     use_cache=False, decoder_start_token_id=0)
    return t.T5Model(cfg), (), {"input_ids": _ids(), "decoder_input_ids": _ids(5)}, "decoder.block.1.layer.0.SelfAttention.k"


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]]] = {
    "resnet50": _resnet50, "bert": _bert, "gpt2": _gpt2, "llama": _llama, "t5": _t5,
}


def nodes_of(path: str) -> dict[str, dict[str, Any]]:
    out = {}
    for g in ET.parse(path).getroot().iter(f"{SVG}g"):
        if g.get("class") != "node":
            continue
        shape = next(e for e in g.iter() if e.tag in (f"{SVG}path", f"{SVG}polygon", f"{SVG}ellipse"))
        out[g.find(f"{SVG}title").text] = {"fill": shape.get("fill"), "text": [t.text or "" for t in g.iter(f"{SVG}text")]}
    return out


@pytest.mark.parametrize("name", [*sorted(MODELS), "gpt2/subtrees"])
def test_default_picture_fits_with_the_nan_origin_drawn(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    name, _, frontend = name.partition("/")
    model, args, kwargs, poisoned = MODELS[name]()
    model.eval()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=kwargs or args,
                             frontend=frontend or "auto")
    with torch.no_grad():
        model.get_submodule(poisoned).weight.view(-1)[0] = float("nan")
        dbg(*args, **kwargs)
    origin = dbg.report().first_nonfinite
    assert origin is not None
    path = dbg.render(str(tmp_path / f"{name}.svg"))
    width, height = svg_size(Path(path).read_text(encoding="utf-8"))
    assert max(width, height) <= FIT_PT, f"{name}: {width:.0f} x {height:.0f} pt"
    nodes = nodes_of(path)
    assert nodes[origin]["fill"] == COLORS["origin"]  # drawn as itself, not inside a collapsed box
    assert not any(t.startswith("p_") or "get_attr" in " ".join(n["text"]) for t, n in nodes.items())
    if frontend:  # parts joined by data edges, inside the eager parent's clusters
        assert len(dbg.parts()) > 1
        dot = (tmp_path / f"{name}.dot").read_text(encoding="utf-8")
        assert "forward runs eagerly" in dot
        assert any(a.split("/")[0] != b.split("/")[0] for a, b in
                   re.findall(r'^\s*"([^"]+/[^"]+)" -> "([^"]+/[^"]+)"', dot, re.M))  # an edge between two parts
        return
    graph = fxdebug.to_networkx(dbg)
    params = [n for n, a in graph.nodes(data=True) if a["op"] == "get_attr"]
    # export and Dynamo graphs read parameters with get_attr nodes (resnet50's symbolic graph calls modules)
    assert bool(params) == (dbg.trace_info.frontend != "symbolic")
    if params:
        assert not set(params) & set(nodes)  # parameters are not boxes ...
        assert any("weight (" in " ".join(n["text"]) for n in nodes.values())  # ... they sit on the ops reading them


def test_repeated_blocks_fold_except_the_problem_block(tmp_path: Path) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(x))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.ModuleList([Block() for _ in range(12)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.layer:
                x = block(x)
            return x

    model = Stack()
    x = torch.randn(2, 8)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,))
    dbg(x)
    nodes = nodes_of(dbg.render(str(tmp_path / "healthy.svg"), depth=99))
    labels = [" ".join(n["text"]) for n in nodes.values()]
    assert sum("layer_0_fc" == t for t in nodes) == 1 and "layer_5_fc" not in nodes
    dot = (tmp_path / "healthy.dot").read_text(encoding="utf-8")
    assert "layer.0–11 ×12" in dot and dot.count("cluster/layer.") == 1  # twelve blocks, one drawn
    with torch.no_grad():
        model.layer[5].fc.weight[0, 0] = float("inf") * 0  # NaN planted in block 5
    dbg.reset()
    dbg(x)
    assert dbg.report().first_nonfinite == "layer_5_fc"
    nodes = nodes_of(dbg.render(str(tmp_path / "sick.svg"), depth=99))
    dot = (tmp_path / "sick.dot").read_text(encoding="utf-8")
    assert "layer.0–4 ×5" in dot and "layer.6–11 ×6" in dot  # the run is split around the problem block
    assert nodes["layer_5_fc"]["fill"] == COLORS["origin"]
    assert set(re.findall(r'id="cluster/(layer\.\d+)"', dot)) == {"layer.0", "layer.5", "layer.6"}
    assert labels  # the healthy picture had boxes


def test_mask_plumbing_folds_into_the_consuming_cluster(tmp_path: Path) -> None:
    model, _, kwargs, _ = _bert()
    dbg = fxdebug.instrument(model.eval(), [StatCollector()], example_inputs=kwargs)
    dbg(**kwargs)
    graph = fxdebug.to_networkx(dbg)
    mask_ops = [n for n, a in graph.nodes(data=True) if a["module"] == "" and a["op"] == "call_function"
                and str(a["dtype"]).replace("torch.", "") in ("bool", "int64")]
    assert len(mask_ops) >= 5  # BERT builds its attention mask at the root, in many small ops
    nodes = nodes_of(dbg.render(str(tmp_path / "bert.svg"), depth=99))
    assert not set(mask_ops) & set(nodes)  # none of them is a box of its own
    plumbing = [t for t in nodes if t.startswith("plumbing/encoder")]
    assert plumbing, sorted(nodes)  # they sit, folded, in the encoder cluster that consumes the mask
    assert any("mask/shape plumbing" in " ".join(nodes[t]["text"]) for t in plumbing)


def test_long_flat_sequential_fits_in_runs(tmp_path: Path) -> None:
    layers: list[nn.Module] = []
    for _ in range(300):
        layers += [nn.Linear(4, 4), nn.ReLU()]
    gm = fxdebug.trace(nn.Sequential(*layers))  # 600 ops owned by the root: no module to collapse
    path = fxdebug.render(gm, tmp_path / "flat.svg", failed="_401")
    assert max(svg_size(Path(path).read_text(encoding="utf-8"))) <= FIT_PT
    nodes = nodes_of(path)
    assert nodes["_401"]["fill"] == COLORS["failed"]  # the run holding the failed node is drawn open
    assert "module/(nodes 1–100)" in nodes and "_400" in nodes and "_1" not in nodes


def _part_of(gid: str, parts: list[str]) -> str | None:
    """The part (longest module-path prefix) an SVG element id (``node/…``, ``module/…``, ``cluster/…``) draws."""
    path = gid.partition("/")[2]
    hits = [p for p in parts if path == p or path.startswith((p + "/", p + "."))]
    return max(hits, key=len, default=None)


def test_a_mixtral_captured_in_parts_stacks_them_in_execution_order(tmp_path: Path) -> None:
    """Issue 26: a Mixtral-like model the subtrees frontend captures in parts with no data edge between
    them (the residual adds run in the eager ``forward``) drew every part side by side (3,097 pt wide
    at two layers, 7,653 pt at four) in reverse order. Its parts stand one under the other, in the order they ran."""
    t = _transformers()
    cfg = t.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = t.MixtralForCausalLM(cfg).eval()
    tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    # the subtrees capture is the subject (its parts drawn in order): pinned, whatever "auto" means
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(tokens,), frontend="subtrees")
    with torch.no_grad():
        dbg(tokens)
    assert len(dbg.parts()) > 4
    path = dbg.render(str(tmp_path / "mixtral.svg"))
    width, height = svg_size(Path(path).read_text(encoding="utf-8"))
    assert max(width, height) <= FIT_PT, f"{width:.0f} x {height:.0f} pt"
    order = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    ys: dict[str, list[float]] = {}
    for g in ET.parse(path).getroot().iter(f"{SVG}g"):
        part = _part_of(g.get("id") or "", order)
        if part is not None and g.get("class") == "node":
            ys.setdefault(part, []).extend(float(t.get("y", "nan")) for t in g.iter(f"{SVG}text"))
    tops = {p: min(v) for p, v in ys.items()}
    assert list(tops) and sorted(tops, key=tops.__getitem__) == [p for p in order if p in tops], tops
    assert set(tops) >= {"model.layers.0", "model.layers.1", "lm_head"}
