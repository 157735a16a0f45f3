"""The benchmark's models and the hand-written variants it compares fxdebug with.

Models are defined here so the harness needs no downloads.

Each factory takes ``quick`` and returns ``(model, example_inputs)`` with the model in eval mode.
Full sizes are the ones the performance targets are stated for (ResNet-50-style batch 8 at 224²,
ViT-S-style 12 blocks d=384 with 197 tokens batch 8, 100 × Linear(1024) batch 256, a ~2,000-node
graph); ``quick`` shrinks every one of them so the whole harness runs in seconds, which is what
the smoke test and routine checks use. The architectures follow the published shapes closely
enough that per-op costs are representative; they are not weight-compatible with any library.

The comparison variants (hooks with and without host syncs, the one-reduction physical-limit
proxy) and the measuring helpers (peak memory, graph breaks) live here too, so ``bench.py`` is
only the timing loop and the table.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import re
import statistics
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = [
    "DEBUG_MODELS", "MODELS", "BasicBlock", "Bottleneck", "ResNet18Style", "ResNetStyle", "SyntheticGraph", "ViTStyle", "collector_passes", "count_graph_breaks",
    "deep_mlp", "hooked_copy", "limit_proxy", "passes_available", "peak_delta_mib", "sum_hooked_copy", "synchronize",
]


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3, 1×1 expand, with a projected shortcut when the shape changes."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        idt = x if self.down is None else self.down(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + idt)


class ResNetStyle(nn.Module):
    """ResNet-50's layout: 7×7 stem, four bottleneck stages [3, 4, 6, 3], global pool, classifier."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), base: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(base), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages, cin = [], base
        for i, n in enumerate(blocks):
            width = base * 2**i
            layer = []
            for j in range(n):
                layer.append(Bottleneck(cin, width, stride=2 if (j == 0 and i > 0) else 1))
                cin = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block with attention written out in ops (so every op is a node)."""

    def __init__(self, d: int, heads: int, mlp: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(mlp * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.heads
        qkv = self.qkv(self.norm1(x)).reshape(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * (d // h) ** -0.5
        y = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class ViTStyle(nn.Module):
    """ViT-S/16's layout: 16×16 patches of a 224² image (196 + class token = 197 tokens)."""

    def __init__(self, depth: int = 12, d: int = 384, heads: int = 6, image: int = 224, patch: int = 16,
                 classes: int = 1000) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, tokens, d) * 0.02)
        self.blocks = nn.Sequential(*[EncoderBlock(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img: Tensor) -> Tensor:
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def deep_mlp(layers: int = 100, width: int = 1024) -> nn.Sequential:
    """``layers`` × (Linear(width) + ReLU): many cheap nodes with large activations."""
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


class _Cell(nn.Module):
    """Five graph nodes on a small tensor: linear, relu, scale, residual add, layer norm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + torch.relu(self.lin(x)) * 0.5)


class SyntheticGraph(nn.Module):
    """About ``5 × cells`` nodes in nested groups: measures per-node costs, not arithmetic."""

    def __init__(self, cells: int = 400, d: int = 32, group: int = 20) -> None:
        super().__init__()
        groups = [nn.Sequential(*[_Cell(d) for _ in range(group)]) for _ in range(max(1, cells // group))]
        self.groups = nn.Sequential(*groups)

    def forward(self, x: Tensor) -> Tensor:
        return self.groups(x)


def _resnet(quick: bool) -> tuple[nn.Module, tuple[Tensor, ...]]:
    if quick:
        return ResNetStyle(blocks=(1, 1, 1, 1), base=8, classes=10), (torch.randn(2, 3, 32, 32),)
    return ResNetStyle(), (torch.randn(8, 3, 224, 224),)


def _vit(quick: bool) -> tuple[nn.Module, tuple[Tensor, ...]]:
    if quick:
        return ViTStyle(depth=2, d=32, heads=2, image=32, patch=8, classes=10), (torch.randn(2, 3, 32, 32),)
    return ViTStyle(), (torch.randn(8, 3, 224, 224),)


def _mlp(quick: bool) -> tuple[nn.Module, tuple[Tensor, ...]]:
    if quick:
        return deep_mlp(layers=10, width=64), (torch.randn(8, 64),)
    return deep_mlp(), (torch.randn(256, 1024),)


def _graph(quick: bool) -> tuple[nn.Module, tuple[Tensor, ...]]:
    if quick:
        return SyntheticGraph(cells=40, d=16, group=10), (torch.randn(4, 16),)
    return SyntheticGraph(), (torch.randn(8, 32),)


def _eval(factory: Callable[[bool], tuple[nn.Module, tuple[Tensor, ...]]]) -> Callable[[bool], tuple[nn.Module, tuple[Tensor, ...]]]:
    def build(quick: bool) -> tuple[nn.Module, tuple[Tensor, ...]]:
        torch.manual_seed(0)
        model, inputs = factory(quick)
        return model.eval(), inputs

    return build


MODELS: dict[str, Callable[[bool], tuple[nn.Module, tuple[Tensor, ...]]]] = {
    "resnet50-style": _eval(_resnet),
    "vit-s-style": _eval(_vit),
    "mlp-100x1024": _eval(_mlp),
    "graph-2000": _eval(_graph),
}


# -- the debugging-size suite: real architectures at the sizes people debug with --------------------
class BasicBlock(nn.Module):
    """ResNet-18's block: two 3×3 convs with batch-norm, identity or projected shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        idt = x if self.down is None else self.down(x)
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + idt)


class ResNet18Style(nn.Module):
    """ResNet-18's layout (stages [2, 2, 2, 2], widths 64–512)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for i, w in enumerate((64, 128, 256, 512)):
            layers += [BasicBlock(cin, w, 2 if i else 1), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _tokens(vocab: int = 1000, batch: int = 2, length: int = 16) -> Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


class _Logits(nn.Module):
    """A Hugging Face model returning only its main output tensor (logits / last hidden state),
    with its other inputs fixed: what a debugging session calls, and what ``.sum().backward()``
    can differentiate."""

    def __init__(self, model: nn.Module, key: str, **fixed: Tensor) -> None:
        super().__init__()
        self.model, self.key = model, key
        for name, t in fixed.items():
            self.register_buffer(name, t, persistent=False)
        self._fixed = list(fixed)

    def forward(self, x: Tensor) -> Tensor:
        extra = {k: getattr(self, k) for k in self._fixed}
        return getattr(self.model(x, **extra, return_dict=True), self.key)


def _hf(name: str) -> tuple[nn.Module, tuple[Tensor, ...]]:
    import transformers as tr

    d = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    if name == "bert":
        m = tr.BertModel(tr.BertConfig(vocab_size=1000, max_position_embeddings=64, **d))
        return _Logits(m, "last_hidden_state"), (_tokens(),)
    if name == "gpt2":
        m = tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2))
        return _Logits(m, "logits"), (_tokens(),)
    if name == "llama":
        m = tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=1000, max_position_embeddings=64, num_key_value_heads=2, **d))
        return _Logits(m, "logits"), (_tokens(),)
    if name == "t5":
        m = tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=1000, d_model=64, d_kv=32, d_ff=128, num_layers=2,
                                                      num_decoder_layers=2, num_heads=2))
        return _Logits(m, "logits", decoder_input_ids=_tokens(length=8)), (_tokens(),)
    if name == "vit":
        m = tr.ViTModel(tr.ViTConfig(image_size=32, patch_size=8, num_channels=3, **d), add_pooling_layer=False)
        return _Logits(m, "last_hidden_state"), (torch.randn(2, 3, 32, 32),)
    raise KeyError(name)


def _zoo(name: str) -> tuple[nn.Module, tuple[Tensor, ...]]:
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from zoo import ZOO  # tests/zoo.py: the shared model zoo

    model, inputs = ZOO[name]()
    return model, tuple(inputs)


DEBUG_MODELS: dict[str, Callable[[bool], tuple[nn.Module, tuple[Tensor, ...]]]] = {
    "resnet50-style 2x3x112x112": _eval(lambda q: (ResNetStyle(), (torch.randn(2, 3, 112, 112),))),
    "resnet18-style 1x3x64x64": _eval(lambda q: (ResNet18Style(), (torch.randn(1, 3, 64, 64),))),
    "vit-s-style 2 blocks 1x3x64x64": _eval(lambda q: (ViTStyle(depth=2, image=64, patch=16), (torch.randn(1, 3, 64, 64),))),
    "hf bert 2L d64 2x16": _eval(lambda q: _hf("bert")),
    "hf gpt2 2L d64 2x16": _eval(lambda q: _hf("gpt2")),
    "hf llama 2L d64 2x16": _eval(lambda q: _hf("llama")),
    "hf t5 2+2L d64 2x16": _eval(lambda q: _hf("t5")),
    "hf vit 2L d64 2x3x32x32": _eval(lambda q: _hf("vit")),
    "mlp 20x256 batch 2": _eval(lambda q: (deep_mlp(layers=20, width=256), (torch.randn(2, 256),))),
    "zoo residual_cnn": _eval(lambda q: _zoo("residual_cnn")),
    "zoo transformer_block": _eval(lambda q: _zoo("transformer_block")),
    "zoo functional_ops": _eval(lambda q: _zoo("functional_ops")),
}
"""Debugging sizes (batch 1–2, tiny configs, random weights): the suite ``bench.py --suite debug`` runs."""


def sum_hooked_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with a forward hook on every leaf module doing one ``sum`` (no sync)."""
    model = copy.deepcopy(model)

    def hook(mod: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, Tensor) and out.is_floating_point():
            out.detach().sum()

    for m in _leaves(model):
        m.register_forward_hook(hook)
    return model


# -- the variants fxdebug is compared with ---------------------------------------------------------
def passes_available() -> bool:
    """Whether ``fxdebug.passes`` provides NaNCheck and StatCollector (they are written in parallel)."""
    try:
        from fxdebug.passes import NaNCheck, StatCollector  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def collector_passes(grads: bool) -> list[Any]:
    """``[NaNCheck(mode="record"), StatCollector()]``, both also watching gradients when ``grads``."""
    from fxdebug.passes import NaNCheck, StatCollector

    if not grads:
        return [NaNCheck(mode="record"), StatCollector()]
    return [NaNCheck(mode="record", backward=True), StatCollector(grads=True)]


def _leaves(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if not list(m.children())]


def hooked_copy(model: nn.Module, sync: bool) -> nn.Module:
    """A copy of ``model`` with the usual hand-written forward hook on every leaf module.

    The hook computes mean, std, min, max and any-NaN of the output. With ``sync`` each is read
    with ``.item()`` (a host sync per statistic, as debugging hooks are usually written);
    without, the five values are stacked into a preallocated tensor, one row per module.
    """
    model = copy.deepcopy(model)
    leaves = _leaves(model)
    buf = torch.zeros(len(leaves), 5, device=next(iter(model.parameters())).device)
    seen: list[float] = []

    def hook(i: int) -> Callable[..., None]:
        def run(mod: nn.Module, args: Any, out: Any) -> None:
            if not (isinstance(out, Tensor) and out.is_floating_point()):
                return
            o = out.detach()
            stats = (o.mean(), o.std(), o.min(), o.max(), torch.isnan(o).any())
            if sync:
                seen[:] = [s.item() for s in stats]
            else:
                buf[i].copy_(torch.stack([s.float() for s in stats]))

        return run

    for i, m in enumerate(leaves):
        m.register_forward_hook(hook(i))
    return model


def _one_reduction(x: Any) -> None:
    """The least a collector can do to an activation: read it once."""
    if isinstance(x, Tensor) and x.is_floating_point():
        x.detach().sum(dtype=torch.float32)


def limit_proxy(model: nn.Module, inputs: tuple[Any, ...], observed: list[str] | None) -> nn.Module:
    """The traced model plus one ``sum`` after each observed node (all call nodes if ``None``)."""
    import fxdebug

    gm = fxdebug.trace(model, inputs)
    names = set(observed) if observed is not None else None
    for n in list(gm.graph.nodes):
        if n.op in ("call_module", "call_function", "call_method") and (names is None or n.name in names):
            with gm.graph.inserting_after(n):
                gm.graph.call_function(_one_reduction, (n,))
    gm.graph.lint()
    gm.recompile()
    return gm


# -- measuring helpers ------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_graph_breaks(model: nn.Module, inputs: tuple[Any, ...]) -> Any:
    """Graph breaks dynamo takes on ``model`` (an int), or a short reason when explain fails."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            exp = torch._dynamo.explain(model)(*inputs)
    except Exception as exc:  # noqa: BLE001 - the harness reports it instead of dying
        return f"explain failed: {type(exc).__name__}"
    finally:
        torch._dynamo.reset()
    return exp.graph_break_count


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"{field}:\s+(\d+)", f.read())
    return int(match.group(1)) if match else 0


def _cpu_peak_delta(fn: Callable[[], Any]) -> float | None:
    """Resident-memory high-water mark of one call above the resident size before it (MiB).

    Linux lets a process reset its own high-water mark (``/proc/self/clear_refs``); freed heap is
    handed back first (``malloc_trim``) so memory cached from an earlier variant is not counted
    as free headroom for this one.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def peak_delta_mib(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> float | None:
    """Median over ``repeats`` of the extra memory one call of ``fn`` needs at its peak (MiB)."""
    fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fn()
            torch.cuda.synchronize(device)
            out.append((torch.cuda.max_memory_allocated(device) - base) / 2**20)
        else:
            v = _cpu_peak_delta(fn)
            if v is None:
                return None
            out.append(v)
    return statistics.median(out)
