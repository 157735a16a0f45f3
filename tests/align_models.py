"""Model pairs for ``fxdebug.align``: two implementations of one function, with planted bugs.

* A hand-written LLaMA (Meta-style names, one fused ``wqkv`` projection, eager attention with an
  explicit causal mask, RoPE from an ``inv_freq`` buffer) against Hugging Face's
  ``LlamaForCausalLM`` (tiny config, weights copied by a state-dict key map).
* A torchvision-style ResNet (``conv1/bn1/layer1.0.downsample``, a spatial self-attention with a
  fused ``qkv``) against a hand-written one (``stem/stages/blocks/shortcut``, separate q/k/v).

``Bug`` flags plant one mistake each; ``BUG_MODULES`` says where it lives in the hand-written model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN = 100, 32, 2, 4, 2, 64
ROPE_BASE, NORM_EPS = 10000.0, 1e-6


@dataclass
class Bug:
    rope_base: float = ROPE_BASE  # wrong RoPE base
    norm_eps: float = NORM_EPS  # wrong RMSNorm epsilon (a config value: every norm)
    kv_repeat_wrong_order: bool = False  # kv heads tiled (k0 k1 k0 k1) instead of grouped (k0 k0 k1 k1)
    mask_off_by_one: bool = False  # each position also sees the next one
    swap_gate_up_layer: int | None = None  # silu(up) * gate in this layer
    softmax_bf16: bool = False  # attention softmax computed in bf16 in an fp32 model


LLAMA_BUGS = {
    "wrong RoPE base": (Bug(rope_base=500000.0), "rotary", "model.rotary_emb"),
    "wrong norm epsilon": (Bug(norm_eps=1e-5), "layers.0.attn_norm", "model.layers.0.input_layernorm"),
    "kv heads repeated in the wrong order": (Bug(kv_repeat_wrong_order=True), "layers.0.attn", "model.layers.0.self_attn"),
    "causal mask off by one": (Bug(mask_off_by_one=True), "layers.0.attn", "model.layers.0.self_attn"),
    "gate/up swapped in layer 1": (Bug(swap_gate_up_layer=1), "layers.1.mlp", "model.layers.1.mlp"),
    "softmax in bf16": (Bug(softmax_bf16=True), "layers.0.attn", "model.layers.0.self_attn"),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int) -> tuple[Tensor, Tensor]:
        t = torch.arange(seq_len, device=self.inv_freq.device).float()
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, bug: Bug) -> None:
        super().__init__()
        self.bug = bug
        self.head_dim = DIM // HEADS
        self.wqkv = nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self.wqkv(x).split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
        q = q.view(b, t, HEADS, d).transpose(1, 2)
        k = k.view(b, t, KV_HEADS, d).transpose(1, 2)
        v = v.view(b, t, KV_HEADS, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = HEADS // KV_HEADS
        if self.bug.kv_repeat_wrong_order:
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(2 if self.bug.mask_off_by_one else 1)
        scores = scores.masked_fill(future, float("-inf"))
        if self.bug.softmax_bf16:
            probs = scores.to(torch.bfloat16).softmax(-1).to(scores.dtype)
        else:
            probs = scores.softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(b, t, HEADS * d)
        return self.wo(out)


class MLP(nn.Module):
    def __init__(self, swapped: bool) -> None:
        super().__init__()
        self.swapped = swapped
        self.w1 = nn.Linear(DIM, FFN, bias=False)  # gate
        self.w3 = nn.Linear(DIM, FFN, bias=False)  # up
        self.w2 = nn.Linear(FFN, DIM, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.swapped:
            gate, up = up, gate
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, i: int, bug: Bug) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(DIM, bug.norm_eps)
        self.attn = Attention(bug)
        self.mlp_norm = RMSNorm(DIM, bug.norm_eps)
        self.mlp = MLP(bug.swap_gate_up_layer == i)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """A LLaMA written from the paper, Meta-style: ``tok_emb``, ``layers.i.attn.wqkv``, ``head``."""

    def __init__(self, bug: Bug | None = None) -> None:
        super().__init__()
        bug = bug or Bug()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.rotary = Rotary(DIM // HEADS, bug.rope_base)
        self.layers = nn.ModuleList(Block(i, bug) for i in range(LAYERS))
        self.norm = RMSNorm(DIM, bug.norm_eps)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok_emb(ids)
        cos, sin = self.rotary(ids.shape[1])
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def hf_llama(attn: str = "sdpa", seed: int = 0) -> nn.Module:
    """Hugging Face's LlamaForCausalLM at the tiny size, with non-trivial norm weights."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32,
                                   rms_norm_eps=NORM_EPS, rope_theta=ROPE_BASE, use_cache=False,
                                   attn_implementation=attn)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.mul_(5.0)  # hidden states of order 0.1
    return model


