"""The five ways an instrumented model used to compute differently from the model, silently.

Each test builds the construct, instruments it with observe-only passes on every frontend that
accepts it, and asserts the instrumented module's outputs, every parameter's gradient and the
buffers after the call are the model's (bitwise, same RNG seed), that the model is untouched by
``instrument()``, or that fxdebug refuses with a typed error naming the module and the line.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fxdebug
from fxdebug.capture.faithful import apply_function, grad_enter, grad_exit
from fxdebug.passes import NaNCheck, StatCollector

FRONTENDS = ("symbolic", "export", "subtrees")


def passes() -> list[fxdebug.Pass]:
    return [NaNCheck(backward=True), StatCollector(grads=True)]


def step(module: nn.Module, x: Tensor, seed: int = 0) -> tuple[Tensor, dict[str, Any]]:
    """One forward and backward from a fixed seed; the output and every parameter's gradient."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = module(x.clone())
    if out.requires_grad:
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), {k: None if p.grad is None else p.grad.clone() for k, p in module.named_parameters()}


def assert_same_step(dbg: nn.Module, ref: nn.Module, x: Tensor, seed: int = 0) -> None:
    out, grads = step(dbg, x, seed)
    out_ref, grads_ref = step(ref, x, seed)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    assert grads.keys() == grads_ref.keys()
    for k, g in grads_ref.items():
        assert (g is None) == (grads[k] is None), f"gradient of {k}: {grads[k] is None} vs model {g is None}"
        if g is not None:
            torch.testing.assert_close(grads[k], g, rtol=0, atol=0, msg=f"gradient of {k}")
    for (k, b), (_, c) in zip(dbg.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, c, rtol=0, atol=0, msg=f"buffer {k}")


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


# -- 1. custom autograd.Function --------------------------------------------------------------------
class WrongSin(torch.autograd.Function):
    """sin forward, a deliberately different backward (like a straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.sin()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g * ctx.scale, None


class SplitGrad(torch.autograd.Function):
    """Two outputs; gradient reversal on the second."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * 2, x + 1

    @staticmethod
    def backward(ctx: Any, ga: Tensor, gb: Tensor) -> Tensor:
        return ga * 2 - gb


class WithFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = WrongSin.apply(self.a(x), 3.0)
        p, q = SplitGrad.apply(self.b(h))
        return p * q


def test_autograd_function_is_one_node_that_calls_the_real_function() -> None:
    model = WithFunctions()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="symbolic")
    calls = [n for n in dbg.graph.nodes if n.target is apply_function]
    assert [n.args[0].rsplit(".", 1)[-1] for n in calls] == ["WrongSin", "SplitGrad"]
    assert "sin" not in {str(n.target) for n in dbg.graph.nodes}, "the Function's forward was traced through"
    assert_same_step(dbg, twin(model), x)
    rows = {r["node"]: r for r in dbg.report().rows}
    assert calls[0].name in rows, "the Function's output is observed"


def test_autograd_function_subtrees_keeps_the_backward() -> None:
    model = WithFunctions()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="subtrees")
    assert_same_step(dbg, twin(model), x)


def test_export_refuses_an_autograd_function_it_would_inline() -> None:
    model = WithFunctions()
    with pytest.raises(fxdebug.TraceError, match="WrongSin.*inlines its forward") as info:
        fxdebug.instrument(model, passes(), example_inputs=(torch.randn(3, 4),), frontend="export")
    assert "test_faithful.py" in info.value.message  # names the line


