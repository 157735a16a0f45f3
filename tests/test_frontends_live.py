"""The explicit frontends (symbolic, export, subtrees) follow the live model, or refuse clearly.

Issue 23, part B: each test builds a construct a real workflow meets after ``instrument()`` (a
checkpoint loaded, a buffer counter, a hook, a replaced head, ``model.train()``, another keyword
signature) and asserts the instrumented module computes what the model computes at that moment,
or raises a typed fxdebug error naming the construct. ``instrument()`` itself leaves no trace on
the user's global state.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import fxdebug
from fxdebug.errors import FxDebugError, TraceError
from fxdebug.passes import NaNCheck, StatCollector

FRONTENDS = ("symbolic", "export", "subtrees")


def passes() -> list[fxdebug.Pass]:
    return [NaNCheck(), StatCollector()]


# -- 1. instrument() never touches the user's global state ------------------------------------------
class Drawing(nn.Module):
    """Draws from every random stream a forward can reach and appends to its own containers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gen = torch.Generator().manual_seed(3)
        self.np_gen = np.random.default_rng(5)
        self.seen: list[int] = []
        self.by_call: dict[int, float] = {}

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(len(self.seen))
        self.by_call[len(self.by_call)] = random.random() + float(np.random.rand()) + float(self.np_gen.random())
        noise = torch.rand(x.shape, generator=self.gen) if not torch.fx._symbolic_trace.is_fx_tracing() else 0
        return self.fc(x) + noise + torch.rand(x.shape)


def _streams(model: Drawing) -> tuple[Any, ...]:
    return (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone(),
            model.gen.get_state().clone(), model.np_gen.bit_generator.state)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_instrument_leaves_every_random_stream_and_container_as_it_was(frontend: str) -> None:
    model = Drawing()
    x = torch.randn(2, 4)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    before = _streams(model)
    try:
        fxdebug.instrument(model, passes(), x, frontend=frontend)
    except TraceError:
        pass  # a frontend may refuse the construct; it must still leave no trace
    after = _streams(model)
    assert after[0] == before[0], "Python's random stream moved"
    assert (after[1] == before[1]).all(), "numpy's global stream moved"
    assert torch.equal(after[2], before[2]), "torch's global stream moved"
    assert torch.equal(after[3], before[3]), "the model's torch.Generator moved"
    assert after[4] == before[4], "the model's numpy Generator moved"
    assert model.seen == [] and model.by_call == {}, "instrument() appended to the model's containers"


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_instrument_does_not_materialize_a_lazy_module(frontend: str) -> None:
    model = nn.Sequential(nn.LazyLinear(3), nn.ReLU())
    with pytest.raises(TraceError, match=r"'0' \(LazyLinear\).*lazy module.*Run the model once"):
        fxdebug.instrument(model, passes(), torch.randn(2, 4), frontend=frontend)
    assert isinstance(model[0], nn.LazyLinear), "instrument() materialized the lazy module on the model"
    model(torch.randn(2, 4))  # once run, it instruments like any module
    dbg = fxdebug.instrument(model, passes(), torch.randn(2, 4), frontend=frontend)
    x = torch.randn(2, 4)
    assert torch.equal(dbg(x), model(x))


