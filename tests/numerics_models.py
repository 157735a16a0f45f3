"""Small models whose reduced-precision output drifts because of one op (numerics tests, docs)."""

from __future__ import annotations

import torch
from torch import nn


class CancellingNorm(nn.Module):
    """Normalises with the variance computed as E[x²] − E[x]²: in bf16 the subtraction of two
    nearly equal large numbers cancels every correct digit (a textbook cancellation)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        y = (x - mean) * torch.rsqrt(var.clamp_min(1e-6) + 1e-5)
        return y * self.scale


class NaiveSoftmax(nn.Module):
    """Attention scores through a softmax written without max subtraction: exp of large logits
    amplifies their rounding error in bf16, and overflows to Inf in fp16 (NaN after the divide)."""

    def __init__(self, dim: int = 16, temperature: float = 0.3) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.temperature = temperature

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        scores = (h @ h.transpose(-2, -1)) / self.temperature
        e = torch.exp(scores)
        p = e / e.sum(-1, keepdim=True)
        return p @ h


def cancelling_norm() -> tuple[nn.Module, tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return CancellingNorm(), (10.0 + 0.5 * torch.randn(8, 64, generator=g),)


def naive_softmax() -> tuple[nn.Module, tuple[torch.Tensor]]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = NaiveSoftmax()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(2, 6, 16, generator=g),)


class NaiveAttention(nn.Module):
    """Attention probabilities through ``exp(s) / exp(s).sum()`` with no max subtraction, on scores
    that share a large offset (query and key biases point the same way, an "attention sink"):
    rounding the scores to bf16 (spacing 0.25 near 40) turns into several percent error in the
    probabilities once exp amplifies it; in fp16 exp(40) overflows to Inf and the divide makes NaN."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        nn.init.constant_(self.q.bias, 1.5)
        nn.init.constant_(self.k.bias, 1.5)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-2, -1)
        e = torch.exp(scores)
        return e / e.sum(-1, keepdim=True)


def naive_attention() -> tuple[nn.Module, tuple[torch.Tensor]]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = NaiveAttention()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(2, 6, 16, generator=g),)
