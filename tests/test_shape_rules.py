"""ShapeAssert's shape rules (passes/shape_rules.py) agree with the ops they stand for, and the check
of a new input signature uses them instead of a fake-tensor run (issue 33, item 3: linear and cheap).

Each rule is compared with the real op on real tensors; where a rule is not sure it answers ``None``
(the node then runs on fake tensors, which fail as the real op would).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxdebug
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector
from fxdebug.passes import shape_assert
from fxdebug.passes.shape_rules import Meta, meta_of, rule_for

MODULES = [
    (nn.ReLU(), (3, 5)), (nn.GELU(), (2, 3, 4)), (nn.Tanh(), (4,)), (nn.Dropout(0.3), (2, 6)), (nn.Identity(), (1, 2)),
    (nn.Softmax(dim=-1), (2, 7)), (nn.LeakyReLU(0.2), (3, 3)), (nn.SiLU(), (5, 1)),
    (nn.Linear(5, 3), (4, 5)), (nn.Linear(5, 3, bias=False), (2, 6, 5)),
    (nn.Conv2d(3, 8, 3), (2, 3, 9, 9)), (nn.Conv2d(3, 8, 3, stride=2, padding=1, dilation=2), (1, 3, 17, 12)),
    (nn.Conv2d(3, 4, 5, padding="same"), (2, 3, 8, 8)), (nn.Conv1d(2, 4, 3, padding="valid", stride=3), (2, 2, 20)),
    (nn.Conv3d(1, 2, (1, 2, 3)), (1, 1, 4, 5, 6)), (nn.Conv2d(4, 4, 3, groups=2, padding_mode="reflect", padding=1), (1, 4, 6, 6)),
    (nn.LayerNorm(6), (2, 3, 6)), (nn.LayerNorm((3, 6)), (2, 3, 6)), (nn.GroupNorm(2, 4), (2, 4, 5)),
    (nn.BatchNorm1d(4).eval(), (3, 4)), (nn.BatchNorm1d(4).eval(), (3, 4, 7)), (nn.BatchNorm2d(3).eval(), (2, 3, 4, 4)),
    (nn.BatchNorm3d(2), (2, 2, 3, 3, 3)),
]


@pytest.mark.parametrize("module,shape", MODULES, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else str(v))
def test_module_rules_agree_with_the_module(module, shape):
    x = torch.randn(shape)
    rule = rule_for("call_module", module)
    assert rule is not None
    assert rule(module, (meta_of(x),), {}) == meta_of(module(x))


FUNCTIONS = [
    (torch.relu, (torch.randn(2, 3),), {}), (F.gelu, (torch.randn(4),), {"approximate": "tanh"}),
    (F.dropout, (torch.randn(3, 3), 0.5, True, False), {}), (torch.softmax, (torch.randn(2, 5), 1), {}),
    (F.linear, (torch.randn(3, 4), torch.randn(6, 4), torch.randn(6)), {}), (torch._C._nn.linear, (torch.randn(2, 7, 4), torch.randn(2, 4)), {}),
    (operator.add, (torch.randn(3, 1, 4), torch.randn(5, 1)), {}), (operator.mul, (torch.randn(2, 3), 2.5), {}),
    (operator.truediv, (3, torch.randn(2, 2)), {}), (torch.sub, (torch.randn(4, 4), torch.randn(4)), {}),
]


@pytest.mark.parametrize("fn,args,kwargs", FUNCTIONS, ids=lambda v: getattr(v, "__name__", None) or "")
def test_function_rules_agree_with_the_function(fn, args, kwargs):
    rule = rule_for("call_function", fn)
    assert rule is not None
    metas = tuple(meta_of(a) or a for a in args)
    assert rule(fn, metas, kwargs) == meta_of(fn(*args, **kwargs))


@pytest.mark.parametrize("method,args", [("relu", ()), ("softmax", (-1,)), ("add", (torch.randn(3, 1),)), ("contiguous", ())])
def test_method_rules_agree_with_the_method(method, args):
    x = torch.randn(2, 3, 4)[:, :, 0].t()
    rule = rule_for("call_method", method)
    assert rule(method, (meta_of(x), *(meta_of(a) or a for a in args)), {}) == meta_of(getattr(x, method)(*args))


def test_rules_answer_none_where_the_real_op_would_fail_or_change_the_dtype():
    f32, f16 = Meta((2, 5), torch.float32, torch.device("cpu")), Meta((2, 5), torch.float16, torch.device("cpu"))
    ints = Meta((2, 5), torch.int64, torch.device("cpu"))
    lin = nn.Linear(4, 3)
    assert rule_for("call_module", lin)(lin, (f32,), {}) is None  # 5 features into a Linear(4, ...)
    assert rule_for("call_function", operator.add)(operator.add, (f32, f16), {}) is None  # promotion: ask the op
    assert rule_for("call_function", operator.truediv)(operator.truediv, (ints, ints), {}) is None  # int / int -> float
    assert rule_for("call_function", operator.mul)(operator.mul, (ints, 0.5), {}) is None
    conv = nn.Conv2d(3, 4, 5)
    assert rule_for("call_module", conv)(conv, (Meta((1, 3, 2, 2), torch.float32, torch.device("cpu")),), {}) is None
    bn = nn.BatchNorm1d(5)
    assert rule_for("call_module", bn)(bn, (Meta((1, 5), torch.float32, torch.device("cpu")),), {}) is None
    assert rule_for("call_function", torch.cat) is None and rule_for("call_module", nn.MultiheadAttention(4, 1)) is None


def _blocks(n: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh()) for _ in range(n)])


@pytest.mark.parametrize("frontend", ["symbolic", "dynamo"])
def test_a_new_batch_size_is_checked_by_the_rules_alone(frontend, monkeypatch):
    fake_nodes = []
    run = shape_assert._Fakes.run
    monkeypatch.setattr(shape_assert._Fakes, "run", lambda self, node, *a: fake_nodes.append(node.name) or run(self, node, *a))
    model, x = _blocks(30), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], example_inputs=(x,), frontend=frontend)
    checked = []
    check = shape_assert.ShapeProbe.check
    monkeypatch.setattr(shape_assert.ShapeProbe, "check", lambda self, v, i: checked.append(self.node_name) or check(self, v, i))
    torch.testing.assert_close(dbg(y := torch.randn(5, 4)), model(y))
    assert fake_nodes == [] and len(checked) >= 120  # every node checked, none run on fake tensors


class _FixedView(nn.Module):
    """Right at the example's batch size, wrong at any other: ``view(2, -1)`` folds the batch away."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.fc(x).view(2, -1)).relu()


@pytest.mark.parametrize("frontend", ["symbolic", "auto"])
def test_the_check_still_finds_what_goes_wrong_without_failing(frontend):
    model, x = _FixedView(), torch.randn(2, 4)
    dbg = fxdebug.instrument(model, [ShapeAssert()], example_inputs=(x,), frontend=frontend)
    dbg(x)
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"\(N, 4\)"):
        dbg(torch.randn(4, 4))
