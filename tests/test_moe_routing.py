"""ExpertLoad on a Mixtral-style model: per-expert token counts and dead experts, without a host sync."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdebug
from fxdebug.passes import ExpertLoad, NaNCheck
from syncs import CountSyncs


class SparseMoE(nn.Module):
    """Mixtral's sparse MoE block, written without data-dependent Python: every expert runs on every
    token and the top-k routing weights mask the results (same output, traceable)."""

    def __init__(self, dim: int = 16, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
                                     for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        flat = h.reshape(-1, d)
        probs = F.softmax(self.gate(flat), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        dense = torch.zeros_like(probs).scatter(1, chosen, weights)  # (tokens, experts)
        outs = torch.stack([e(flat) for e in self.experts], dim=1)  # (tokens, experts, dim)
        return (dense.unsqueeze(-1) * outs).sum(1).reshape(b, t, d)


class TinyMixtral(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 2, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.moes = nn.ModuleList(SparseMoE(dim, experts) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(h)


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(seed))


def instrument(model: nn.Module, **options: Any) -> Any:
    return fxdebug.instrument(model, passes=[ExpertLoad(**options), NaNCheck()], example_inputs=(ids(),))


def routing_rows(rep: Any) -> list[dict[str, Any]]:
    return [r for r in rep.rows if "expert_tokens" in r]


def test_token_counts_per_expert_match_the_routing() -> None:
    torch.manual_seed(0)
    model = TinyMixtral()
    dbg = instrument(model)
    expected = [torch.zeros(4, dtype=torch.int64) for _ in model.moes]
    ref = copy.deepcopy(model)
    for i, moe in enumerate(ref.moes):  # the reference: the same top-k, counted by hand
        def count(mod: nn.Module, args: Any, out: Any, i: int = i) -> None:
            chosen = torch.topk(F.softmax(mod.gate(args[0].reshape(-1, 16)), -1), 2, dim=-1).indices
            expected[i] += torch.bincount(chosen.flatten(), minlength=4)
        moe.register_forward_hook(count)
    for seed in range(3):
        dbg(ids(seed))
        ref(ids(seed))
    rows = routing_rows(dbg.report())
    assert [r["module"] for r in rows] == ["moes.0", "moes.1"]
    for row, want in zip(rows, expected):
        assert row["expert_tokens"] == want.tolist()
        assert sum(row["expert_tokens"]) == 3 * 12 * 2  # calls x tokens x top_k
        assert row["expert_imbalance"] == pytest.approx(max(want.tolist()) / (sum(want.tolist()) / 4))


def test_a_dead_expert_is_named_in_a_finding() -> None:
    torch.manual_seed(0)
    model = TinyMixtral()
    with torch.no_grad():
        model.norms[1].weight.zero_()  # every token reaches layer 1's router as the same all-ones vector ...
        model.norms[1].bias.fill_(1.0)
        model.moes[1].gate.weight[3] = -1.0  # ... which scores expert 3 lowest: it never makes the top 2
    dbg = instrument(model)
    for seed in range(3):
        dbg(ids(seed))
    rep = dbg.report()
    rows = routing_rows(rep)
    assert rows[1]["dead_experts"] >= 1 and 3 in rows[1]["dead_expert_ids"] and rows[1]["expert_tokens"][3] == 0
    assert rows[0]["dead_experts"] == 0
    dead = [f for f in rep.findings() if f.kind == "dead_experts"]
    assert [f.module for f in dead] == ["moes.1"]
    assert "3" in dead[0].message



def test_counting_does_not_sync_and_outputs_stay_the_models() -> None:
    torch.manual_seed(0)
    model = TinyMixtral()
    dbg = instrument(model)
    x = ids(5)
    with CountSyncs() as counter:
        out = dbg(x)
    assert counter.syncs == 0
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_without_example_inputs_the_expert_count_must_be_given() -> None:
    with pytest.raises(fxdebug.UsageError, match="experts="):  # a snapshot has no shapes without inputs
        fxdebug.instrument(TinyMixtral(), passes=[ExpertLoad()], frontend="symbolic")
    live = fxdebug.instrument(TinyMixtral(), passes=[ExpertLoad()], frontend="dynamo")  # learns them at the call
    live(ids())
    assert [sum(r["expert_tokens"]) for r in routing_rows(live.report())] == [24, 24]
    dbg = fxdebug.instrument(TinyMixtral(), passes=[ExpertLoad(experts=4)])
    dbg(ids())
    assert [sum(r["expert_tokens"]) for r in routing_rows(dbg.report())] == [24, 24]


@pytest.mark.slow
def test_hugging_face_mixtral_routing_is_counted_per_layer() -> None:
    """A tiny randomly initialised transformers Mixtral (nothing downloaded): its MoE blocks are
    captured by the subtrees frontend and every layer's routing is counted as its router chose."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    dbg = fxdebug.instrument(model, passes=[ExpertLoad()], example_inputs=(tokens,))
    with torch.no_grad():
        dbg(tokens)
        ref = model(tokens, output_router_logits=True)
    rows = routing_rows(dbg.report())
    assert len(rows) == cfg.num_hidden_layers
    for row, logits in zip(rows, ref.router_logits):
        chosen = torch.topk(F.softmax(logits.float(), -1), 2, dim=-1).indices
        assert row["expert_tokens"] == torch.bincount(chosen.flatten(), minlength=4).tolist()
