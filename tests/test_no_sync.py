"""Record mode never synchronises with the host: every zoo model runs forward and backward with
ShapeAssert, DeviceCheck, NaNCheck and StatCollector(grads=True) under a dispatch mode that
fails on ``aten._local_scalar_dense`` (what ``.item()``, ``bool()``, ``float()`` become)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxdebug
from fxdebug.passes import DeviceCheck, NaNCheck, ShapeAssert, StatCollector
from zoo import ZOO


class HostSyncForbidden(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("host sync (aten._local_scalar_dense) in record mode")
        return func(*args, **(kwargs or {}))


def _passes():
    return [ShapeAssert(), DeviceCheck(), NaNCheck(backward=True, counts=True), StatCollector(grads=True, counts=True)]


def _loss(y):
    if isinstance(y, dict):
        y = list(y.values())
    if isinstance(y, (tuple, list)):
        return sum(_loss(t) for t in y)
    return y.float().sum()


def test_the_guard_catches_item():
    with pytest.raises(AssertionError, match="host sync"), HostSyncForbidden():
        torch.ones(2).sum().item()


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_record_mode_forward_backward_without_sync(name, device):
    if name == "control_flow":
        pytest.skip("the model itself branches on a tensor value (a sync fxdebug cannot remove)")
    model, inputs = ZOO[name]()
    model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    dbg = fxdebug.instrument(model, _passes(), example_inputs=inputs)
    calls = 70 if (name == "residual_cnn" and device == "cpu") else 2  # 70 crosses the fold threshold
    with HostSyncForbidden():
        for _ in range(calls):
            y = dbg(*inputs)
            loss = _loss(y)
            if loss.requires_grad:
                loss.backward()
    report = dbg.report()  # reading may sync
    assert report.rows
    if device == "cpu":
        assert report.ok and report.first_nonfinite is None
        assert all(r["calls"] == calls for r in report.rows)
