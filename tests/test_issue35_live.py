"""Issue 35, the live module's part: observation survives an exception (B1), transforms survive
``to_module()`` (B4), a fused module exports (B14), and the headline of a failure names the op that failed (B15).

Each test defines its own model class: Dynamo's cache (and, before B1's fix, its "skip this code") is per class.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.errors import NonFiniteError
from fxdebug.passes import NaNCheck, StatCollector


def _calls(dbg, node):
    return {r["node"]: r.get("calls") for r in dbg.report().rows}[node]


# -- B1: one exception does not stop observation -----------------------------------------------------------
class RaisesOnThree(nn.Module):
    """A model whose own forward raises for one batch size (a user's validation)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] == 3:
            raise ValueError("no batches of 3")
        return torch.log(self.fc(x))


def test_the_same_module_observes_after_the_models_own_exception():
    dbg = fxdebug.instrument(RaisesOnThree(), [NaNCheck(mode="record"), StatCollector()])
    dbg(torch.randn(2, 4))
    with pytest.raises(ValueError, match="no batches of 3"):
        dbg(torch.randn(3, 4))
    dbg(torch.randn(2, 4))
    dbg(torch.randn(5, 4))  # a new shape after the exception is captured and observed too
    assert _calls(dbg, "fc") == 3
    assert _calls(dbg, "log") == 3


class RaisesAfterABreak(nn.Module):
    """The exception comes after a graph break: Dynamo's resume function (the forward's rest) fails to compile."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        print("", end="")  # a graph break
        if h.shape[0] == 3:
            raise ValueError("no batches of 3")
        return self.fc2(h)


def test_the_rest_after_a_graph_break_observes_after_an_exception():
    dbg = fxdebug.instrument(RaisesAfterABreak(), [StatCollector()])
    dbg(torch.randn(2, 4))
    with pytest.raises(ValueError, match="no batches of 3"):
        dbg(torch.randn(3, 4))
    dbg(torch.randn(2, 4))
    dbg(torch.randn(5, 4))
    assert _calls(dbg, "fc") == 4  # the graph before the break ran in the failing call too
    assert _calls(dbg, "fc2") == 3


class OneOfTwo(nn.Module):
    """Hugging Face's argument check: ``input_ids`` or ``inputs_embeds``, not both."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.fc = nn.Linear(4, 4)

    def forward(self, input_ids=None, inputs_embeds=None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        h = self.emb(input_ids) if inputs_embeds is None else inputs_embeds
        return torch.log(self.fc(h))


def test_the_same_module_observes_after_a_wrong_argument():
    model = OneOfTwo()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.fill_(1.0)  # log(1): finite
    dbg = fxdebug.instrument(model, [NaNCheck(mode="raise")])
    ids = torch.tensor([[1, 2, 3]])
    dbg(input_ids=ids)
    with pytest.raises(ValueError, match="exactly one"):
        dbg(input_ids=ids, inputs_embeds=torch.randn(1, 3, 4))
    with torch.no_grad():
        model.fc.bias.fill_(-1.0)  # log(-1): NaN
    with pytest.raises(NonFiniteError):  # the raise-mode check still runs: NaN does not pass
        dbg(input_ids=ids)


class RaisesOnOdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] % 2:
            raise ValueError("even batches only")
        return torch.log(self.fc(x))


def test_a_new_instrument_of_the_class_observes_after_an_exception():
    first = fxdebug.instrument(RaisesOnOdd(), [NaNCheck(mode="record")])
    first(torch.randn(2, 4))
    with pytest.raises(ValueError, match="even batches only"):
        first(torch.randn(3, 4))
    model = RaisesOnOdd()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.fill_(-1.0)  # log(-1): NaN
    fresh = fxdebug.instrument(model, [NaNCheck(mode="raise")])
    with pytest.raises(NonFiniteError):
        fresh(torch.randn(2, 4))
    counted = fxdebug.instrument(RaisesOnOdd(), [StatCollector()])
    counted(torch.randn(2, 4))
    counted(torch.randn(4, 4))
    assert _calls(counted, "fc") == 2


# -- B4: transforms survive to_module() -----------------------------------------------------------------------
class DeadFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(16, 16)
        self.act2 = nn.ReLU()
        self.out = nn.Linear(16, 2)
        with torch.no_grad():
            self.fc1.bias.fill_(-3.0)  # act1 is dead for the inputs below

    def forward(self, x):
        return self.out(self.act2(self.fc2(self.act1(self.fc1(x)))))


def test_to_module_of_a_live_swap_keeps_the_swap():
    from fxdebug.passes import SwapActivation

    model, x = DeadFirst(), torch.randn(4, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    dbg(x)
    fixed = fxdebug.instrument(dbg, [SwapActivation(only_dead=0.5)], example_inputs=(x,))  # the demo's fix route
    assert fixed.trace_info.frontend == "dynamo"
    plain = fixed.to_module()
    with torch.no_grad():
        want, got, original = fixed(x), plain(x), model(x)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, original)  # the swap matters here: the dead ReLU passes a slope now
    assert isinstance(plain.get_submodule("act1"), nn.LeakyReLU)
    assert not any("fxdebug" in k for k in plain.state_dict())


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_to_module_of_live_prune_masks_keeps_the_masks_it_computes_with():
    from fxdebug.passes import PruneMasks

    model, x = TwoLayers(), torch.randn(4, 8)
    fixed = fxdebug.instrument(model, [PruneMasks(amount=0.5)], example_inputs=(x,), frontend="dynamo")
    with torch.no_grad():
        fixed(x)
        # the weights move after the masks were chosen (training): the ranking turns over, the masks stay
        for layer in (model.fc1, model.fc2):
            w = layer.weight
            w.copy_(w.sign() * (w.abs().max() - w.abs() + 1e-3))
        want, original = fixed(x), model(x)
    plain = fixed.to_module()
    with torch.no_grad():
        got = plain(x)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, original)
    weight = dict(plain.named_parameters())["fc1.weight"]
    assert 0.4 < float((weight == 0).float().mean()) < 0.6


