"""Gradient statistics without a Python hook per node (issue 27, item 3).

A lowered graph watches gradients with ``fxdebug::observe_grad``: one dispatcher call per node in
the forward, which registers a C++ tensor hook whose body is ``fxdebug::observe`` on the gradient.
The backward therefore runs no Python frame for the observation; the rows, the NaN origin in the
backward, the model's outputs and gradients are what the Python hook gave.
"""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from fxdebug.runtime import lower
from fxdebug.runtime.kernel import backend, observe_grad_many_op, observe_grad_op
from fxdebug.runtime.slots import INDEX, K, init_table
from zoo import ZOO

PASSES = (lambda: [NaNCheck(backward=True), StatCollector(grads=True)])
MODELS = ["residual_cnn", "transformer_block", "functional_ops", "inplace_ops", "shared_module", "get_attr_params"]


def _taps(dbg: nn.Module) -> list[torch.fx.Node]:
    return [n for n in dbg.graph.nodes if n.target in (torch.ops.fxdebug.observe_grad.default,
                                                       torch.ops.fxdebug.observe_grad_many.default)]


def _python_calls(fn) -> int:
    """Python frames entered while ``fn`` runs (C functions not counted)."""
    calls = 0

    def prof(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_backward_runs_no_python_per_observed_node():
    model, (x,) = ZOO["residual_cnn"]()
    dbg = fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic")
    assert sum(len(n.args[0]) if isinstance(n.args[0], list) else 1 for n in _taps(dbg)) >= 10
    plain_loss, inst_loss = model(x).sum(), dbg(x).sum()
    plain = _python_calls(plain_loss.backward)
    inst = _python_calls(inst_loss.backward)
    # the Python hook path entered at least one frame per observed node (OpOverload.__call__)
    assert inst == plain, (inst, plain)
    row = dbg.report().row("fc")
    assert row["grad_calls"] == 1 and row["grad_count"] == x.shape[0] * 10


def _with_python_hooks(dbg: nn.Module) -> nn.Module:
    """The same instrumented graph with the previous tap: a Python tensor hook per node."""
    for node in _taps(dbg):
        if node.target is torch.ops.fxdebug.observe_grad_many.default:
            lower.unbatch(dbg, node)
    for node in _taps(dbg):
        node.target = lower.observe_grad
    dbg.recompile()
    return dbg


def _grad_rows(report) -> dict[str, str]:
    """Every row's gradient columns, as text (so NaN equals NaN)."""
    return {r["node"]: repr(sorted((k, v) for k, v in r.items() if k.startswith("grad_"))) for r in report.rows}


@pytest.mark.parametrize("name", MODELS)
def test_rows_outputs_and_gradients_equal_the_python_hook_and_the_plain_model(name):
    model, (x,) = ZOO[name]()
    model.eval()  # no dropout draw, no running-statistics update between the three runs
    x = x.clone().requires_grad_(x.is_floating_point())
    new = fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic")
    old = _with_python_hooks(fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic"))
    assert _taps(new)

    def run(m):
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = m(x)
        flat = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        sum((t.float() * (i + 1)).sum() for i, t in enumerate(flat)).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return flat, grads, (x.grad.clone() if x.grad is not None else None)

    for _ in range(2):
        ref, ours, before = run(model), run(new), run(old)
    for a, b in zip(ref[0] + ref[1], ours[0] + ours[1]):
        assert torch.equal(a, b)  # bitwise: the tap changes no value
    assert (ref[2] is None and ours[2] is None) or torch.equal(ref[2], ours[2])
    assert any(r.get("grad_calls") == 2 for r in new.report().rows)
    assert _grad_rows(new.report()) == _grad_rows(old.report())


class _SqrtAtZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(torch.sqrt(h))  # d sqrt(h)/dh at h = 0 is inf: the gradient turns non-finite here


def test_backward_nan_origin_is_the_python_hooks():
    torch.manual_seed(0)
    model, x = _SqrtAtZero(), torch.randn(8, 4)
    new = fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic")
    old = _with_python_hooks(fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic"))
    for m in (new, old):
        m(x).sum().backward()
        m(x).sum().backward()
    a, b = new.report(), old.report()
    assert a.first_nonfinite is None and a.first_nonfinite_grad is not None
    assert a.first_nonfinite_grad == b.first_nonfinite_grad
    assert _grad_rows(a) == _grad_rows(b)


def test_the_tap_is_a_no_op_without_autograd():
    table = init_table(1, [], "cpu")
    before = table.clone()
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        observe_grad_op()(x * 2, table, 0, 0, 0, 0)
    observe_grad_op()(torch.randn(3), table, 0, 0, 0, 0)  # needs no grad: nothing to hook
    with torch.inference_mode():
        observe_grad_op()(torch.randn(3), table, 0, 0, 0, 0)
    assert torch.equal(table, before)


def test_batched_taps_fold_each_gradient_into_its_row():
    table = init_table(3, [], "cpu")
    table[0] = 4
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    ya, yb = a * 2, b.exp()
    observe_grad_many_op()([ya, yb, torch.randn(2)], table, [0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0])
    (ya.sum() * 3 + (yb * torch.tensor([1.0, float("nan"), 2.0, 0.0, 1.0])).sum()).backward()
    row_a, row_b, row_c = (table[K * (r + 1): K * (r + 2)] for r in (0, 2, 1))
    assert row_a[INDEX["calls"]] == 1 and row_a[INDEX["count"]] == 6 and row_a[INDEX["sum"]] == 18
    assert row_b[INDEX["nan"]] == 1 and row_b[INDEX["zeros"]] == 1 and row_b[INDEX["first_bad"]] == 4
    assert row_c[INDEX["calls"]] == 0


def test_taps_survive_deepcopy_and_pickle():
    model, (x,) = ZOO["transformer_block"]()
    dbg = fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic")
    for twin in (copy.deepcopy(dbg), pickle.loads(pickle.dumps(dbg))):
        assert _taps(twin)
        twin(x).sum().backward()
        rows = [r for r in twin.report().rows if r.get("grad_calls")]
        assert rows and all(r["grad_calls"] == 1 for r in rows)


def test_meta_device_backward():
    model, (x,) = ZOO["residual_cnn"]()
    model.to("meta")
    dbg = fxdebug.instrument(model, PASSES(), example_inputs=(x.to("meta"),), frontend="symbolic")
    out = dbg(x.to("meta").requires_grad_())
    out.sum().backward()
    assert out.device.type == "meta" and dbg.report().rows


def test_native_tap_is_in_use_here():
    assert backend() == "c++"
    assert "CompositeImplicitAutograd" in torch._C._dispatch_dump("fxdebug::observe_grad")


def test_compiled_training_step_observes_gradients_like_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(4, 6)
    eager = fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic")
    compiled_dbg = fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(compiled_dbg)(x)
    assert explained.graph_break_count == 0
    compiled_dbg.reset()
    step = torch.compile(compiled_dbg, backend="aot_eager")
    for _ in range(2):
        eager(x).sum().backward()
        step(x).sum().backward()
    rows = [r for r in compiled_dbg.report().rows if r.get("grad_calls")]
    assert rows and all(r["grad_calls"] == 2 for r in rows)
    assert _grad_rows(compiled_dbg.report()) == _grad_rows(eager.report())


class _GradAbs(fxdebug.authoring.FusedProbe):
    key = "grad-abs"
    grads = True
    columns = (fxdebug.Column("l1_mean", phase="both"),)

    def summary_from(self, stats, phase):
        return {"l1_mean": stats.abs / stats.count if stats.count else None}


@fxdebug.graph_pass(name="grad-abs", observe_only=True)
def _grad_abs(gm, ctx):
    return fxdebug.PassResult(gm, added=[ctx.observe(n, _GradAbs()) for n in ctx.nodes(gm, float_outputs=True)])


def test_taps_of_small_tensors_are_batched_and_split_when_reinstrumented():
    model, (x,) = ZOO["transformer_block"]()
    dbg = fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic")
    many = [n for n in _taps(dbg) if n.target is torch.ops.fxdebug.observe_grad_many.default]
    assert many and all(len(n.args[0]) >= 2 for n in many)  # one call registers several hooks
    again = fxdebug.instrument(dbg, [_grad_abs], example_inputs=(x,), frontend="symbolic")
    again.reset()
    again(x).sum().backward()
    rows = [r for r in again.report().rows if r.get("grad_calls")]
    assert rows and all(r["grad_calls"] == 1 for r in rows)  # each gradient observed once after the re-lowering
    assert all(r["grad_l1_mean"] == pytest.approx(r["grad_mean_abs"]) for r in rows)


def test_the_cpp_hook_dispatches_to_a_python_kernel():
    """On CUDA the hook's ``observe`` lands on the Triton kernel (Python): the same path on CPU with
    the pure-torch kernel swapped in, against the C++ kernel's rows."""
    from fxdebug.runtime.kernel import use

    model, (x,) = ZOO["residual_cnn"]()
    model.eval()
    rows = []
    for kernel in ("cpp", "torch"):
        dbg = fxdebug.instrument(model, PASSES(), example_inputs=(x,), frontend="symbolic")
        with use(kernel):
            dbg(x).sum().backward()
        rows.append({r["node"]: r for r in dbg.report().rows})
    assert rows[0].keys() == rows[1].keys()
    for name, native in rows[0].items():
        ours = rows[1][name]
        assert ours.get("grad_calls") == native.get("grad_calls") and ours.get("grad_count") == native.get("grad_count")
        if native.get("grad_calls"):
            assert ours["grad_mean"] == pytest.approx(native["grad_mean"], rel=1e-6, abs=1e-12)
            assert ours["grad_nonfinite_calls"] == native["grad_nonfinite_calls"] == 0
