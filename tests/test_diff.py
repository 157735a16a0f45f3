"""fxdebug.diff: two runs' reports aligned node by node, and the first node whose statistics part."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from numerics_models import cancelling_norm
from zoo import ZOO


def _report(model, inputs, **kw):
    dbg = fxdebug.instrument(model, [StatCollector(), NaNCheck()], example_inputs=inputs, **kw)
    if isinstance(inputs, dict):
        dbg(**inputs)
    else:
        dbg(*inputs)
    return dbg.report()


def test_fp32_vs_bf16_aligns_every_node_and_names_the_cancellation():
    model, (x,) = cancelling_norm()
    a = _report(model, (x,))
    b = _report(copy.deepcopy(model).to(torch.bfloat16), (x.bfloat16(),))
    d = fxdebug.diff(a, b, rtol=0.05)
    assert len(d.aligned) == len(a.rows) == len(b.rows) and not d.unmatched_a and not d.unmatched_b
    assert all(r["match"] == "name" and r["node_a"] == r["node_b"] for r in d.aligned)
    assert d.first_divergent == "sub"
    assert d.row("mean")["divergence"] < 0.05 < d.row("sub")["divergence"]
    assert "sub" in str(d) and d.divergent[0] == "sub"
    assert set(d.node_divergence()) == {r["node"] for r in a.rows}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_identical_runs_do_not_diverge(name):
    model, inputs = ZOO[name]()
    model.eval()
    d = fxdebug.diff(_report(model, inputs), _report(model, inputs), rtol=0.0)
    assert d.first_divergent is None and not d.unmatched_a and all(r["divergence"] == 0 for r in d.aligned)


def test_symbolic_vs_export_align_by_module_path():
    model, (x,) = ZOO["transformer_block"]()
    model.eval()
    a, b = _report(model, (x,)), _report(model, (x,), frontend="export")
    d = fxdebug.diff(a, b, rtol=1e-5)
    assert len(d.aligned) == len(a.rows) and not d.unmatched_b
    assert {r["match"] for r in d.aligned} - {"name"}  # some names differ (attn_qkv vs linear) ...
    assert d.row("attn_qkv")["node_b"] == "linear"  # ... and module paths align them
    assert d.first_divergent is None


class Before(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Inserted(Before):
    """A code change: an extra op (a residual) before the ReLU."""

    def forward(self, x):
        h = self.fc1(x)
        h = h + x
        return self.fc2(torch.relu(h))


class Swapped(Before):
    """A code change: GELU instead of ReLU."""

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def test_before_and_after_a_code_change():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        before = Before()
    x = torch.randn(4, 8)
    base = _report(before, (x,))
    inserted, swapped = Inserted(), Swapped()
    inserted.load_state_dict(before.state_dict())
    swapped.load_state_dict(before.state_dict())
    d = fxdebug.diff(base, _report(inserted, (x,)), rtol=1e-3)
    assert d.row("fc1")["divergence"] == 0
    assert d.unmatched_b == ["add"] and not d.unmatched_a
    assert d.first_divergent == "relu"  # the first node whose values changed
    d = fxdebug.diff(base, _report(swapped, (x,)), rtol=1e-3)
    assert not d.unmatched_a and not d.unmatched_b
    assert d.row("relu")["node_b"] == "gelu" and d.row("relu")["match"] == "module"
    assert d.first_divergent == "relu"


def test_nonfinite_counts_and_shapes_diverge_infinitely():
    a = [{"node": "x", "module": "", "op": "torch.log", "shape": (2,), "nonfinite_calls": 0, "mean": 1.0}]
    b = [{"node": "x", "module": "", "op": "torch.log", "shape": (2,), "nonfinite_calls": 1, "mean": 1.0}]
    from fxdebug.passes.nan_check import nonfinite_columns
    from fxdebug.runtime.columns import resolve_columns

    ra, rb = (fxdebug.Report(rows=r, columns=resolve_columns(nonfinite_columns(False))) for r in (a, b))
    assert fxdebug.diff(ra, rb).row("x")["divergence"] == float("inf")  # a NONFINITE column: any change counts
    assert fxdebug.diff(a, b).row("x")["divergence"] == 1.0  # bare rows declare nothing: an ordinary number
    c = [{"node": "x", "module": "", "op": "torch.log", "shape": (3,), "nonfinite_calls": 0, "mean": 1.0}]
    assert fxdebug.diff(a, c).row("x")["column"] == "shape"
    with pytest.raises(TypeError):
        fxdebug.diff(a, 3)


def test_eager_vs_compiled_aligns_every_node():
    model, (x,) = cancelling_norm()
    eager = _report(model, (x,))
    dbg = fxdebug.instrument(model, [StatCollector(), NaNCheck()], example_inputs=(x,))
    compiled = torch.compile(dbg, backend="aot_eager")
    compiled(x)
    d = fxdebug.diff(eager, dbg.report(), rtol=1e-4)
    assert len(d.aligned) == len(eager.rows) and all(r["match"] == "name" for r in d.aligned)
    assert d.first_divergent is None


@pytest.mark.slow
def test_eager_vs_inductor_aligns_every_node():
    model, (x,) = ZOO["transformer_block"]()
    model.eval()
    eager = _report(model, (x,))
    dbg = fxdebug.instrument(model, [StatCollector(), NaNCheck()], example_inputs=(x,))
    torch.compile(dbg)(x)
    d = fxdebug.diff(eager, dbg.report(), rtol=1e-4)
    assert len(d.aligned) == len(eager.rows) and d.first_divergent is None


def test_tiny_gpt2_fp32_vs_bf16_aligns_every_node():
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 8))
    a = _report(model, {"input_ids": ids})
    b = _report(copy.deepcopy(model).to(torch.bfloat16), {"input_ids": ids})
    d = fxdebug.diff(a, b, rtol=0.05)
    assert len(d.aligned) == len(a.rows) == len(b.rows) > 30
    assert all(r["match"] == "name" for r in d.aligned)
    assert 0 < max(r["divergence"] for r in d.aligned) and d.first_divergent is None  # bf16 noise, under 5 %
    tight = fxdebug.diff(a, b, rtol=1e-4)
    assert tight.first_divergent == tight.divergent[0] and len(tight.divergent) > 10


def test_render_colours_the_graph_by_divergence(tmp_path):
    model, (x,) = cancelling_norm()
    dbg = fxdebug.instrument(model, [StatCollector(), NaNCheck()], example_inputs=(x,))
    dbg(x)
    d = fxdebug.diff(dbg.report(), _report(copy.deepcopy(model).to(torch.bfloat16), (x.bfloat16(),)), rtol=0.05)
    svg = dbg.render(str(tmp_path / "diff.svg"), diff=d)
    text = (tmp_path / "diff.svg").read_text(encoding="utf-8")
    assert str(svg).endswith("diff.svg")
    assert "divergent node: sub" in text  # the first divergent node is marked on the picture
