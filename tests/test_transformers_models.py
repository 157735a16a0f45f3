"""Real architectures from Hugging Face transformers, built offline from tiny configs (no weights).

Symbolic tracing fails at the root of every one of them; fxdebug must still instrument each one
through the frontend that fits, with outputs bitwise equal to eager, the model's own parameters,
a NaN injected into one attention layer located by module path, and a picture with clusters.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import fxdebug
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _ids(batch: int = 2, seq: int = 8, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def bert() -> tuple[torch.nn.Module, dict[str, Any], str]:
    cfg = transformers.BertConfig(vocab_size=100, max_position_embeddings=32, **SMALL)
    inputs = {"input_ids": _ids(), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    return transformers.BertModel(cfg), inputs, "encoder.layer.1.attention.self.key"


def gpt2() -> tuple[torch.nn.Module, dict[str, Any], str]:
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": _ids()}, "transformer.h.1.attn.c_attn"


def llama() -> tuple[torch.nn.Module, dict[str, Any], str]:
    cfg = transformers.LlamaConfig(vocab_size=100, max_position_embeddings=32, num_key_value_heads=2,
                                   use_cache=False, **SMALL)
    return transformers.LlamaForCausalLM(cfg), {"input_ids": _ids()}, "model.layers.1.self_attn.k_proj"


def t5() -> tuple[torch.nn.Module, dict[str, Any], str]:
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=2, use_cache=False, decoder_start_token_id=0)
    inputs = {"input_ids": _ids(), "decoder_input_ids": _ids(seq=5)}
    return transformers.T5Model(cfg), inputs, "decoder.block.1.layer.0.SelfAttention.k"


def vit() -> tuple[torch.nn.Module, dict[str, Any], str]:
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, **SMALL)
    return transformers.ViTModel(cfg), {"pixel_values": torch.randn(2, 3, 16, 16)}, \
        "layers.1.attention.k_proj"


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, dict[str, Any], str]]] = {
    "bert": bert, "gpt2": gpt2, "llama": llama, "t5": t5, "vit": vit,
}


def _passes() -> list[fxdebug.Pass]:
    return [ShapeAssert(), NaNCheck(), StatCollector()]


def _main(out: Any) -> torch.Tensor:
    return out[0] if not isinstance(out, torch.Tensor) else out


@pytest.fixture(params=sorted(MODELS))
def case(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, dict[str, Any], str]:
    torch.manual_seed(0)
    model, inputs, attn = MODELS[request.param]()
    return request.param, model.eval(), inputs, attn


def test_symbolic_tracing_fails_at_the_root(case: Any) -> None:
    _, model, inputs, _ = case
    with pytest.raises(fxdebug.TraceError, match="root forward"):
        fxdebug.trace(model, inputs, frontend="symbolic")


def test_instrumented_outputs_equal_and_parameters_shared(case: Any) -> None:
    name, model, inputs, _ = case
    keys = list(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dbg = fxdebug.instrument(model, _passes(), example_inputs=inputs)
    frontend = dbg.trace_info.frontend  # instrument()'s "auto": the live capture, or the snapshot chain's export
    assert frontend in ("dynamo", "export")
    if frontend == "export":
        assert any("symbolic tracing failed" in n for n in dbg.trace_info.notes)
    ref, out = model(**inputs), dbg(**inputs)
    assert type(out) is type(ref)  # the model's own ModelOutput class, rebuilt
    for key in ref.keys():
        assert torch.equal(out[key], ref[key]), f"{name}: output {key} differs"
    assert list(dbg.state_dict()) == keys
    own = dict(model.named_parameters())
    assert all(p is own[k] for k, p in dbg.named_parameters() if k in own)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    report = dbg.report()
    assert report.frontend == frontend and report.calls == 1
    # T5's relative position buckets take log(0) = -inf on purpose (then clamp); the rest are finite.
    assert report.ok or (name == "t5" and report[report.first_nonfinite]["op"] in ("aten.log.default", "torch.log"))
    assert any(r["module"].startswith(("encoder.", "decoder.", "transformer.", "model.", "layers.")) for r in report.rows)


def test_nan_in_one_attention_layer_is_located_by_module_path(case: Any) -> None:
    name, model, inputs, attn = case
    dbg = fxdebug.instrument(model, _passes(), example_inputs=inputs)
    dbg(**inputs)
    expected = set(dbg.report().nonfinite_nodes)  # T5: the intended -inf of log(0) in position buckets
    dbg.reset()
    with torch.no_grad():
        model.get_submodule(attn).weight[0, 0] = float("nan")
    dbg(**inputs)
    report = dbg.report()
    new = [n for n in report.nonfinite_nodes if n not in expected]
    assert new, f"{name}: the injected NaN was not seen"
    assert report[new[0]]["module"] == attn, f"{name}: {new[0]} in {report[new[0]]['module']}"
    if not expected:
        assert report.first_nonfinite == new[0]


def test_copy_and_save(case: Any, tmp_path: Any) -> None:
    _, model, inputs, _ = case
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=inputs)
    ref = _main(model(**inputs))
    clone = copy.deepcopy(dbg)
    assert torch.equal(_main(clone(**inputs)), ref)
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(_main(loaded(**inputs)), ref)
    assert loaded.report().frontend == dbg.trace_info.frontend


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
def test_svg_has_module_clusters(tmp_path: Any) -> None:
    model, inputs, _ = bert()
    dbg = fxdebug.instrument(model.eval(), [StatCollector()], example_inputs=inputs)
    dbg(**inputs)
    path = dbg.render(str(tmp_path / "bert.svg"), depth=99)
    dot = (tmp_path / "bert.dot").read_text()
    with open(path, encoding="utf-8") as f:
        svg = f.read()
    assert "cluster" in dot and "encoder.layer.0.attention" in dot
    assert svg.lstrip().startswith(("<?xml", "<svg"))


def test_export_capture_takes_other_batch_and_sequence_lengths():
    """Tiny BERT instrumented on (2, 16) token ids runs (3, 20) and (1, 5) too, bitwise, one report."""
    model, _, _ = bert()
    model.eval()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs={"input_ids": _ids(2, 16)}, frontend="export")
    assert dbg.trace_info.frontend == "export"
    assert any("dynamic dimensions" in n and "input_ids[0, 1]" in n for n in dbg.trace_info.notes)
    with torch.no_grad():
        for shape in [(2, 16), (3, 20), (1, 5)]:
            ids = _ids(*shape)
            assert torch.equal(dbg(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    assert dbg.report().calls == 3


def test_default_config_gpt2_is_captured_by_export_with_its_cache_and_generates():
    """use_cache=True (the default): the DynamicCache comes out of the graph; generate() runs instrumented."""
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = _ids(2, 8)
    # export captures it whole (so the snapshot chain stops there: every op observed, not ~37% under subtrees);
    # the test is about that capture, pinned whatever instrument()'s "auto" means
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs={"input_ids": ids}, frontend="export")
    assert dbg.trace_info.frontend == "export"
    with torch.no_grad():
        want, got = model(input_ids=ids), dbg(input_ids=ids)
        assert torch.equal(got.logits, want.logits)
        assert type(got.past_key_values) is type(want.past_key_values)
        for a, b in zip(torch.utils._pytree.tree_leaves(got.past_key_values),
                        torch.utils._pytree.tree_leaves(want.past_key_values)):
            assert torch.equal(a, b)
        expected = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(dbg.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0), expected)
    from fxdebug.instrumented.snapshot_cache import other_signatures as captures

    assert captures(dbg) and any("captured again for a call with another signature" in n for n in dbg.trace_info.notes)


def test_trainer_style_loop_trains_the_model_through_the_instrumented_module():
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = _ids(2, 8)
    dbg = fxdebug.instrument(model, [StatCollector(grads=True)], example_inputs={"input_ids": ids, "labels": ids})
    dbg.train()
    assert dbg.config is model.config and dbg.training and dbg.device == model.device
    opt = torch.optim.SGD(dbg.parameters(), lr=0.1)
    before = model.transformer.wte.weight.detach().clone()
    for _ in range(2):
        loss = dbg(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(before, model.transformer.wte.weight)  # the model's own parameters trained
    assert dbg.report().calls == 2
