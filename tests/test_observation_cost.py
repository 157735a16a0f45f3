"""What observation costs per call (issue 32, "Numbers"): the compiled instrumented graph is handed to the
compiler without a second Dynamo frame, and debugging-size tensors share one extern call per run, with the
same rows and outputs as before. (Timings are in tools/bench_compile.py and docs/performance.md, not here.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from fxdebug.runtime import lower


class _MLP(nn.Module):
    """Tensors of 2x16x256 = 8192 elements (a tiny GPT-2's MLP at batch 2, 16 tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + self.down(h)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _MLP().eval()


def _x() -> torch.Tensor:
    return torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))


def _ops(dbg: Any) -> tuple[int, int, list[int]]:
    """(single observe calls, batched calls, elements each batch holds) over the captured graphs."""
    one, many = torch.ops.fxdebug.observe.default, torch.ops.fxdebug.observe_many.default
    singles = batches = 0
    held = []
    for part in dbg.parts().values():
        for n in part.graph.nodes:
            if n.op == "call_function" and n.target is one:
                singles += 1
            elif n.op == "call_function" and n.target is many:
                batches += 1
                held.append(sum(x.meta["fxdebug"]["shape"].numel() if hasattr(x.meta["fxdebug"]["shape"], "numel")
                                else _numel(x.meta["fxdebug"]["shape"]) for x in n.args[0]))
    return singles, batches, held


def _numel(shape: Any) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _rows(dbg: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in dbg.report().rows]


def test_debugging_size_tensors_share_one_call_per_run() -> None:
    x = _x()
    dbg = fxdebug.instrument(_model(), [NaNCheck(), StatCollector()], example_inputs=(x,))
    dbg(x)
    singles, batches, held = _ops(dbg)
    assert singles == 0 and batches >= 1  # 8192-element tensors waited for a batch (they were one call each)
    assert all(h <= lower.BATCH_TOTAL for h in held)


def test_a_batch_keeps_at_most_batch_total_elements_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lower, "BATCH_TOTAL", 3 * 8192)
    x = _x()
    dbg = fxdebug.instrument(_model(), [NaNCheck(), StatCollector()], example_inputs=(x,))
    dbg(x)
    _, batches, held = _ops(dbg)
    assert batches >= 2 and max(held) <= 3 * 8192


def test_batching_changes_neither_outputs_nor_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _x()
    model = _model()
    with torch.no_grad():
        plain = model(x)
    batched = fxdebug.instrument(_model(), [NaNCheck(), StatCollector()], example_inputs=(x,))
    monkeypatch.setattr(lower, "BATCH_NUMEL", 0)  # nothing waits: one call per node, as for large tensors
    single = fxdebug.instrument(_model(), [NaNCheck(), StatCollector()], example_inputs=(x,))
    assert _ops(single)[1] == 0 and _ops(batched)[0] == 0
    with torch.no_grad():
        outs = [batched(x), single(x), batched(x), single(x)]
    for out in outs:
        assert torch.equal(out, plain)
    assert _rows(batched) == _rows(single) and len(_rows(batched)) > 5


def test_compiled_instrumented_model_compiles_no_dynamo_frame_beyond_the_models() -> None:
    x = _x()
    model = _model()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        expected = torch.compile(model)(x)
    plain_graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    dbg = fxdebug.instrument(_model(), [NaNCheck(), StatCollector()], example_inputs=(x,))
    compiled = torch.compile(dbg)
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        outs = [compiled(x) for _ in range(3)]
    # the model's frame is Dynamo's one graph; the instrumented copy went to Inductor directly (it was a
    # second Dynamo frame, whose guards re-checked every parameter on every call)
    assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == plain_graphs
    for out in outs:
        torch.testing.assert_close(out, expected)
    rows = dbg.report().rows
    assert rows and all(r.get("calls", 3) == 3 for r in rows if "calls" in r)
    assert any("inductor" in n for n in dbg.report().notes if n.startswith("backend:"))


def test_compiled_backward_through_the_direct_graph_observes_gradients() -> None:
    x = _x().requires_grad_()
    dbg = fxdebug.instrument(_model().train(), [NaNCheck(backward=True), StatCollector(grads=True)],
                             example_inputs=(x.detach(),))
    compiled = torch.compile(dbg)
    reference = _model().train()
    for _ in range(2):
        compiled(x).square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    torch.compile(reference)(xr).square().sum().backward()
    rows = dbg.report().rows
    assert any(r.get("phase") == "grad" or "grad_mean" in r or any(k.startswith("grad") for k in r) for r in rows)
    up = dict(dbg.model.named_parameters())["up.weight"]
    torch.testing.assert_close(up.grad / 2, dict(reference.named_parameters())["up.weight"].grad)


def test_reset_between_compiled_calls_counts_afresh() -> None:
    x = _x()
    dbg = fxdebug.instrument(_model(), [NaNCheck(), StatCollector()], example_inputs=(x,))
    compiled = torch.compile(dbg)
    with torch.no_grad():
        compiled(x)
        compiled(x)
        dbg.reset()  # a fresh state table: the directly compiled graph takes it as its input
        out = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(out, torch.compile(_model())(x))
    counted = [r["calls"] for r in dbg.report().rows if "calls" in r]
    assert counted and all(c == 1 for c in counted)
