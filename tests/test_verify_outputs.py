"""``fxdebug.verify`` on what real models return and draw: a key/value cache object compared by its
tensors (issue 35 B2), numpy's random masks drawn from numpy's own stream in training (issue 34: wav2vec2's
SpecAugment), and a forward that refuses inputs needing a gradient."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import fxdebug
from fxdebug.instrumented.verify_values import flat_values
from fxdebug.passes import NaNCheck, SwapActivation


class _Cache:
    """A result object as HF's ``DynamicCache``: tensors in a list of plain objects, compared by identity."""

    def __init__(self) -> None:
        self.layers: list[_Layer] = []


class _Layer:
    def __init__(self, keys: Tensor, values: Tensor) -> None:
        self.keys, self.values = keys, values


class CachingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(8, 8)
        self.v = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> tuple[Tensor, _Cache]:
        cache = _Cache()
        k, v = self.act(self.k(x)), self.v(x)
        cache.layers.append(_Layer(k, v))
        return k + v, cache


def test_a_cache_object_is_compared_by_its_tensors() -> None:
    torch.manual_seed(0)
    model, x = CachingBlock(), torch.randn(3, 8)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,))
    result = fxdebug.verify(dbg, (x,))
    assert result.ok, str(result)
    paths = [p for p, _ in flat_values(model(x))]
    assert "1.layers.0.keys" in paths and "1.layers.0.values" in paths


def test_a_cache_whose_tensors_differ_is_a_mismatch_named_by_path() -> None:
    torch.manual_seed(0)
    model, x = CachingBlock(), torch.randn(3, 8)
    swapped = fxdebug.instrument(model, [SwapActivation()], example_inputs=(x,))
    result = fxdebug.verify(swapped, (x,))
    assert not result.ok
    assert any("output 1.layers.0.keys differs" in m for m in result.mismatches), result.mismatches


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_causal_lm_with_its_default_cache_verifies(arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg).eval()
    else:
        cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                       bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(cfg).eval()
    assert cfg.use_cache
    ids = torch.randint(0, 50, (1, 6))
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(ids,))
    result = fxdebug.verify(dbg, (ids,))
    assert result.ok, str(result)


class NumpyMasks(nn.Module):
    """Masks drawn from numpy's global stream in training, as wav2vec2's SpecAugment does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.embed = nn.Parameter(torch.randn(8))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if self.training:
            mask = np.random.uniform(size=h.shape[:1]) < 0.5
            h = h.clone()
            h[torch.from_numpy(mask)] = self.embed
        return h


def test_numpy_masks_come_from_numpys_stream_and_verify_agrees() -> None:
    torch.manual_seed(0)
    model, x = NumpyMasks().train(), torch.randn(16, 8)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,))
    outs, nexts = [], []
    for module in (model, dbg):
        np.random.seed(3)
        outs.append(module(x))
        nexts.append(np.random.rand())
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    assert nexts[0] == nexts[1]  # the instrumented call drew from numpy's stream as the model did
    result = fxdebug.verify(dbg, (x,))
    assert result.ok, str(result)


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor:UserWarning")  # transformers' own code warns
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`:UserWarning")
def test_wav2vec2_in_training_verifies() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        mask_time_prob=0.5, mask_time_length=2, vocab_size=12)
    model = transformers.Wav2Vec2ForCTC(cfg).train()
    x = torch.randn(2, 800)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=(x,))
    result = fxdebug.verify(dbg, (x,))
    assert result.ok, str(result)
