"""The public rewrite helper: find_pattern / replace_pattern keep metadata and provenance."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdebug
from zoo import ZOO

DOC = Path(__file__).resolve().parent.parent / "docs" / "writing-passes.md"


def _doc_example() -> dict:
    text = DOC.read_text()
    section = text[text.index("## Rewriting patterns"):]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(blocks[0], "writing-passes.md", "exec"), namespace)
    exec(compile(blocks[1].replace("print(", "_ = ("), "writing-passes.md", "exec"), namespace)
    return namespace


def test_doc_example_runs_and_records_provenance():
    ns = _doc_example()
    dbg = ns["dbg"]
    new = next(n for n in dbg.graph.nodes if n.target is torch.tanh)
    meta = fxdebug.authoring.fx_meta(new)
    assert meta["replaced"] == "torch.sigmoid (sigmoid) + operator.mul (mul) + operator.sub (sub)"
    assert meta["changed_by"] == ["sigmoid-to-tanh"] and meta["rewritten_from"] == ["sigmoid", "mul", "sub"]
    assert "sigmoid" not in {n.name for n in dbg.graph.nodes}
    assert "y = torch.sigmoid(y) * 2.0 - 1.0" in fxdebug.authoring.source_line(new)
    assert dbg.pass_results[0].replaced == {"sub": new.name}


CONV_BN = nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1))


def test_module_patterns_match_by_type_in_graph_order():
    model, (x,) = ZOO["residual_cnn"]()
    gm = fxdebug.trace(model, (x,))
    found = fxdebug.authoring.find_pattern(gm, CONV_BN)
    assert [m.anchor.name for m in found][:3] == ["stem_1", "layer1_0_bn1", "layer1_0_bn2"]
    assert len(found) == 10 and not any(m.blocked for m in found)
    first = found[0]
    assert [n.name for n in first.nodes] == ["stem_0", "stem_1"] and first.inputs[0].name == "x"
    assert first.modules() == [model.stem[0], model.stem[1]]
    assert set(first.roles) == {"_0", "_1"}
    assert [m.anchor.name for m in fxdebug.authoring.find_pattern(gm, CONV_BN, where="layer2.*")][0] == "layer2_0_down_1"


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) * y


def test_blocked_matches_say_why_and_are_not_replaced():
    x = torch.randn(1, 2, 3, 3)
    gm = fxdebug.trace(Shared(), (x,))
    (match,) = fxdebug.authoring.find_pattern(gm, CONV_BN)
    assert "feeds 2 users (bn, mul)" in match.blocked
    assert fxdebug.authoring.replace_pattern(gm, CONV_BN, nn.Identity()) == []


def test_module_replacement_is_registered_under_fxdebug_and_not_in_the_model():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.ReLU())
    x = torch.randn(4, 3)
    gm = fxdebug.trace(model, (x,))
    done = fxdebug.authoring.replace_pattern(gm, nn.Sequential(nn.ReLU()), nn.Tanh())
    gm.recompile()
    assert len(done) == 2 and all(str(r.output.target).startswith("fxdebug.") for r in done)
    assert done[0].output is not done[1].output and gm.get_submodule(str(done[0].output.target)) is not gm.get_submodule(str(done[1].output.target))
    assert all(fxdebug.authoring.module_path(r.output) == p for r, p in zip(done, ["1", "3"]))
    torch.testing.assert_close(gm(x), torch.tanh(model[2](torch.tanh(model[0](x)))))
    assert not hasattr(model, "fxdebug") and all(isinstance(model[i], nn.ReLU) for i in (1, 3))


def test_build_may_skip_and_arguments_are_checked():
    model, (x,) = ZOO["residual_cnn"]()
    gm = fxdebug.trace(model, (x,))
    done = fxdebug.authoring.replace_pattern(gm, CONV_BN, build=lambda m: nn.Identity() if m.anchor.name == "stem_1" else None)
    assert [r.match.anchor.name for r in done] == ["stem_1"]
    with pytest.raises(fxdebug.UsageError, match="exactly one"):
        fxdebug.authoring.replace_pattern(gm, CONV_BN)
    with pytest.raises(fxdebug.UsageError, match="single tensor"):
        fxdebug.authoring.find_pattern(gm, lambda t: (t, t))


def test_node_values_returns_copies_and_restores_buffers():
    model, (x,) = ZOO["residual_cnn"]()
    model.train()
    gm = fxdebug.trace(model, (x,))
    before = model.stem[1].running_mean.clone()
    values = fxdebug.authoring.node_values(gm, fxdebug.PassContext((x,)), ["layer1_0_bn1", "output"])
    assert torch.equal(model.stem[1].running_mean, before)
    assert (values["layer1_0_bn1"] < 0).any()  # taken before the in-place ReLU that follows it
    assert values["output"].shape == (2, 10)