def hf_to_tiny(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face LLaMA state dict → ``TinyLlama`` keys (q/k/v concatenated into ``wqkv``)."""
    renames = {"model.embed_tokens.": "tok_emb.", "model.norm.": "norm.", "lm_head.": "head.",
               "input_layernorm.": "attn_norm.", "post_attention_layernorm.": "mlp_norm.", "self_attn.o_proj.": "attn.wo.",
               "mlp.gate_proj.": "mlp.w1.", "mlp.up_proj.": "mlp.w3.", "mlp.down_proj.": "mlp.w2.", "model.layers.": "layers."}
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        if ".self_attn." in key and key.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
            continue
        for old, new in renames.items():
            key = key.replace(old, new)
        out[key] = value
    for i in range(LAYERS):
        parts = [sd[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
        out[f"layers.{i}.attn.wqkv.weight"] = torch.cat(parts, dim=0)
    return out


def llama_pair(bug: Bug | None = None, attn: str = "sdpa") -> tuple[nn.Module, nn.Module, Tensor]:
    """(Hugging Face reference, hand-written candidate with ``bug``, token ids)."""
    ref = hf_llama(attn)
    cand = TinyLlama(bug).eval()
    cand.load_state_dict(hf_to_tiny(ref.state_dict()))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    return ref, cand, ids


class Logits(nn.Module):
    """The logits of a Hugging Face causal LM (its output is a ``ModelOutput``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(ids).logits


class Autocast(nn.Module):
    """Runs ``model`` under bf16 autocast: the same function at another precision."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = self.model(x)
        return out.float()


# ---------------------------------------------------------------------------------------------- ResNet

RESNET_BUGS = {
    "missing activation": ({"missing_relu": "stages.1.blocks.0"}, "stages.1.blocks.0", "layer2.0"),
    "wrong batch-norm epsilon": ({"bn_eps": "stages.0.blocks.1.c2.bn"}, "stages.0.blocks.1.c2.bn", "layer1.1.bn2"),
}


class TVBasicBlock(nn.Module):
    """torchvision's BasicBlock, as torchvision names it."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TVSpatialAttention(nn.Module):
    """Self-attention over the feature map's positions with one fused qkv projection."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        seq = x.flatten(2).transpose(1, 2)  # (b, hw, c)
        qkv = self.qkv(seq).reshape(b, h * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        out = self.proj(out.transpose(1, 2).reshape(b, h * w, c))
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class TorchvisionStyleResNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(TVBasicBlock(width, width, 1), TVBasicBlock(width, width, 1))
        self.layer2 = nn.Sequential(TVBasicBlock(width, 2 * width, 2), TVBasicBlock(2 * width, 2 * width, 1))
        self.attn = TVSpatialAttention(2 * width)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.attn(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(x))


class ResBlock(nn.Module):
    def __init__(self, path: str, cin: int, cout: int, stride: int, bugs: dict[str, str]) -> None:
        super().__init__()
        self.act = bugs.get("missing_relu") != path
        self.c1 = ConvBN(cin, cout, 3, stride)
        self.c2 = ConvBN(cout, cout, 3, 1)
        if bugs.get("bn_eps") == f"{path}.c2.bn":
            self.c2.bn.eps = 1e-3
        self.shortcut = ConvBN(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        y = self.c1(x)
        y = F.relu(y) if self.act else y
        return F.relu(self.c2(y) + self.shortcut(x))


class Stage(nn.Module):
    def __init__(self, path: str, cin: int, cout: int, stride: int, bugs: dict[str, str]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResBlock(f"{path}.blocks.0", cin, cout, stride, bugs),
                                     ResBlock(f"{path}.blocks.1", cout, cout, 1, bugs)])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class MixAttention(nn.Module):
    """The same spatial attention written with separate q/k/v and eager softmax."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        seq = x.permute(0, 2, 3, 1).reshape(b, h * w, c)
        d = c // self.heads

        def heads(t: Tensor) -> Tensor:
            return t.view(b, h * w, self.heads, d).transpose(1, 2)

        q, k, v = heads(self.q(seq)), heads(self.k(seq)), heads(self.v(seq))
        probs = (q @ k.transpose(-1, -2) * d ** -0.5).softmax(-1)
        y = self.out((probs @ v).transpose(1, 2).reshape(b, h * w, c))
        return x + y.reshape(b, h, w, c).permute(0, 3, 1, 2)


class HandResNet(nn.Module):
    """A ResNet written by hand: ``stem``, ``stages.i.blocks.j.c1/c2/shortcut``, ``mix``, ``head``."""

    def __init__(self, width: int = 8, classes: int = 10, bugs: dict[str, str] | None = None) -> None:
        super().__init__()
        bugs = bugs or {}
        self.stem = ConvBN(3, width, 3, 1)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.stages = nn.ModuleList([Stage("stages.0", width, width, 1, bugs), Stage("stages.1", width, 2 * width, 2, bugs)])
        self.mix = MixAttention(2 * width)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(F.relu(self.stem(x)))
        for stage in self.stages:
            x = stage(x)
        x = self.mix(x)
        return self.head(x.mean((2, 3)))


def tv_to_hand(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """torchvision-style state dict → ``HandResNet`` keys (the fused qkv split into q, k, v)."""
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        new = key.replace("conv1.", "c1.conv.").replace("bn1.", "c1.bn.").replace("conv2.", "c2.conv.")
        new = new.replace("bn2.", "c2.bn.").replace("downsample.0.", "shortcut.conv.").replace("downsample.1.", "shortcut.bn.")
        if key.startswith(("conv1.", "bn1.")):
            new = "stem." + new[len("c1."):]
        for i in (1, 2):
            if new.startswith(f"layer{i}."):
                layer, block, rest = new.split(".", 2)
                new = f"stages.{i - 1}.blocks.{block}.{rest}"
        new = new.replace("attn.proj.", "mix.out.").replace("fc.", "head.")
        if key.startswith("attn.qkv."):
            for name, part in zip("qkv", value.chunk(3, dim=0)):
                out[f"mix.{name}.{key.rsplit('.', 1)[1]}"] = part
            continue
        out[new] = value
    return out


def resnet_pair(bugs: dict[str, str] | None = None) -> tuple[nn.Module, nn.Module, Tensor]:
    """(torchvision-style reference, hand-written candidate with ``bugs``, images)."""
    torch.manual_seed(0)
    ref = TorchvisionStyleResNet().eval()
    with torch.no_grad():  # running statistics as a trained network has them
        for m in ref.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.normal_(1, 0.1)
                m.bias.normal_(0, 0.1)
    cand = HandResNet(bugs=bugs).eval()
    sd = tv_to_hand(ref.state_dict())
    cand.load_state_dict(sd)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return ref, cand, x
