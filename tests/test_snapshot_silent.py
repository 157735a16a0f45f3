"""The snapshot frontends (symbolic, export, subtrees) had silent cases: a graph that ran differently from
the model with no error (issue 34, item 3). Each is now followed (the instrumented call equals the model's)
or refused with a ``TraceError`` naming the construct and what to do."""

from __future__ import annotations

import copy
import io
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch import Tensor, nn

import fxdebug
from fxdebug.passes import NaNCheck

SNAPSHOTS = ["symbolic", "export"]


def _instrument(model: nn.Module, x: Tensor, frontend: str, *more: Tensor) -> nn.Module:
    return fxdebug.instrument(model, [NaNCheck()], example_inputs=(x, *more), frontend=frontend)


class _Config:
    def __init__(self) -> None:
        self.scale = 2.0


class ConfigRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = _Config()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.cfg.scale


@pytest.mark.parametrize("frontend", SNAPSHOTS)
def test_a_config_attribute_changed_after_instrument_is_followed(frontend: str) -> None:
    model, x = ConfigRead().eval(), torch.randn(3, 4)
    dbg = _instrument(model, x, frontend)
    assert torch.equal(dbg(x), model(x))
    model.cfg.scale = 3.0
    assert torch.equal(dbg(x), model(x))
    assert any("cfg.scale" in n for n in dbg.trace_info.notes), dbg.trace_info.notes


class GradBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        return y * 2 if torch.is_grad_enabled() else y - 1


class AutocastBranch(GradBranch):
    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        return y * 2 if torch.is_autocast_enabled("cpu") else y - 1


@pytest.mark.parametrize("frontend", SNAPSHOTS)
def test_a_grad_mode_branch_follows_the_calls_mode(frontend: str) -> None:
    model, x = GradBranch().eval(), torch.randn(3, 4)
    dbg = _instrument(model, x, frontend)
    with torch.no_grad():
        assert torch.equal(dbg(x), model(x))
    assert torch.equal(dbg(x), model(x))


@pytest.mark.parametrize("frontend", SNAPSHOTS)
def test_an_autocast_branch_follows_the_calls_autocast(frontend: str) -> None:
    model, x = AutocastBranch().eval(), torch.randn(3, 4)
    dbg = _instrument(model, x, frontend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(x), dbg(x)
    assert torch.equal(got, want)
    assert torch.equal(dbg(x), model(x))


class Reseeding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        torch.manual_seed(7)
        return F.dropout(self.fc(x), 0.5, training=True)


def test_a_forwards_manual_seed_reseeds_at_every_call_under_symbolic() -> None:
    model, x = Reseeding(), torch.randn(3, 4)
    dbg = _instrument(model, x, "symbolic")
    torch.manual_seed(1)
    got = dbg(x)
    torch.manual_seed(2)
    want = model(x)
    assert torch.equal(got, want)  # both reseeded to 7 inside forward, whatever the stream was
    assert any(n.target.__name__ == "reseed" for n in dbg.graph.nodes if n.op == "call_function")


def test_a_forwards_manual_seed_is_refused_by_export() -> None:
    with pytest.raises(fxdebug.TraceError, match=r"torch\.manual_seed.*frontend='symbolic'"):
        _instrument(Reseeding(), torch.randn(3, 4), "export")


class TensorAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mask = torch.ones(4)  # a plain attribute, not a buffer

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.mask


@pytest.mark.parametrize("frontend", SNAPSHOTS)
def test_a_reassigned_tensor_attribute_is_read_at_every_call(frontend: str) -> None:
    model, x = TensorAttribute(), torch.randn(3, 4)
    dbg = _instrument(model, x, frontend)
    assert torch.equal(dbg(x), model(x))
    model.mask = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert torch.equal(dbg(x), model(x))
    assert "mask" not in dbg.state_dict()
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)  # a loaded module keeps the tensor it was saved with
    assert torch.equal(loaded(x), model(x)) and torch.equal(copy.deepcopy(dbg)(x), model(x))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on enable_nested_tensor
            self.enc = nn.TransformerEncoder(layer, 2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.enc(x, src_key_padding_mask=mask)


def _encoder_inputs() -> tuple[Tensor, Tensor]:
    return torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])


def test_export_refuses_a_call_where_the_model_takes_the_fused_fast_path() -> None:
    model = Encoder().eval()
    x, mask = _encoder_inputs()
    dbg = _instrument(model, x, "export", mask)
    assert torch.equal(dbg(x, mask), model(x, mask))  # gradients wanted: the regular path, as captured
    with torch.no_grad(), pytest.raises(fxdebug.TraceError, match=r"enc\.layers\.0.*fast path.*frontend='auto'"):
        dbg(x, mask)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # torch's own, in eager
