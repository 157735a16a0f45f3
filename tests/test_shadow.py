"""Shadow: per-node local and accumulated precision error against a float64 shadow run."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils import _pytree as pytree

import fxdebug
from fxdebug.passes import Shadow, StatCollector
from numerics_models import cancelling_norm, naive_softmax
from zoo import ZOO


def _equal(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_outputs_unchanged_and_fp32_errors_tiny(name):
    model, inputs = ZOO[name]()
    model.eval()
    dbg = fxdebug.instrument(model, [Shadow(), StatCollector()], example_inputs=inputs)
    for part in dbg.parts().values():  # a live capture: one graph per graph break (control_flow has four)
        part.graph.lint()
    assert _equal(dbg(*inputs), model(*inputs))
    rows = dbg.report().rows
    shadowed = [r for r in rows if "acc_err" in r]
    assert shadowed, "no node reported shadow errors"
    for r in shadowed:
        assert "shadow_failed" not in r, r
        assert r["acc_err"] < 1e-5 and r["local_err"] < 1e-5, r  # fp32 vs fp64: a few ulps
    assert "mean" in shadowed[0]  # composes with other observe passes on the same node


def test_cancellation_in_bf16_is_named_at_the_subtraction():
    model, (x,) = cancelling_norm()
    low, xb = model.to(torch.bfloat16), x.bfloat16()
    dbg = fxdebug.instrument(low, [Shadow()], example_inputs=(xb,))
    assert torch.equal(dbg(xb), low(xb))
    report = dbg.report()
    assert report.precision_origin == "sub"
    sub = report.row("sub")
    assert sub["local_err"] < 1e-3  # the subtraction itself is (nearly) exact ...
    assert sub["acc_err"] > 0.5  # ... but every correct digit of its result is gone
    assert report.row("mean_1")["acc_err"] < 1e-2  # its inputs were fine
    assert "precision_origin" not in report.row("sub")


def test_softmax_without_max_in_bf16_is_named_at_exp():
    model, (x,) = naive_softmax()
    low, xb = model.to(torch.bfloat16), x.bfloat16()
    dbg = fxdebug.instrument(low, [Shadow()], example_inputs=(xb,))
    dbg(xb)
    report = dbg.report()
    assert report.precision_origin == "exp"
    assert report.row("exp")["acc_err"] > 10 * report.row("truediv")["acc_err"]


def test_fp16_overflow_gives_infinite_error_at_exp():
    model, (x,) = naive_softmax()
    half = model.half()
    dbg = fxdebug.instrument(half, [Shadow()], example_inputs=(x.half(),))
    out = dbg(x.half())
    assert torch.isnan(out).any() and _equal(out.isnan(), half(x.half()).isnan())
    report = dbg.report()
    assert report.precision_origin == "exp"
    assert report.row("exp")["acc_err"] == float("inf")
    assert report.row("truediv")["acc_err"] < 1e-2


def test_autocast_regions_are_measured_against_fp64():
    model, (x,) = ZOO["transformer_block"]()
    model.eval()
    dbg = fxdebug.instrument(model, [Shadow()], example_inputs=(x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        got = dbg(x)
    assert torch.equal(got, expected)
    report = dbg.report()
    linear = report.row("attn_qkv")
    assert linear["local_err"] > 1e-4  # autocast ran the Linear in bf16
    assert report.row("ln1")["local_err"] < 1e-6  # layer_norm stays fp32 under CPU autocast


def test_dropout_in_training_reuses_the_real_mask():
    model, (x,) = ZOO["transformer_block"]()
    model.train()
    dbg = fxdebug.instrument(model, [Shadow()], example_inputs=(x,))
    torch.manual_seed(3)
    got = dbg(x)
    torch.manual_seed(3)
    assert torch.equal(got, model(x))
    rows = dbg.report().rows
    assert max(r["acc_err"] for r in rows if "acc_err" in r) < 1e-5


def test_float32_shadow_of_a_bf16_model_and_where():
    model, (x,) = cancelling_norm()
    low, xb = model.to(torch.bfloat16), x.bfloat16()
    dbg = fxdebug.instrument(low, [Shadow(torch.float32, where="sub*")], example_inputs=(xb,))
    dbg(xb)
    rows = {r["node"]: r for r in dbg.report().rows}
    assert set(rows) == {"sub", "sub_1"}
    assert rows["sub"]["acc_err"] < 1e-2  # its inputs entered the shadow exact: only its own error counts
    with pytest.raises(fxdebug.UsageError):
        Shadow(torch.int32)


def test_reset_clears_shadow_errors():
    model, (x,) = cancelling_norm()
    low, xb = model.to(torch.bfloat16), x.bfloat16()
    dbg = fxdebug.instrument(low, [Shadow()], example_inputs=(xb,))
    dbg(xb)
    assert dbg.report().row("sub")["acc_err"] > 0.5
    dbg.reset()
    assert "acc_err" not in dbg.report().row("sub")
    dbg(torch.ones_like(xb))  # constant rows: mean and E[x²] exact, the variance exactly 0
    assert dbg.report().row("sub")["acc_err"] < 0.5  # the earlier maximum is gone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_gpt2(dtype):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval().to(dtype)
    ids = torch.randint(0, 100, (2, 8))
    dbg = fxdebug.instrument(model, [Shadow()], example_inputs={"input_ids": ids})
    assert torch.equal(dbg(input_ids=ids).logits, model(input_ids=ids).logits)
    rows = [r for r in dbg.report().rows if "acc_err" in r]
    assert len(rows) > 20 and not any("shadow_failed" in r for r in rows)
    worst = max(r["acc_err"] for r in rows)
    assert worst < (1e-5 if dtype == torch.float32 else 0.1)
    if dtype == torch.bfloat16:
        assert worst > 1e-3


@pytest.mark.parametrize("order", ["shadow-first", "shadow-last"])
def test_shadow_composes_with_nan_check_in_either_order(order):
    model, (x,) = cancelling_norm()
    low, xb = model.to(torch.bfloat16), x.bfloat16()
    from fxdebug.passes import NaNCheck

    passes = [Shadow(), NaNCheck()] if order == "shadow-first" else [NaNCheck(), Shadow()]
    dbg = fxdebug.instrument(low, passes, example_inputs=(xb,))
    dbg(xb)
    report = dbg.report()
    assert report.precision_origin == "sub" and report.first_nonfinite is None
    assert all("nonfinite_calls" in r for r in report.rows)
    assert all("acc_err" in r for r in report.rows if r["node"] != "x")  # the input itself is not shadowed
