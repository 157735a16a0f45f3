"""``dbg.to_module()``: observers removed, transforms kept, a plain module to save, export and trace."""

from __future__ import annotations

import io
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

import fxdebug
from fxdebug.passes import Fuse, NaNCheck, PruneMasks, StatCollector, SwapActivation
from real_models import detector
from zoo import ZOO

TRANSFORMS = lambda: [Fuse(), SwapActivation(), PruneMasks(0.3), StatCollector(), NaNCheck(mode="record")]  # noqa: E731
NOT_EXPORTABLE = {"control_flow"}  # data-dependent Python in an auto-leaf: torch.export refuses the model itself


def _call(m, ex):
    return m(**ex) if isinstance(ex, dict) else m(*ex)


def _equal(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_to_module_is_plain_and_computes_what_the_transforms_compute(name):
    model, ex = ZOO[name]()
    model.eval()
    # the subject is the plain module a snapshot makes (structure, save, trace, export); to_module() of the live
    # default: test_live_transforms.py (and the gap below)
    dbg = fxdebug.instrument(model, TRANSFORMS(), example_inputs=ex, frontend="symbolic")
    plain = dbg.to_module()
    assert type(plain).__mro__[1] is GraphModule and not isinstance(plain, fxdebug.Instrumented)
    assert not any(fxdebug.authoring.is_instrumentation(n) for n in plain.graph.nodes)
    assert not any(type(m).__name__ in ("Observer", "Clock", "InputGuard", "Masked") for m in plain.modules())
    assert not any(k.startswith("fxdebug.") for k in plain.state_dict())
    graph_targets = {str(n.target) for n in plain.graph.nodes if n.op in ("call_module", "get_attr")}
    assert all(any(k == t or k.startswith(f"{t}.") for t in graph_targets) for k in plain.state_dict())
    with torch.no_grad():  # the live default folds in the graph at each call, the plain module once: rounding apart
        want = _call(plain, ex)
        torch.testing.assert_close(want, _call(dbg, ex), rtol=1e-5, atol=1e-6)
    buf = io.BytesIO()
    torch.save(plain, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert _equal(_call(loaded, ex), want)
    args = ex if isinstance(ex, tuple) else tuple(ex.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(plain, args, strict=False, check_trace=False)
    with torch.no_grad():
        assert _equal(traced(*args), want)
    if name not in NOT_EXPORTABLE:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.export(plain, ex if isinstance(ex, tuple) else (),
                                          ex if isinstance(ex, dict) else None, strict=False)
        with torch.no_grad():
            assert _equal(_call(program.module(), ex), want)


@pytest.mark.xfail(strict=True, reason="to_module() of a live PruneMasks drops the masks of layers its snapshot holds "
                   "inside an auto-leaf (control_flow's gate.a / gate.b): instrumented/live_export.py carries masks only "
                   "where the snapshot has a mask of the same layer, and refuses only when a pass changed nothing there")
def test_to_module_of_a_live_prune_keeps_masks_inside_a_snapshot_leaf():
    model, ex = ZOO["control_flow"]()
    dbg = fxdebug.instrument(model.eval(), [PruneMasks(0.3)], example_inputs=ex)
    assert dbg.trace_info.frontend == "dynamo"
    with torch.no_grad():
        torch.testing.assert_close(_call(dbg.to_module(), ex), _call(dbg, ex), rtol=1e-5, atol=1e-6)


def test_state_dict_holds_only_the_parameters_the_graph_uses():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    plain = fxdebug.instrument(model, [Fuse()], example_inputs=(x,)).to_module()
    keys = set(plain.state_dict())
    assert "stem.0.weight" in keys and "stem.0.bias" in keys  # the fused conv takes the conv's own path
    assert not any(k.startswith("stem.1.") for k in keys)  # the folded batch-norm is gone
    assert sum(p.numel() for p in plain.parameters()) < sum(p.numel() for p in model.parameters())
    torch.testing.assert_close(plain(x), model(x), atol=1e-5, rtol=1e-5)


def test_masks_are_baked_and_nothing_is_shared_with_the_model():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    dbg = fxdebug.instrument(model, [PruneMasks(0.5)], example_inputs=(x,))
    plain = dbg.to_module()
    w = plain.get_submodule("layer1.0.conv1").weight
    assert (w == 0).float().mean().item() > 0.2 and (model.layer1[0].conv1.weight != 0).all()
    assert not {id(p) for p in plain.parameters()} & {id(p) for p in model.parameters()}
    assert torch.equal(plain(x), dbg(x))


def test_subtrees_detector_to_module_keeps_the_eager_root_and_plain_parts():
    model, (images,) = detector()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(images,), frontend="subtrees")
    shipped = dbg.to_module()
    assert type(shipped) is type(model)
    assert isinstance(shipped.backbone, GraphModule) and not isinstance(shipped.backbone, fxdebug.Instrumented)
    with torch.no_grad():
        assert _equal(shipped(images), model(images))


def test_instrumented_module_is_unchanged_by_to_module():
    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    # a snapshot graph that to_module() must leave as it is (its own graph: the subject)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="symbolic")
    before = len(list(dbg.graph.nodes))
    dbg.to_module()
    assert len(list(dbg.graph.nodes)) == before and dbg.observers()
    dbg(x)
    assert dbg.report().calls == 1


# -- shrink=True ---------------------------------------------------------------------------------
SHRINKS = {"residual_cnn", "transformer_block", "functional_ops", "shared_module", "dict_outputs", "control_flow"}


def _flops(m, ex) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        _call(m, ex)
    return counter.get_total_flops()


def _close(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(la, lb))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_shrink_removes_pruned_channels_and_keeps_the_masked_outputs(name):
    model, ex = ZOO[name]()
    model.eval()
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels")], example_inputs=ex)
    plain, small = dbg.to_module(), dbg.to_module(shrink=True)
    with torch.no_grad():
        assert _close(_call(small, ex), _call(dbg, ex))
    n_plain, n_small = (sum(p.numel() for p in m.parameters()) for m in (plain, small))
    if name in SHRINKS:
        assert n_small < n_plain and _flops(small, ex) < _flops(plain, ex)
    else:  # nothing removable was pruned (the only layer is the output layer, an LSTM, an embedding)
        assert n_small <= n_plain
    buf = io.BytesIO()
    torch.save(small, buf)
    buf.seek(0)
    with torch.no_grad():
        assert _close(_call(torch.load(buf, weights_only=False), ex), _call(dbg, ex))


class CatBlock(nn.Module):
    """Two branches concatenated, a batch-norm over the concatenation, a residual add, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 6, 3, padding=1)
        self.b = nn.Conv2d(3, 10, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.c = nn.Conv2d(16, 16, 3, padding=1)
        self.d = nn.Conv2d(16, 16, 1)
        self.fc = nn.Linear(16 * 4 * 4, 5)

    def forward(self, x):
        y = torch.relu(self.bn(torch.cat([self.a(x), self.b(x)], 1)))
        z = self.c(y) + self.d(y)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(torch.relu(z), 4), 1))


def test_shrink_across_concatenation_batch_norm_residual_and_flatten():
    torch.manual_seed(0)
    model = CatBlock().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8, 8)
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels")], example_inputs=(x,))
    small = dbg.to_module(shrink=True)
    assert small.get_submodule("a").out_channels < 6 and small.get_submodule("b").out_channels < 10
    assert small.get_submodule("bn").num_features == small.get_submodule("a").out_channels + small.get_submodule("b").out_channels
    assert small.get_submodule("c").out_channels == small.get_submodule("d").out_channels < 16  # coupled by the add
    assert small.get_submodule("fc").in_features == small.get_submodule("c").out_channels * 16
    torch.testing.assert_close(small(x), dbg(x), atol=1e-5, rtol=1e-4)


def test_shrink_tiny_llama_with_grouped_query_attention():
    """Each decoder MLP of a GQA LLaMA pruned and shrunk in place; the whole model keeps the masked logits.

    Structured pruning works on module-level graphs; the export frontend now captures the whole
    model at the aten level (where PruneMasks finds no layers), so the MLPs are instrumented here.
    """
    import copy

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 8))
    masked, small = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(2, 8, 32)
    for i, layer in enumerate(model.model.layers):
        dbg = fxdebug.instrument(layer.mlp, [PruneMasks(0.3, structured="channels")], example_inputs=(x,))
        masked.model.layers[i].mlp = dbg.to_module()
        small.model.layers[i].mlp = dbg.to_module(shrink=True)
        mlp = small.model.layers[i].mlp
        assert mlp.gate_proj.out_features == mlp.up_proj.out_features == mlp.down_proj.in_features < 64
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(small(input_ids=ids).logits, masked(input_ids=ids).logits, atol=1e-5, rtol=1e-4)
        assert _flops(small, {"input_ids": ids}) < _flops(masked, {"input_ids": ids})


def test_shrink_of_an_export_graph_without_pruning_is_a_plain_copy():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 8))
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs={"input_ids": ids}, frontend="export")
    assert dbg.trace_info.frontend == "export"
    small = dbg.to_module(shrink=True)
    with torch.no_grad():
        assert torch.equal(small(input_ids=ids).logits, dbg(input_ids=ids).logits)


class TorchvisionBlock(nn.Module):
    """torchvision's BasicBlock as written: one in-place ReLU module called twice, ``out += identity``."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


def test_shrink_a_torchvision_style_resnet_with_in_place_residual_adds():
    """B2: ``out += identity`` (operator.iadd) and the twice-called ReLU module no longer keep every channel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                          TorchvisionBlock(16, 16), TorchvisionBlock(16, 16), TorchvisionBlock(16, 32, 2),
                          TorchvisionBlock(32, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()
    x = torch.randn(2, 3, 16, 16)
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels")], example_inputs=(x,))
    plain = dbg.to_module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # shrinking must not give up
        small = dbg.to_module(shrink=True)
    assert sum(p.numel() for p in small.parameters()) < 0.5 * sum(p.numel() for p in plain.parameters())
    assert small.get_submodule("3.conv1").out_channels < 16 and small.get_submodule("5.conv1").out_channels < 32
    assert sum(n.target is operator.iadd for n in small.graph.nodes) == 4  # still written in place
    torch.testing.assert_close(small(x), dbg(x), atol=1e-5, rtol=1e-4)


def test_shrink_refuses_an_in_place_write_someone_else_reads_and_says_why():
    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 8, 1), nn.Conv2d(4, 8, 1)

        def forward(self, x):
            h = self.a(x)
            g = h * 2  # reads h before the in-place add
            h += self.b(x)
            return h, g, h.sum()

    torch.manual_seed(0)
    model = Aliased().eval()
    x = torch.randn(1, 4, 4, 4)
    dbg = fxdebug.instrument(model, [PruneMasks(0.5, structured="channels")], example_inputs=(x,))
    small = dbg.to_module(shrink=True)
    for a, b in zip(small(x), dbg(x)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