@pytest.mark.parametrize("frontend", ["symbolic", "subtrees"])
def test_the_fused_fast_path_is_followed_where_the_module_stays_eager(frontend: str) -> None:
    model = Encoder().eval()
    x, mask = _encoder_inputs()
    dbg = _instrument(model, x, frontend, mask)
    with torch.no_grad():
        assert torch.equal(dbg(x, mask), model(x, mask))
    assert torch.equal(dbg(x, mask), model(x, mask))


class _Symmetric(nn.Module):
    def forward(self, w: Tensor) -> Tensor:
        return (w + w.t()) / 2


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


def test_subtrees_follows_a_parametrization_registered_after_instrument() -> None:
    model, x = TwoLayers(), torch.randn(3, 4)
    dbg = _instrument(model, x, "subtrees")
    parametrize.register_parametrization(model.b, "weight", _Symmetric())
    parametrize.register_parametrization(model.a[0], "weight", _Symmetric())
    assert torch.equal(dbg(x), model(x))
    assert any("changed class after instrument" in n for n in dbg.trace_info.notes), dbg.trace_info.notes


class Hooked(nn.Module):
    """Registers a tensor hook on its activation in every forward (no ``requires_grad`` test)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        y.register_hook(lambda g: self.seen.append(1))
        return y.relu()


class WithHooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Hooked()
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(x))


def test_subtrees_instruments_a_forward_that_registers_a_tensor_hook() -> None:
    model, x = WithHooked(), torch.randn(3, 4)
    dbg = _instrument(model, x, "subtrees")
    out = dbg(x)
    assert torch.equal(out, model(x))
    before = len(model.inner.seen)
    out.sum().backward()
    assert len(model.inner.seen) == before + 1  # the hook ran, at this call
    assert "head" in dbg.parts()


def _qat_model() -> nn.Module:
    class Quantized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = torch.ao.quantization.QuantStub()
            self.fc = nn.Linear(4, 4)
            self.dequant = torch.ao.quantization.DeQuantStub()

        def forward(self, x: Tensor) -> Tensor:
            return self.dequant(self.fc(self.quant(x)))

    model = Quantized().train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices
        torch.ao.quantization.prepare_qat(model, inplace=True)
    return model


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("frontend", ["symbolic", "subtrees"])
def test_a_qat_prepared_model_instruments(frontend: str) -> None:
    model, x = _qat_model(), torch.randn(3, 4)
    dbg = _instrument(model, x, frontend)
    assert torch.equal(dbg(x), model(x))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_qat_prepared_model_is_refused_by_export_naming_its_hooks() -> None:
    with pytest.raises(fxdebug.TraceError, match="quant.*hooks"):
        _instrument(_qat_model(), torch.randn(3, 4), "export")


class _Draws(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * float(np.random.uniform()) + random.random()


class WithDraws(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.noise = _Draws()

    def forward(self, x: Tensor) -> Tensor:
        return self.noise(self.fc(x))


def _same_draws(dbg: nn.Module, model: nn.Module, x: Tensor) -> None:
    for seed in range(3):
        random.seed(seed), np.random.seed(seed)
        want = model(x)
        random.seed(seed), np.random.seed(seed)
        assert torch.equal(dbg(x), want)


@pytest.mark.parametrize("frontend", ["symbolic", "subtrees"])
def test_a_python_or_numpy_draw_runs_at_every_call(frontend: str) -> None:
    model, x = WithDraws(), torch.randn(3, 4)
    dbg = _instrument(model, x, frontend)
    _same_draws(dbg, model, x)
    if frontend == "symbolic":
        assert "noise" in dbg.trace_info.auto_leaves  # the drawing module stays eager


def test_a_draw_in_the_root_forward_is_refused_by_symbolic_and_export() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(fxdebug.TraceError, match=r"draws np\.random\.uniform\(\).*frontend='auto'"):
        _instrument(_Draws(), x, "symbolic")
    with pytest.raises(fxdebug.TraceError, match=r"draws np\.random\.uniform\(\).*frontend='auto'"):
        _instrument(WithDraws(), x, "export")


@pytest.mark.parametrize("frontend", SNAPSHOTS)
def test_a_copy_that_lost_its_model_refuses_other_grad_modes(frontend: str) -> None:
    model, x = GradBranch().eval(), torch.randn(3, 4)
    dbg = _instrument(model, x, frontend)
    with torch.no_grad():
        dbg(x)  # the graph of the no-grad branch is the current one
        twin = copy.deepcopy(dbg)
        assert torch.equal(twin(x), model(x))
    with pytest.raises(fxdebug.TraceError, match=r"torch\.is_grad_enabled\(\) was False"):
        twin(x)
