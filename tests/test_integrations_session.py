"""What both training callbacks share (``fxdebug.integrations._session``): the model's own forward
is routed through an instrumented module and restored, its root hooks run once, eval calls run
the plain model, and a missing framework is named with the extra to install."""

from __future__ import annotations

import importlib
import re
import sys

import pytest
import torch
from torch import nn

from fxdebug.integrations._session import Session


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_routes_training_calls_and_restores_the_model():
    model, x = _model(), torch.randn(3, 4)
    expected = model(x)
    session = Session(None, top_k=5)
    session.attach(model)
    assert type(model) is nn.Sequential and "forward" in model.__dict__
    torch.testing.assert_close(model(x), expected)  # observed: bitwise the model's result
    assert session.calls == 1 and session.read().calls == 1
    model.eval()
    torch.testing.assert_close(model(x), expected)  # eval: the plain model, not observed
    assert session.calls == 1 and session.read().calls == 1
    model.train()
    model(x)
    assert session.calls == 2
    session.detach()
    assert "forward" not in model.__dict__
    model(x)
    assert session.calls == 2


def test_root_hooks_run_once_per_call():
    model, seen = _model(), []
    model.register_forward_pre_hook(lambda m, i: seen.append("pre"))
    model.register_forward_hook(lambda m, i, o: seen.append("post"))
    session = Session(None, top_k=None)
    session.attach(model)
    model(torch.randn(2, 4))
    model(torch.randn(2, 4))
    session.detach()
    assert seen == ["pre", "post", "pre", "post"] and session.calls == 2


def test_an_instance_forward_set_before_is_put_back():
    model = _model()
    plain = model.forward
    model.forward = lambda x: plain(x) * 1  # e.g. accelerate's autocast wrapper
    wrapper = model.__dict__["forward"]
    session = Session(None, top_k=None)
    session.attach(model)
    model(torch.randn(2, 4))
    session.detach()
    assert model.__dict__["forward"] is wrapper


@pytest.mark.parametrize("module, framework, extra", [
    ("fxdebug.integrations.hf", "transformers", "fxdebug[hf]"),
    ("fxdebug.integrations.lightning", "lightning", "fxdebug[lightning]"),
])
def test_a_missing_framework_names_the_extra(monkeypatch, module, framework, extra):
    monkeypatch.setitem(sys.modules, framework, None)  # import of it fails as if not installed
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    for name in [m for m in sys.modules if m.startswith(f"{framework}.")]:  # submodules an earlier test imported
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=re.escape(f"pip install '{extra}'")):
        importlib.import_module(module)


def test_importing_fxdebug_imports_no_framework():
    import subprocess

    code = "import sys, fxdebug; print(any(m in sys.modules for m in ('transformers', 'lightning')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
