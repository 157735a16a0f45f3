"""Dynamo -> fxdebug's passes -> Inductor (issue 32 item 4): ``instrument(..., backend="inductor")`` and an outer
``torch.compile(dbg, ...)`` compile the instrumented graphs of a live capture with Inductor (the user's options
honoured), with every row filled and outputs equal to the compiled plain model's within Inductor's tolerance."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.errors import UsageError
from fxdebug.passes import NaNCheck, StatCollector


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Block().eval()


@pytest.fixture
def inductor_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Counts Inductor's compiles (with the options each was given) and the calls of the code it generated."""
    import torch._inductor.compile_fx as compile_fx_module

    seen: dict[str, Any] = {"compiles": 0, "runs": 0, "options": [], "depth": 0}
    real = compile_fx_module.compile_fx

    def compile_fx(gm: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        outer = seen["depth"] == 0  # compile_fx calls itself once more with the options applied
        if kwargs.get("config_patches"):
            seen["options"].append(dict(kwargs["config_patches"]))
        seen["compiles"] += outer
        seen["depth"] += 1
        try:
            fn = real(gm, inputs, *args, **kwargs)
        finally:
            seen["depth"] -= 1

        def generated(*call: Any) -> Any:
            seen["runs"] += 1
            return fn(*call)

        return generated if outer else fn

    monkeypatch.setattr(compile_fx_module, "compile_fx", compile_fx)
    return seen


def _rows(dbg: Any) -> dict[str, dict[str, Any]]:
    return {row["node"]: row for row in dbg.report().rows}


def test_backend_inductor_compiles_the_instrumented_graph(inductor_calls: dict[str, Any]) -> None:
    model, x = _model(), torch.randn(4, 8)
    dbg = fxdebug.instrument(model, [StatCollector(), NaNCheck()], example_inputs=(x,), backend="inductor")
    assert inductor_calls["compiles"] == 0  # instrument() only captures; the first call compiles
    with torch.no_grad():
        outs = [dbg(x) for _ in range(3)]
    assert inductor_calls["compiles"] >= 1 and inductor_calls["runs"] >= 3  # Inductor's code ran at every call
    with torch.no_grad():
        expected = torch.compile(model)(x)
    for out in outs:
        torch.testing.assert_close(out, expected)
    rows = _rows(dbg)
    assert rows and all(row["calls"] == 3 for row in rows.values())
    with torch.no_grad():
        hidden = torch.relu(model.fc1(x))
    relu = next(row for row in rows.values() if row.get("op") == "relu" or row["node"].endswith("relu"))
    assert relu["mean"] == pytest.approx(float(hidden.double().mean()), rel=1e-4)
    notes = dbg.report().notes
    assert any(n.startswith("backend: inductor compiled") for n in notes), notes


def test_outer_torch_compile_compiles_with_the_users_options(inductor_calls: dict[str, Any]) -> None:
    model, x = _model(), torch.randn(4, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))  # the eager (debugging) default
    compiled = torch.compile(dbg, options={"epilogue_fusion": False})
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        outs = [compiled(x) for _ in range(3)]
    assert not torch._dynamo.utils.counters["graph_break"]  # the outer compile enters the live call, no break
    assert inductor_calls["runs"] >= 3, inductor_calls  # not run eagerly: Inductor's code ran at every call
    assert {"epilogue_fusion": False}.items() <= inductor_calls["options"][0].items()  # the user's options honoured
    with torch.no_grad():
        expected = torch.compile(model)(x)
    for out in outs:
        torch.testing.assert_close(out, expected)
    rows = _rows(dbg)
    assert rows and all(row["calls"] == 3 for row in rows.values())
    notes = dbg.report().notes
    assert any("inductor (epilogue_fusion=False) compiled" in n for n in notes), notes
    compiles = inductor_calls["compiles"]
    with torch.no_grad():  # another torch.compile with the same options: the same backend, nothing compiled again
        torch.compile(dbg, options={"epilogue_fusion": False})(x)
    assert inductor_calls["compiles"] == compiles and len(dbg.parts()) == 2  # the eager capture and the compiled one
    with torch.no_grad():  # the live module without the outer compile: eager again, the same rows go on counting
        torch.testing.assert_close(dbg(x), model(x), rtol=0, atol=0)
    assert all(row["calls"] == 5 for row in _rows(dbg).values())


def test_backward_through_the_compiled_instrumented_model(inductor_calls: dict[str, Any]) -> None:
    model, x = _model().train(), torch.randn(4, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,))
    compiled = torch.compile(dbg)
    compiled(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert inductor_calls["runs"] >= 1
    model.zero_grad()
    model(x).square().sum().backward()
    for got, param in zip(grads, model.parameters()):
        torch.testing.assert_close(got, param.grad)
    assert all(row["calls"] == 1 for row in _rows(dbg).values())


def test_backend_is_checked() -> None:
    model = _model()
    with pytest.raises(UsageError, match="'eager', 'inductor'"):
        fxdebug.instrument(model, [StatCollector()], backend="cudagraphs")
    with pytest.raises(UsageError, match="live"):
        fxdebug.instrument(model, [StatCollector()], frontend="symbolic", backend="inductor")
    eager = fxdebug.instrument(model, [StatCollector()], example_inputs=(torch.randn(2, 8),))
    eager(torch.randn(2, 8))
    assert any(n.startswith("backend: eager") for n in eager.report().notes)


def test_more_passes_on_a_compiled_live_module_stay_compiled() -> None:
    model, x = _model(), torch.randn(4, 8)
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), backend="inductor")
    more = fxdebug.instrument(dbg, [NaNCheck()], example_inputs=(x,))
    assert more._live_state.backend == "inductor"
    assert fxdebug.instrument(dbg, [NaNCheck()], backend="eager")._live_state.backend == "eager"