# -- 2. grad-mode and autocast regions --------------------------------------------------------------
class Regions(nn.Module):
    """An EMA-teacher-like target under no_grad, a set_grad_enabled region and an enable_grad one."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(4, 4)
        self.teacher = nn.Linear(4, 4)
        self.side = nn.Linear(4, 4)
        self.probe = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        with torch.set_grad_enabled(False):
            side = self.side(x)
        with torch.enable_grad():
            probed = self.probe(x)
        return self.student(x) * target + side + probed


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_no_grad_regions_keep_gradients_off(frontend: str) -> None:
    model = Regions()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend=frontend)
    assert_same_step(dbg, twin(model), x)
    assert model.teacher.weight.grad is None and model.side.weight.grad is None
    assert model.student.weight.grad is not None


def test_grad_regions_restore_the_mode_of_the_call_not_of_the_trace() -> None:
    """Under an outer no_grad, enable_grad inside forward must end back in no_grad, as eager does."""
    model = Regions()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="symbolic")
    targets = [n.target for n in dbg.graph.nodes if n.target in (grad_enter, grad_exit)]
    assert targets == [grad_enter, grad_exit] * 3
    with torch.no_grad():
        want = model(x)
        got = dbg(x)
    assert got.requires_grad == want.requires_grad
    assert torch.is_grad_enabled()


class NoGradMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    @torch.no_grad()
    def target(self, x: Tensor) -> Tensor:
        return self.b(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) + self.target(x)


def test_no_grad_decorator_on_a_helper() -> None:
    model = NoGradMethod()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="symbolic")
    assert_same_step(dbg, twin(model), x)
    assert model.b.weight.grad is None


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
        return self.b(h.float()) + h.float()


@pytest.mark.parametrize("frontend", ("symbolic", "subtrees"))
def test_autocast_region_runs_in_low_precision(frontend: str) -> None:
    model = Autocast()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend=frontend)
    assert_same_step(dbg, twin(model), x)


# -- 3. training-flag branches ------------------------------------------------------------------------
class ModeBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.bn(self.a(x))
        if self.training:
            h = h + 0.5 * h.pow(2)
        return F.dropout(h, 0.5, training=self.training)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_training_flag_after_instrumenting_in_eval(frontend: str) -> None:
    model = ModeBranches().eval()
    x = torch.randn(6, 8)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend=frontend)
    ref = twin(model)
    dbg.train()
    ref.train()
    assert_same_step(dbg, ref, x, seed=1)
    assert_same_step(dbg, ref, x, seed=2)  # running statistics advanced alike
    dbg.eval()
    ref.eval()
    assert_same_step(dbg, ref, x, seed=3)
    notes = " ".join(dbg.report().notes) if frontend != "subtrees" else ""
    if frontend == "symbolic":
        assert "depends on the training flag" in notes


def test_mode_switch_through_the_model_is_seen() -> None:
    """model.train() flips the shared submodules: the instrumented module notices that too."""
    model = ModeBranches().eval()
    x = torch.randn(6, 8)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="export")
    ref = twin(model).train()
    dbg.train()
    assert_same_step(dbg, ref, x, seed=4)
    assert any(str(getattr(n.target, "__name__", n.target)).startswith("dropout") or "dropout" in str(n.target)
               for n in dbg.graph.nodes)


# -- 4. state writes in forward ----------------------------------------------------------------------
class EMA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        self.avg = 0.9 * self.avg + 0.1 * x.mean(0).detach()
        return self.a(x) + self.avg


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ema = EMA()
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.ema(x)))


def test_root_buffer_reassignment_is_refused_and_the_model_untouched() -> None:
    model = EMA()
    buf = model.avg
    with pytest.raises(fxdebug.TraceError, match=r"assigns self\.avg") as info:
        fxdebug.instrument(model, passes(), frontend="symbolic")
    assert "test_faithful.py" in info.value.message and "self.avg = 0.9" in info.value.message
    assert model.avg is buf and isinstance(model._buffers["avg"], Tensor)


def test_root_buffer_reassignment_auto_is_exported_and_updates_the_buffer() -> None:
    model = EMA()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,))
    assert dbg.trace_info.frontend in ("export", "dynamo")  # the snapshot chain exports it; or the live default
    assert torch.equal(model.avg, torch.zeros(4)), "instrument() updated the model's buffer"
    ref = twin(model)
    assert_same_step(dbg, ref, x)
    assert_same_step(dbg, ref, x)
    assert torch.equal(model.avg, ref.avg) and model.avg.abs().sum() > 0


def test_submodule_state_update_becomes_a_reported_leaf() -> None:
    model = Outer()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="symbolic")
    leaf = dbg.trace_info.auto_leaves["ema"]
    assert "self.avg" in leaf.reason and "self.avg = 0.9" in (leaf.location or "")
    ref = twin(model)
    for _ in range(2):
        assert_same_step(dbg, ref, x)
    with pytest.raises(fxdebug.TraceError, match="'ema'"):
        fxdebug.instrument(model, passes(), frontend="symbolic", auto_leaf=False)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.a(x)


def test_python_counter_at_the_root_keeps_counting() -> None:
    model = Counter()
    x = torch.randn(2, 4)
    with pytest.raises(fxdebug.TraceError, match=r"self\.calls"):
        fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="export")
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,))
    assert dbg.trace_info.frontend in ("subtrees", "dynamo")  # the snapshot chain's root stays eager; or live
    assert model.calls == 0, "instrument()'s example runs advanced the model's counter"
    dbg(x)
    dbg(x)
    assert model.calls == 2


# -- 5. hooks ------------------------------------------------------------------------------------------
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_root_hooks_run_at_every_call(frontend: str) -> None:
    model = Small()
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model.register_forward_hook(lambda m, args, out: seen.append(1) or out + 1)
    x = torch.randn(3, 4)
    ref = twin(model)  # hooks are copied with it
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend=frontend)
    seen.clear()
    assert_same_step(dbg, ref, x)
    assert len(seen) == 2  # once for dbg, once for the copy (its hook closes over the same list)


def test_hooks_on_inner_modules_run_at_every_call() -> None:
    model = Small()
    features: list[Tensor] = []
    model.b.register_forward_hook(lambda m, args, out: features.append(out))
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="symbolic")
    assert "hooks" in dbg.trace_info.auto_leaves["b"].reason
    features.clear()
    dbg(x)
    dbg(x)
    assert len(features) == 2 and all(type(f) is Tensor for f in features)
    torch.testing.assert_close(features[0], model(x), rtol=0, atol=0)
    with pytest.raises(fxdebug.TraceError, match="'b'.*hooks"):
        fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="export")


class Flagged(nn.Module):
    """Forward branches on plain attributes a user may change (``model.double = True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.double = False
        self.scale = 2.0

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return h * self.scale if self.double else h


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_attribute_the_forward_branches_on(frontend: str) -> None:
    model = Flagged()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend=frontend)
    if frontend != "subtrees":
        assert ("", "double", False) in dbg.trace_info.guards
    model.double = True
    assert_same_step(dbg, twin(model), x)
    model.scale = 3.0
    assert_same_step(dbg, twin(model), x)
    if frontend != "subtrees":
        assert any("attributes changed: scale" in n for n in dbg.report().notes)
    model.double = False
    assert_same_step(dbg, twin(model), x)


