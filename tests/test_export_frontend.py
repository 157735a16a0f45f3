"""The torch.export frontend on models whose root forward FX cannot trace."""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector


@dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)) + x)


class ItemAssignment(nn.Module):
    """Writes into a traced tensor: ``y[:, 0] = 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        y[:, 0] = 0.0
        return self.head(y)


class ListInput(nn.Module):
    """Iterates over a list of tensors given as one argument."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(6, 3)

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return self.head(torch.stack([self.block(x) for x in xs]).sum(0))


class StarArgs(nn.Module):
    """``*args, **kwargs`` signature, reading an optional keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(6, 3)

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        y = self.block(args[0])
        if "scale" in kwargs:
            y = y * kwargs["scale"]
        return self.head(y)


class DataclassOutput(nn.Module):
    """Returns a dataclass, after item assignment (so the root needs export)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> Output:
        h = self.block(x)
        h[:, -1] = 1.0
        return Output(self.head(h), h)


class DictOutput(nn.Module):
    """Keyword inputs, a dict output, a constant made in forward, batch-norm in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.block = Block()

    def forward(self, image: torch.Tensor, extra: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        f = torch.relu(self.bn(self.conv(image))).mean((2, 3))
        for e in extra:
            f = f + e
        f = torch.cat([f, torch.tensor([[0.5, -0.5]]).expand(f.shape[0], 2)], 1)
        return {"out": self.block(f), "feat": f}


CASES: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]] = {
    "item_assignment": lambda: (ItemAssignment(), (torch.randn(4, 6),), {}),
    "list_input": lambda: (ListInput(), ([torch.randn(4, 6), torch.randn(4, 6)],), {}),
    "star_args": lambda: (StarArgs(), (torch.randn(4, 6),), {"scale": torch.tensor(2.0)}),
    "dataclass_output": lambda: (DataclassOutput(), (torch.randn(4, 6),), {}),
    "dict_output": lambda: (DictOutput(), (), {"image": torch.randn(2, 3, 5, 5), "extra": [torch.randn(2, 4)]}),
}


def _leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, Output):
        return [out.logits, out.hidden]
    if isinstance(out, dict):
        return list(out.values())
    return [out]


def _example(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fxdebug.Inputs(*inputs, **kwargs)


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, nn.Module, tuple[Any, ...], dict[str, Any]]:
    model, args, kwargs = CASES[request.param]()
    return request.param, model, args, kwargs


def test_auto_picks_export_and_outputs_are_bitwise_equal(case: Any) -> None:
    name, model, args, kwargs = case
    keys = list(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # the snapshot chain (trace(), and instrument() without the live default) falls through to export ...
    assert fxdebug.trace(model, _example(args, kwargs)).trace_info.frontend == "export"
    # ... and this file is about that frontend's graphs: pinned, whatever instrument()'s "auto" means
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], example_inputs=_example(args, kwargs),
                             frontend="export")
    assert dbg.trace_info.frontend == "export"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "capture changed the model"
    ref, out = model(*args, **kwargs), dbg(*args, **kwargs)
    assert type(out) is type(ref)
    for a, b in zip(_leaves(out), _leaves(ref)):
        assert torch.equal(a, b)
    assert list(dbg.state_dict()) == keys
    own = dict(model.named_parameters())
    assert all(p is own[k] for k, p in dbg.named_parameters())
    report = dbg.report()
    assert report.ok and report.frontend == "export"
    assert {r["module"] for r in report.rows} >= {"block.fc", "block.norm"}


def test_star_args_with_keywords() -> None:
    model = StarArgs()
    x, scale = torch.randn(4, 6), torch.tensor(3.0)
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=fxdebug.Inputs(x, scale=scale))
    assert torch.equal(dbg(x, scale=scale), model(x, scale=scale))


def test_nan_is_located_by_module_path(case: Any) -> None:
    name, model, args, kwargs = case
    dbg = fxdebug.instrument(model, [NaNCheck()], example_inputs=_example(args, kwargs), frontend="export")  # aten rows
    with torch.no_grad():
        model.block.fc.weight[0, 0] = float("nan")
    dbg(*args, **kwargs)
    report = dbg.report()
    assert report[report.first_nonfinite]["module"] == "block.fc"
    assert report[report.first_nonfinite]["op"] == "aten.linear.default"


def test_deepcopy_and_save_keep_the_calling_convention(case: Any) -> None:
    name, model, args, kwargs = case
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=_example(args, kwargs))
    ref = _leaves(model(*args, **kwargs))
    clone = copy.deepcopy(dbg)
    assert clone.block.fc.weight is not model.block.fc.weight
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (clone, loaded):
        for a, b in zip(_leaves(other(*args, **kwargs)), ref):
            assert torch.equal(a, b)


def test_training_mode_batch_norm_updates_the_models_own_buffers() -> None:
    model = DictOutput().train()
    inputs = {"image": torch.randn(2, 3, 5, 5), "extra": [torch.randn(2, 4)]}
    twin = copy.deepcopy(model)
    dbg = fxdebug.trace(model, inputs, frontend="export")
    assert torch.equal(model.bn.running_mean, twin.bn.running_mean), "capture must not run the real model"
    out, ref = dbg(**inputs), twin(**inputs)
    assert torch.equal(out["out"], ref["out"])
    assert torch.equal(model.bn.running_mean, twin.bn.running_mean)
    assert int(model.bn.num_batches_tracked) == 1


def test_aten_ops_are_classified() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(2, 3, 6, 6)
    model(x)
    gm = fxdebug.trace(model.eval(), (x,), frontend="export")
    kinds = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    assert [n for n in kinds.values() if fxdebug.authoring.is_conv(n)][0].target == torch.ops.aten.conv2d.default
    assert any(fxdebug.authoring.is_batchnorm(n) for n in kinds.values())
    assert any(fxdebug.authoring.is_relu(n) for n in kinds.values())
    assert any(fxdebug.authoring.is_linear(n) for n in kinds.values())
    relu = next(n for n in kinds.values() if fxdebug.authoring.is_relu(n))
    assert fxdebug.authoring.module_path(relu) == "2"
    assert fxdebug.authoring.is_inplace(relu) == (relu.target == torch.ops.aten.relu_.default)


def test_dimensions_the_model_allows_vary_and_a_fixed_one_is_named() -> None:
    model = ItemAssignment()
    gm = fxdebug.trace(model, (torch.randn(4, 6),), frontend="export")
    assert any("dynamic dimensions" in n and "x[0]" in n for n in gm.trace_info.notes)
    for batch in (3, 1, 9):  # the batch is free by default (torch.export.Dim.AUTO)
        x = torch.randn(batch, 6)
        assert torch.equal(gm(x), model(x))
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"input 'x' has shape \(3, 5\).*\('\*', 6\)"):
        gm(torch.randn(3, 5))  # the Linear fixes dim 1
    dyn = fxdebug.trace(model, (torch.randn(4, 6),), frontend="export", dynamic_batch=True)
    x = torch.randn(3, 6)
    assert torch.equal(dyn(x), model(x))


def test_missing_example_inputs_are_asked_for_plainly() -> None:
    with pytest.raises(fxdebug.MissingInputsError, match="example inputs.*none were given"):
        fxdebug.trace(ItemAssignment(), frontend="export")
    with pytest.raises(fxdebug.TraceError, match=r"root forward.*none were given: pass example_inputs"):
        fxdebug.trace(ItemAssignment())


def test_symbolic_first_when_it_works() -> None:
    model = Block()
    gm = fxdebug.trace(model, (torch.randn(2, 6),))
    assert gm.trace_info.frontend == "symbolic"
    with pytest.raises(fxdebug.UsageError, match="frontend='nope' is not one of auto, dynamo, symbolic, export, subtrees"):
        fxdebug.trace(model, frontend="nope")


class ShapeBranch(nn.Module):
    """Python that branches on a shape: torch.export must specialise it, so dims cannot stay free."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        y = self.fc(x)
        return y * scale if x.shape[0] % 2 == 0 else -y


def test_a_call_of_another_signature_is_captured_again_once():
    model = ShapeBranch()
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(torch.randn(4, 6),), frontend="export")
    from fxdebug.instrumented.snapshot_cache import other_signatures as captures

    with torch.no_grad():
        for x, kw in [(torch.randn(4, 6), {}), (torch.randn(4, 6), {"scale": 2.0}), (torch.randn(4, 6), {"scale": 2.0})]:
            assert torch.equal(dbg(x, **kw), model(x, **kw))
    assert len(captures(dbg)) == 1  # cached: the second scale=2.0 call reuses it
    assert sum("captured again" in n for n in dbg.trace_info.notes) == 1
