"""A zoo of small but real models, each a factory returning ``(model, example_inputs)``.

They cover what tracing and instrumentation meet in practice: residual CNNs with batch-norm,
attention, functional calls and tensor methods, in-place ops, a module called twice, parameters
used directly, buffers, dict/tuple outputs, keyword inputs, an LSTM, an embedding, data-dependent
control flow (traceable only with auto-leafing), and the flatten/Linear mismatch of scenario 1.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return F.relu(out)


class ResidualCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class Attention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.softmax(dim=-1)
        out = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class TransformerBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class FunctionalOps(nn.Module):
    """Functional calls and tensor methods: view, flatten, permute, chunk, cat."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 6)

    def forward(self, x):
        y = F.relu(self.conv(x))
        a, b = y.chunk(2, dim=1)
        y = torch.cat([b, a], dim=1).permute(0, 1, 3, 2).contiguous()
        y = F.max_pool2d(y, 2)
        y = torch.sigmoid(y) * 2.0 - 1.0
        return self.fc(y.flatten(1)).view(-1, 2, 3)


class InplaceOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x)
        h += x
        h.relu_()
        g = self.fc2(h)
        g.mul_(0.5)
        g = torch.relu_(g)
        return F.relu(g - 0.1, inplace=True)


class SharedModule(nn.Module):
    """One module called twice, with a residual connection between the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.block(x)
        h = self.block(h) + h
        return self.out(h)


class GetAttrParams(nn.Module):
    """Parameters and buffers used directly (get_attr), not through a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 5) * 0.3)
        self.bias = nn.Parameter(torch.zeros(5))
        self.register_buffer("scale", torch.full((5,), 2.0))
        self.register_buffer("offset", torch.ones(5), persistent=False)

    def forward(self, x):
        return (x @ self.weight + self.bias) * self.scale - self.offset


class DictOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.cls = nn.Linear(8, 3)
        self.box = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return {"logits": self.cls(h), "boxes": torch.sigmoid(self.box(h))}


class TupleOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 4)
        self.dec = nn.Linear(4, 6)

    def forward(self, x):
        z = self.enc(x)
        return z, self.dec(F.leaky_relu(z))


class KwargsInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x, *, scale: float = 1.0, mask=None):
        y = self.fc(x) * scale
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return y


class LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 7, batch_first=True)
        self.head = nn.Linear(7, 2)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1]) + h[-1].sum(-1, keepdim=True)


class EmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(dim=1))


class DataDependentGate(nn.Module):
    """Branches on a tensor value: untraceable, so fxdebug must make it a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


class ControlFlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.gate = DataDependentGate()
        self.post = nn.Linear(8, 2)

    def forward(self, x):
        return self.post(torch.relu(self.gate(self.pre(x))))


class MnistMismatch(nn.Module):
    """Scenario 1: conv(1→10, k=5) → ReLU → maxpool(2) gives 1,440 features, but fc1 expects 1,000."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 10, 5)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(1000, 50)

    def forward(self, x):
        x = self.pool(F.relu(self.conv(x)))
        x = x.view(x.size(0), -1)
        return self.fc1(x)


class GraphBreakPair(nn.Module):
    """Two linears with a graph break between them: a live capture hands over two graphs (not in ``ZOO``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(x).tanh()


def _seeded(factory: Callable[[], tuple[nn.Module, tuple]]) -> Callable[[], tuple[nn.Module, tuple]]:
    def make() -> tuple[nn.Module, tuple]:
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(1234)
            return factory()

    make.__name__ = factory.__name__
    return make


ZOO: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "residual_cnn": _seeded(lambda: (ResidualCNN(), (torch.randn(2, 3, 16, 16),))),
    "transformer_block": _seeded(lambda: (TransformerBlock(), (torch.randn(2, 5, 16),))),
    "functional_ops": _seeded(lambda: (FunctionalOps(), (torch.randn(2, 4, 8, 8),))),
    "inplace_ops": _seeded(lambda: (InplaceOps(), (torch.randn(3, 8),))),
    "shared_module": _seeded(lambda: (SharedModule(), (torch.randn(3, 8),))),
    "get_attr_params": _seeded(lambda: (GetAttrParams(), (torch.randn(3, 8),))),
    "dict_outputs": _seeded(lambda: (DictOutputs(), (torch.randn(3, 6),))),
    "tuple_outputs": _seeded(lambda: (TupleOutputs(), (torch.randn(3, 6),))),
    "kwargs_inputs": _seeded(lambda: (KwargsInputs(), (torch.randn(3, 6),))),
    "lstm": _seeded(lambda: (LSTMModel(), (torch.randn(2, 4, 5),))),
    "embedding": _seeded(lambda: (EmbeddingModel(), (torch.randint(0, 20, (3, 5)),))),
    "control_flow": _seeded(lambda: (ControlFlow(), (torch.randn(3, 8),))),
}

# Models that are broken on purpose (scenario tests), kept out of the equivalence sweep.
BROKEN: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "mnist_mismatch": _seeded(lambda: (MnistMismatch(), (torch.randn(2, 1, 28, 28),))),
}

ZOO_AND_BROKEN = {**ZOO, **BROKEN}