def test_autocast_region_export() -> None:
    model = Autocast()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="export")
    assert_same_step(dbg, twin(model), x)


def test_export_refuses_a_submodule_buffer_update_it_loses() -> None:
    """torch 2.13's non-strict export writes back only the root's reassigned buffers."""
    model = Outer()
    with pytest.raises(fxdebug.TraceError, match=r"reassigns the buffer ema\.avg") as info:
        fxdebug.instrument(model, passes(), example_inputs=(torch.randn(3, 4),), frontend="export")
    assert info.value.module == "ema" and "test_faithful.py" in info.value.message
    assert torch.equal(model.ema.avg, torch.zeros(4))


@pytest.mark.parametrize("frontend", ("auto", "subtrees"))
def test_buffer_reassignment_in_a_submodule(frontend: str) -> None:
    model = Outer()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend=frontend)
    assert torch.equal(model.ema.avg, torch.zeros(4))
    ref = twin(model)
    for _ in range(2):
        assert_same_step(dbg, ref, x)
    assert torch.equal(model.ema.avg, ref.ema.avg) and model.ema.avg.abs().sum() > 0


def test_root_buffer_reassignment_subtrees() -> None:
    model = EMA()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="subtrees")
    ref = twin(model)
    assert_same_step(dbg, ref, x)
    assert torch.equal(model.avg, ref.avg) and model.avg.abs().sum() > 0


def test_hooks_on_inner_modules_subtrees() -> None:
    model = Small()
    features: list[Tensor] = []
    model.b.register_forward_hook(lambda m, args, out: features.append(out))
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="subtrees")
    features.clear()
    dbg(x)
    assert len(features) == 1 and type(features[0]) is Tensor
    torch.testing.assert_close(features[0], model(x), rtol=0, atol=0)


class Inference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        with torch.inference_mode():
            t = self.b(x)
        return self.a(x) * t.clone()


def test_inference_mode_region_symbolic() -> None:
    model = Inference()
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="symbolic")
    assert_same_step(dbg, twin(model), x)
    assert model.b.weight.grad is None and model.a.weight.grad is not None



def test_a_graph_that_does_not_depend_on_the_mode_is_kept_with_its_statistics() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.ReLU()).eval()
    x = torch.randn(3, 4)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="symbolic")
    graph = dbg.graph
    dbg(x)
    dbg.train()
    ref = twin(model).train()
    assert_same_step(dbg, ref, x, seed=5)  # dropout (a module) runs in training mode
    assert dbg.graph is graph and dbg.report().calls == 2
    assert any("one graph and its statistics serve both" in n for n in dbg.report().notes)


def test_a_loaded_export_capture_refuses_other_modes() -> None:
    """Unpickled, the module no longer knows its model: it refuses instead of running eval ops in training."""
    import io

    model = ModeBranches().eval()
    x = torch.randn(6, 8)
    dbg = fxdebug.instrument(model, passes(), example_inputs=(x,), frontend="export")
    buf = io.BytesIO()
    torch.save(dbg, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    loaded.train()
    with pytest.raises(fxdebug.TraceError, match="baked into its ops"):
        loaded(x)
    loaded.eval()
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