# -- 2. symbolic: buffers are inputs, not constants -------------------------------------------------
class FrozenBN(nn.Module):
    """torchvision's FrozenBatchNorm2d: arithmetic over buffers in forward."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(n))
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def forward(self, x: Tensor) -> Tensor:
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale + bias


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = FrozenBN()

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.fc(x))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        self.step.add_(1)
        return self.fc(x) * self.step


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("make", [Backbone, FrozenBN], ids=["submodule", "root"])
def test_arithmetic_over_buffers_follows_load_state_dict(frontend: str, make: Any) -> None:
    model = make()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
    torch.manual_seed(1)
    model.load_state_dict({k: torch.rand_like(v) + 0.5 for k, v in model.state_dict().items()})
    torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_buffer_counter_counts_every_call(frontend: str) -> None:
    model = Counter()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
    assert model.step.item() == 0, "instrument() advanced the counter"
    outs = [dbg(x) for _ in range(3)]
    assert model.step.item() == 3
    base = model.fc(x).detach()
    for i, out in enumerate(outs, start=1):
        torch.testing.assert_close(out, base * i, rtol=0, atol=0)


# -- 2. symbolic: full backward hooks and call signatures -------------------------------------------
class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.fc(x) * y


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.inner(x, x))


def _triple(module: nn.Module, grad_in: Any, grad_out: Any) -> Any:
    return tuple(None if g is None else g * 3 for g in grad_in)


def _grads(module: nn.Module, x: Tensor) -> list[Tensor]:
    x = x.clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    module(x).sum().backward()
    assert x.grad is not None
    return [x.grad.clone(), *(p.grad.clone() for p in module.parameters() if p.grad is not None)]


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("where", ["root", "inner"])
def test_full_backward_hook_keeps_its_semantics_or_is_refused(frontend: str, when: str, where: str) -> None:
    model = Outer()
    target = model if where == "root" else model.inner
    x = torch.randn(2, 4)
    if when == "before":
        target.register_full_backward_hook(_triple)
    try:
        dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
        if when == "after":
            target.register_full_backward_hook(_triple)
        got = _grads(dbg, x)
    except TraceError as exc:  # refused: the message names the module and the hook
        assert where == "inner" and frontend != "subtrees", f"refused a case that can be kept: {exc}"
        assert "'inner'" in str(exc) and "hook" in str(exc)
        return
    want = _grads(model, x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Labelled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor, labels: Tensor | None = None, scale: float | None = None) -> Tensor:
        y = self.fc(x)
        if scale is not None:
            y = y * scale
        if labels is not None:
            return (y - labels).pow(2).mean()
        return y


@pytest.mark.parametrize("extra", [{"labels": torch.zeros(2, 4)}, {"scale": 2.0}], ids=["labels", "scale"])
def test_symbolic_call_with_a_pinned_argument_is_refused_with_a_trace_error(extra: dict[str, Any]) -> None:
    model = Labelled()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend="symbolic")
    name = next(iter(extra))
    with pytest.raises(TraceError, match=rf"called with {name}=.*pinned to None.*Inputs\(x, {name}=") as info:
        dbg(x, **extra)
    assert info.value.op == f"{name}="
    torch.testing.assert_close(dbg(x, labels=None), model(x), rtol=0, atol=0)  # the traced signature still runs
    both = fxdebug.instrument(model, passes(), fxdebug.Inputs(x, **extra), frontend="symbolic")
    torch.testing.assert_close(both(x, **extra), model(x, **extra), rtol=0, atol=0)


# -- 5. model-level changes after instrument ---------------------------------------------------------
class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.bn(self.drop(self.fc(x)))
        if self.training:
            y = y * 2
        return y


def _seeded(module: nn.Module, x: Tensor) -> Tensor:
    torch.manual_seed(0)
    return module(x)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_model_train_on_the_model_is_followed(frontend: str) -> None:
    model = Head().eval()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
    twin = Head()
    twin.load_state_dict(model.state_dict())
    model.train()  # on the model, not on dbg
    twin.train()
    torch.testing.assert_close(_seeded(dbg, x), _seeded(twin, x), rtol=0, atol=0)
    torch.testing.assert_close(model.bn.running_mean, twin.bn.running_mean, rtol=0, atol=0)
    model.eval()
    twin.eval()
    torch.testing.assert_close(_seeded(dbg, x), _seeded(twin, x), rtol=0, atol=0)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_replaced_submodule_is_never_a_stale_answer(frontend: str) -> None:
    model = Head().eval()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
    model.fc = nn.Linear(4, 4)
    with pytest.raises(TraceError, match=r"submodule 'fc' of Head was replaced.*Instrument the model again") as info:
        dbg(x)
    assert info.value.module == "fc"
    again = fxdebug.instrument(model, passes(), x, frontend=frontend)
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_a_hook_added_on_an_inlined_module_is_refused_not_dropped(frontend: str) -> None:
    model = Outer()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
    handle = model.inner.register_forward_hook(lambda m, i, o: o * 5)
    with pytest.raises(TraceError, match=r"hook.*registered on 'inner' \(Inner\).*never run"):
        dbg(x)
    handle.remove()
    torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)
    model.out.register_forward_hook(lambda m, i, o: o * 5)  # a module the graph calls as a module
    if frontend == "symbolic":
        torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)
    else:
        with pytest.raises(TraceError, match="'out'"):
            dbg(x)


def test_a_global_module_hook_added_later_is_refused() -> None:
    model = Outer()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend="symbolic")
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        with pytest.raises(TraceError, match="global module hook"):
            dbg(x)
    finally:
        handle.remove()
    torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)


# -- 3. subtrees: parametrizations, a child named like fxdebug's namespace ---------------------------
class Symmetric(nn.Module):
    def forward(self, w: Tensor) -> Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_parametrized_weight_is_followed(frontend: str) -> None:
    from torch.nn.utils import parametrize

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
    torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)
    with torch.no_grad():
        model[0].parametrizations.weight.original.mul_(2)
    torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)


class NamedLikeUs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fxdebug = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.fxdebug(x))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_child_named_fxdebug_is_kept_or_refused_and_never_written_into(frontend: str) -> None:
    model = NamedLikeUs()
    x = torch.randn(2, 4)
    try:
        dbg = fxdebug.instrument(model, passes(), x, frontend=frontend)
    except TraceError as exc:
        assert frontend != "subtrees" and "attribute 'fxdebug'" in str(exc) and exc.module == "fxdebug"
    else:
        torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)
        assert dbg.report().rows
    assert list(model.fxdebug._modules) == [], "fxdebug's modules were written into the user's child"


# -- 4. export: torch's range guards are kept; tensor hooks it would drop are refused -----------------
class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[1] > 8:
            return self.fc(x) * 2
        return self.fc(x)


def test_export_keeps_the_range_guard_of_a_shape_branch() -> None:
    model = Branchy()
    dbg = fxdebug.instrument(model, passes(), torch.randn(2, 5, 4), frontend="export")
    short = torch.randn(2, 7, 4)
    torch.testing.assert_close(dbg(short), model(short), rtol=0, atol=0)  # a size the captured branch covers
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"size 12 in dimension 1.*at most 8.*branches on this size"):
        dbg(torch.randn(2, 12, 4))


class Reversal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        if y.requires_grad:  # gradient reversal, as domain-adaptation models write it
            y.register_hook(lambda g: -g)
        return y * 2


def test_export_refuses_a_tensor_hook_registered_in_forward() -> None:
    with pytest.raises(TraceError, match=r"registers a tensor hook \(Tensor.register_hook\).*drops it") as info:
        fxdebug.instrument(Reversal(), passes(), torch.randn(2, 4), frontend="export")
    assert info.value.op == "Tensor.register_hook"


def test_a_tensor_hook_registered_in_forward_runs_at_every_call_or_is_refused() -> None:
    model = Reversal()
    x = torch.randn(2, 4)
    with pytest.raises(TraceError, match="requires_grad"):  # symbolic: refused (it branches on requires_grad)
        fxdebug.instrument(model, passes(), x, frontend="symbolic")
    dbg = fxdebug.instrument(nn.Sequential(model), passes(), x, frontend="subtrees")  # the hooking module stays eager
    assert _grads(dbg, x)[0].equal(_grads(model, x)[0])
    dbg = fxdebug.instrument(model, passes(), x, frontend="subtrees")
    assert _grads(dbg, x)[0].equal(_grads(model, x)[0])


# -- 3. subtrees: the parts are the model's own module objects -----------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: Tensor) -> Tensor:
        y = self.drop(self.bn(x @ self.w))
        if self.training:
            y = y + 1
        return y


class Looping(nn.Module):
    """A root neither FX nor export captures (a Python loop over the batch): subtrees keeps it eager."""

    def __init__(self) -> None:
        super().__init__()
        self.b1 = Block()
        self.b2 = Block()

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.b2(self.b1(x[i:i + 1].repeat(2, 1))) for i in range(x.shape[0])])


def _same_seeded(a: nn.Module, b: nn.Module, x: Tensor) -> None:
    torch.manual_seed(0)
    got = a(x)
    torch.manual_seed(0)
    torch.testing.assert_close(got, b(x), rtol=0, atol=0)


def test_subtrees_parts_are_the_models_own_modules() -> None:
    import copy

    model = Looping().eval()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend="subtrees")
    assert set(dbg.parts()) == {"b1", "b2"}
    assert sum(isinstance(m, Block) for m in dbg.modules()) == 2  # an isinstance loop finds them
    assert dbg.get_submodule("b1") is model.b1
    twin = copy.deepcopy(model)
    model.train()  # reaches the parts: batch-norm statistics and dropout follow
    twin.train()
    _same_seeded(dbg, twin, x)
    torch.testing.assert_close(model.b1.bn.running_mean, twin.b1.bn.running_mean, rtol=0, atol=0)
    for m in dbg.modules():  # the usual freeze-the-blocks loop, through the instrumented module
        if isinstance(m, Block):
            m.eval()
    twin.b1.eval()
    twin.b2.eval()
    _same_seeded(dbg, twin, x)
    assert dbg.report().rows
    assert "forward" not in model.b1.__dict__, "the routing must not stay on the model's module"


def test_subtrees_with_a_parametrized_part_and_root() -> None:
    from torch.nn.utils import parametrize

    model = Looping().eval()
    parametrize.register_parametrization(model.b1, "w", Symmetric())
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), x, frontend="subtrees")
    torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)
    with torch.no_grad():
        model.b1.parametrizations.w.original.mul_(2)
    torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)
    scaled = Scaled().eval()  # a parametrization on the eager root itself
    parametrize.register_parametrization(scaled, "scale", Doubled())
    dbg = fxdebug.instrument(scaled, passes(), x, frontend="subtrees")
    torch.testing.assert_close(dbg(x), scaled(x), rtol=0, atol=0)


class Doubled(nn.Module):
    def forward(self, s: Tensor) -> Tensor:
        return s * 2


class Scaled(Looping):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * self.scale
