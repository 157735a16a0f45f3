"""precision_plan and the Precision pass: the few nodes to keep in fp32, found by measurement."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import fxdebug
from fxdebug.passes import Precision, Shadow
from numerics_models import cancelling_norm, naive_attention
from zoo import ZOO


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_cancellation_plan_keeps_the_subtraction_and_its_operands():
    model, (x,) = cancelling_norm()
    before = copy.deepcopy(model.state_dict())
    plan = fxdebug.precision_plan(model, (x,), dtype=torch.bfloat16, tol=1e-2)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model is not converted
    assert model.scale.dtype == torch.float32
    assert plan.error_before > 1.0  # bf16 destroys the variance
    assert plan.error_after <= 1e-2 < plan.error_before and plan.ok
    assert "sub" in plan.nodes  # where the error explodes ...
    assert {"mean", "mean_1"} <= set(plan.nodes)  # ... and the operands that feed it, grown toward the inputs
    assert len(plan.nodes) <= 7
    assert plan.growth["sub"] == max(plan.growth.values())
    assert "sub" in str(plan) and "bfloat16" in str(plan)


def test_applying_the_plan_reproduces_its_error():
    model, (x,) = cancelling_norm()
    plan = fxdebug.precision_plan(model, (x,), dtype=torch.bfloat16, tol=1e-2)
    low, xb = copy.deepcopy(model).to(torch.bfloat16), x.bfloat16()
    fast = fxdebug.instrument(low, [Precision(plan)], example_inputs=(xb,))
    fast.graph.lint()
    y = fast(xb)
    assert y.dtype == torch.bfloat16  # the model still returns bf16
    ref = copy.deepcopy(low).float()(xb.float())  # same rounded weights and inputs, computed in fp32
    assert _rel(y, ref) == pytest.approx(plan.error_after, rel=1e-6, abs=1e-9)
    assert _rel(low(xb), ref) == pytest.approx(plan.error_before, rel=1e-6)
    rows = {r["node"]: r for r in fxdebug.instrument(low, [Precision(plan), Shadow()], example_inputs=(xb,)).report().rows}
    assert set(plan.nodes) <= set(rows)
    assert "sub" in fast.pass_results[-1].replaced


def test_naive_softmax_plan_names_exp_and_fixes_the_drift():
    model, (x,) = naive_attention()
    low, xb = copy.deepcopy(model).to(torch.bfloat16), x.bfloat16()
    dbg = fxdebug.instrument(low, [Shadow()], example_inputs=(xb,))
    dbg(xb)
    assert dbg.report().precision_origin == "exp"
    plan = fxdebug.precision_plan(model, (x,), dtype=torch.bfloat16, tol=1e-2)
    assert plan.error_before > 1e-2 >= plan.error_after
    assert "exp" in plan.nodes and "matmul" in plan.nodes  # exp amplifies the rounding of its input scores
    assert plan.error_weights is not None and plan.error_weights < 1e-2


def test_plan_is_empty_when_dtype_already_meets_tol():
    model, inputs = ZOO["residual_cnn"]()
    model.eval()
    plan = fxdebug.precision_plan(model, inputs, dtype=torch.bfloat16, tol=0.5)
    assert plan.nodes == [] and plan.error_before == plan.error_after <= 0.5


@pytest.mark.parametrize("name", ["transformer_block", "inplace_ops", "residual_cnn", "lstm"])
def test_keeping_every_node_matches_fp32(name):
    model, inputs = ZOO[name]()
    model.eval()
    low = copy.deepcopy(model).to(torch.bfloat16)
    low_in = tuple(t.bfloat16() if t.is_floating_point() else t for t in inputs)
    # Precision transforms the graph, so "auto" captures a snapshot (symbolic): its node names are the plan's
    probe = fxdebug.instrument(low, [], example_inputs=low_in, frontend="symbolic")
    names = [n.name for n in probe.graph.nodes if n.op in ("call_module", "call_function", "call_method")
             and (n.meta.get("fxdebug", {}).get("dtype") in ("bfloat16", "float32"))]
    every = fxdebug.instrument(low, [Precision(names)], example_inputs=low_in)
    ref = copy.deepcopy(low).float()(*(t.float() if t.is_floating_point() else t for t in low_in))
    out = every(*low_in)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2  # only the final cast back to bf16 remains
    assert _rel(low(*low_in), ref) >= _rel(out, ref)


def test_precision_rejects_unknown_nodes_and_bad_arguments():
    model, (x,) = cancelling_norm()
    with pytest.raises(fxdebug.UsageError, match="nope"):
        fxdebug.instrument(model, [Precision(["nope"])], example_inputs=(x,))
    with pytest.raises(fxdebug.UsageError):
        Precision("sub")
    with pytest.raises(fxdebug.UsageError):
        fxdebug.precision_plan(model, (x,), dtype=torch.float64)
    with pytest.raises(fxdebug.UsageError):
        fxdebug.precision_plan(model, (x,), tol=0)


def test_tiny_llama_bf16_plan():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=100, max_position_embeddings=32, num_key_value_heads=2, use_cache=False,
                                   hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (1, 8))
    plan = fxdebug.precision_plan(model, {"input_ids": ids}, dtype=torch.bfloat16, tol=5e-3)
    assert plan.error_after <= max(5e-3, plan.error_before)
    assert plan.error_after <= plan.error_before
    low = copy.deepcopy(model).to(torch.bfloat16)
    fast = fxdebug.instrument(low, [Precision(plan)], example_inputs={"input_ids": ids})
    assert fast(input_ids=ids).logits.dtype == torch.bfloat16


def test_in_place_ops_are_never_planned():
    model, inputs = ZOO["inplace_ops"]()
    plan = fxdebug.precision_plan(model, inputs, dtype=torch.bfloat16, tol=1e-4)
    graph = fxdebug.trace(model).graph
    inplace = {n.name for n in graph.nodes if n.op != "placeholder" and fxdebug.authoring.is_inplace(n)}
    assert inplace and not inplace & set(plan.nodes)
    assert plan.error_after <= plan.error_before


def test_fp16_overflow_plan_keeps_exp_and_what_reads_it():
    model, (x,) = naive_attention()
    plan = fxdebug.precision_plan(model, (x,), dtype=torch.float16, tol=1e-2)
    assert plan.error_before == float("inf")  # exp overflows in fp16, the divide makes NaN
    assert plan.error_after <= 1e-2
    assert {"exp", "sum_1", "truediv"} <= set(plan.nodes)  # wide until the values are small again
    half, xh = copy.deepcopy(model).half(), x.half()
    out = fxdebug.instrument(half, [Precision(plan)], example_inputs=(xh,))(xh)
    assert torch.isfinite(out).all() and not torch.isfinite(half(xh)).all()
