"""The training tools on a CUDA device (skipped without one): state stays on the device, CUDA-event
timing, histograms and parameter gradients computed there, collect over device batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxdebug
from fxdebug.training import restore
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


@pytest.mark.parametrize("kind", ["sgd", "adam-foreach", "adamw", "adamw-fused"])
def test_guard_on_cuda_restores_bitwise_without_a_sync(kind):
    """The conditional copy (fused SGD's first-step buf=grad under found_inf) on the CUDA kernel."""
    from syncs import CountSyncs
    from test_guard import BAD, OPTIMIZERS, Net, assert_bitwise, batches, snapshot

    data = [x.cuda() for x in batches()]

    def run(guarded, skip=None):
        torch.manual_seed(0)
        model = Net().cuda()
        opt = OPTIMIZERS[kind](model.parameters())
        g = fxdebug.guard(opt) if guarded else opt
        syncs = []
        for i, x in enumerate(data):
            if i == skip:
                continue
            before = snapshot(model, opt) if i == BAD and guarded else None
            model(x).square().mean().backward()
            with CountSyncs() as counter:
                g.step()
            syncs.append(counter.syncs)
            g.zero_grad()
            if before is not None:
                assert_bitwise(before, snapshot(model, opt), f"{kind}: after the bad step")
        return model, opt, g, syncs

    model, opt, g, syncs = run(True)
    ref, ref_opt, _, _ = run(False, skip=BAD)
    assert_bitwise(ref.state_dict(), model.state_dict(), "weights")
    assert_bitwise(ref_opt.state_dict()["state"], opt.state_dict()["state"], "state")
    assert syncs == [0] * len(data) and int(g.skipped) == 1
    plan = g.__dict__.get("_plan")
    assert "fused" in kind or (plan is not None and plan.copies and not plan.saved[0])  # the kernel ran, no fallback


def test_conditional_copy_kernel_is_bit_exact_on_cuda():
    from test_guard import bit_patterns

    for dtype in (torch.float32, torch.float64):
        src = [bit_patterns(dtype, n).cuda() for n in (1, 5, 8, 17, 100000)]
        kept = [s.clone() for s in src]
        dst = [torch.zeros_like(s) for s in src]
        scratch = [torch.empty_like(s) for s in src]
        restore._copy_if(dst, src, scratch, torch.ones((), device="cuda"))
        assert all(int(d.abs().sum()) == 0 for d in dst)
        restore._copy_if(dst, src, scratch, torch.zeros((), device="cuda"))
        ints = torch.int32 if dtype == torch.float32 else torch.int64
        assert all(torch.equal(d.view(ints), k.view(ints)) for d, k in zip(dst, kept))
        assert all(torch.equal(s.view(ints), k.view(ints)) for s, k in zip(src, kept))
