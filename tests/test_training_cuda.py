"""The training tools on a CUDA device (skipped without one): state stays on the device, CUDA-event
timing, histograms and parameter gradients computed there, collect over device batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxdebug
from fxdebug.passes import GradientScale, ParamGrads, Profile, StatCollector
from zoo import ZOO

pytestmark = pytest.mark.cuda


def test_collect_histograms_param_grads_and_event_timing_on_cuda():
    model, (x,) = ZOO["residual_cnn"]()
    model = model.cuda()
    x = x.cuda()
    batches = [(torch.randn(4, 3, 16, 16, device="cuda"), torch.randint(0, 10, (4,), device="cuda")) for _ in range(3)]
    dbg = fxdebug.instrument(model, [StatCollector(grads=True, histograms=16), ParamGrads(), Profile(time=True)],
                             example_inputs=(x,))
    report = fxdebug.collect(dbg, batches, loss_fn=lambda out, b: F.cross_entropy(out, b[1]), progress=False)
    fc = report.row("fc")
    assert report.calls == 3 and fc["param_grad_calls"] == 3 and fc["time_ms"] > 0
    assert sum(fc["hist"]["counts"]) == fc["hist"]["num"] == 3 * 4 * 10
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(batches[0][0]), batches[0][1]).backward()
    assert model.fc.weight.grad is not None  # collect put the (absent) grads back; the model trains as before


def test_gradient_reversal_on_cuda_is_exact():
    model, (x,) = ZOO["residual_cnn"]()
    model = model.cuda().eval()
    x = x.cuda()
    model(x).sum().backward()
    ref = model.stem[0].weight.grad.clone()
    model.zero_grad(set_to_none=True)
    dbg = fxdebug.instrument(model, [GradientScale(fxdebug.outputs_of("layer2"), -1.0)], example_inputs=(x,))
    out = dbg(x)
    assert torch.equal(out, model(x))
    out.sum().backward()
    torch.testing.assert_close(model.stem[0].weight.grad, -ref)
