"""Real transformers (tiny configs, no weights), export frontend: instrumented in eval, then switched
with ``dbg.train()``, they train like ``model.train()`` (dropout on) under the same seed, and go back.

torch.export bakes the mode into the graph (``aten.dropout(..., train=False)``); before per-mode
capture the switched module kept running the eval graph, with dropout silently off.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def _ids(batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 100, (batch, seq))


def bert() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.BertConfig(vocab_size=100, max_position_embeddings=32, hidden_dropout_prob=0.2,
                                  attention_probs_dropout_prob=0.2, **SMALL)
    return transformers.BertModel(cfg), {"input_ids": _ids(), "attention_mask": torch.ones(2, 8, dtype=torch.long)}


def gpt2() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                  resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": _ids()}


def vit() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_dropout_prob=0.2,
                                 attention_probs_dropout_prob=0.2, **SMALL)
    return transformers.ViTModel(cfg), {"pixel_values": torch.randn(2, 3, 16, 16)}


def llama() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.LlamaConfig(vocab_size=100, max_position_embeddings=32, num_key_value_heads=2,
                                   use_cache=False, attention_dropout=0.2, **SMALL)
    return transformers.LlamaForCausalLM(cfg), {"input_ids": _ids()}


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "bert": bert, "gpt2": gpt2, "llama": llama, "vit": vit}


def _main(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _step(module: nn.Module, inputs: dict[str, Any], seed: int) -> tuple[torch.Tensor, dict[str, Any]]:
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = _main(module(**inputs))
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), {k: None if p.grad is None else p.grad.clone() for k, p in module.named_parameters()}


def _same(dbg: nn.Module, ref: nn.Module, inputs: dict[str, Any], seed: int) -> torch.Tensor:
    out, grads = _step(dbg, inputs, seed)
    out_ref, grads_ref = _step(ref, inputs, seed)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    for k, g in grads_ref.items():
        assert (g is None) == (grads[k] is None), k
        if g is not None:
            torch.testing.assert_close(grads[k], g, rtol=0, atol=0, msg=f"gradient of {k}")
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_instrumented_in_eval_trains_like_the_model(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=inputs, frontend="export")
    ref = copy.deepcopy(model)
    eval_graph = dbg.graph
    dbg.train()
    ref.train()
    trained = _same(dbg, ref, inputs, seed=1)
    assert dbg.graph is not eval_graph, "the train-mode graph was not captured"
    with torch.no_grad():
        torch.manual_seed(1)
        assert not torch.equal(trained, _main(model.eval()(**inputs))), "dropout had no effect: the test is void"
    model.train()
    _same(dbg, ref, inputs, seed=2)
    dbg.eval()
    ref.eval()
    _same(dbg, ref, inputs, seed=3)
    assert dbg.graph is eval_graph, "switching back reuses the eval capture"
    assert any("depends on the training flag" in n for n in dbg.report().notes)