# -- B14: a fused module exports; a live one says what to export ------------------------------------------------
class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def _onnx_export(module, x):
    import io
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's note on the legacy (TorchScript) exporter
        buffer = io.BytesIO()
        torch.onnx.export(module, (x,), buffer, dynamo=False)
    return buffer.getvalue()


def test_onnx_export_of_a_fused_module_builds_its_graph():
    from fxdebug.passes import Fuse

    model, x = ConvBN().eval(), torch.randn(1, 3, 8, 8)
    # the subject is the snapshot module itself traced and exported (a live module refuses tracing and points to
    # to_module(): test_tracing_a_live_module_points_to_to_module); the live default's to_module() is fused too
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fxdebug.instrument(model, [Fuse()], (x,)).to_module().modules())
    dbg = fxdebug.instrument(model, [Fuse()], example_inputs=(x,), frontend="symbolic")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in dbg.to_module().modules())  # fused
    try:
        import onnx
    except ImportError:
        onnx = None
    if onnx is None:  # the exporter built the whole ONNX graph; only writing it out needs the onnx package
        with pytest.raises(torch.onnx.OnnxExporterError, match="onnx is not installed"):
            _onnx_export(dbg, x)
    else:
        proto = onnx.load_model_from_string(_onnx_export(dbg, x))
        assert "BatchNormalization" not in {n.op_type for n in proto.graph.node}
    traced = torch.jit.trace(dbg, (x,))
    torch.testing.assert_close(traced(x), model(x))


def test_tracing_a_live_module_points_to_to_module():
    from fxdebug.errors import UsageError

    model, x = ConvBN().eval(), torch.randn(1, 3, 8, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    assert dbg.trace_info.frontend == "dynamo"
    with pytest.raises(UsageError, match=r"dbg\.to_module\(\)"):
        torch.jit.trace(dbg, (x,))
    with pytest.raises(UsageError, match=r"dbg\.to_module\(\)"):
        _onnx_export(dbg, x)
    traced = torch.jit.trace(dbg.to_module(), (x,))
    torch.testing.assert_close(traced(x), model(x))


# -- B15: the headline names the op that failed ------------------------------------------------------------------
class Positions(nn.Module):
    """GPT-2's embedding in miniature: ``view(-1, length)``, then a position table of 16 rows."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 8)
        self.pos = nn.Embedding(16, 8)

    def forward(self, ids):
        ids = ids.view(-1, ids.shape[-1])
        where = torch.arange(ids.shape[-1]).unsqueeze(0)
        return self.tok(ids) + self.pos(where)


def test_too_long_input_blames_the_position_embedding_not_an_older_graphs_view():
    from fxdebug.errors import FxDebugError

    dbg = fxdebug.instrument(Positions(), [NaNCheck(), StatCollector()], example_inputs=(torch.randint(0, 50, (1, 8)),))
    with pytest.raises(IndexError):  # plain torch
        Positions()(torch.randint(0, 50, (1, 20)))
    with pytest.raises(FxDebugError) as info:
        dbg(torch.randint(0, 50, (1, 20)))
    assert info.value.module == "pos", str(info.value)
    assert "index out of range" in info.value.message
    assert "view" not in info.value.message.split(":")[0]


def test_gpt2_past_its_positions_blames_wpe():
    transformers = pytest.importorskip("transformers")
    from fxdebug.errors import FxDebugError

    cfg = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=8, n_layer=1, n_head=2, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    dbg = fxdebug.instrument(model, [NaNCheck(), StatCollector()], example_inputs=(torch.randint(0, 100, (1, 8)),))
    with pytest.raises(FxDebugError) as info:
        dbg(torch.randint(0, 100, (1, 20)))
    assert info.value.module == "transformer.wpe", str(info.value)
    assert "index out of range" in info.value.message


class LoopsByBatch(nn.Module):
    """Symbolic tracing cannot run ``int(x.shape[0])``: to_module()'s snapshot is an export graph (aten names)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.act1 = nn.ReLU()
        with torch.no_grad():
            self.fc1.bias.fill_(-3.0)

    def forward(self, x):
        out = x
        for _ in range(int(x.shape[0]) // 4):
            out = self.act1(self.fc1(out))
        return out


def test_to_module_refuses_to_drop_a_transform_it_cannot_match():
    from fxdebug.errors import PassError
    from fxdebug.passes import SwapActivation

    model, x = LoopsByBatch(), torch.randn(4, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    dbg(x)
    fixed = fxdebug.instrument(dbg, [SwapActivation(only_dead=0.5)], example_inputs=(x,))
    with pytest.raises(PassError, match=r"swap-activation changed the live capture .*frontend='symbolic'"):
        fixed.to_module()


class MaskedTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 8)

    def forward(self, ids, mask):
        ids = ids.view(-1, ids.shape[-1])
        return self.tok(ids) * mask[..., None]


def test_a_mask_of_the_wrong_length_blames_the_product_not_an_older_graphs_view():
    from fxdebug.errors import FxDebugError

    dbg = fxdebug.instrument(MaskedTokens(), [NaNCheck(), StatCollector()],
                             example_inputs=(torch.randint(0, 50, (1, 8)), torch.ones(1, 8)))
    with pytest.raises(FxDebugError) as info:  # Dynamo's fake tensors fail at the product: no new graph to run
        dbg(torch.randint(0, 50, (1, 12)), torch.ones(1, 11))
    assert info.value.node == "mul", str(info.value)
    assert "must match the size" in info.value.message
