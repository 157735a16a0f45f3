"""fxdebug.align: two different implementations matched op by op by value; the first op where they part.

Pairs (tests/align_models.py): Hugging Face's LlamaForCausalLM against a hand-written LLaMA (fused
wqkv, eager attention, other module names), a torchvision-style ResNet (fused qkv attention)
against a hand-written one (separate q/k/v). Each planted bug must be named in the module it lives
in, on both sides; the exact pairs and a dtype-only difference (bf16 autocast) raise no alarm.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import fxdebug
from align_models import LLAMA_BUGS, RESNET_BUGS, Autocast, Bug, TinyLlama, llama_pair, resnet_pair
from fxdebug.errors import ArgumentTypeError, UsageError

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_exact_llama_pair_agrees_and_lines_up_the_fused_qkv(attn):
    ref, cand, ids = llama_pair(attn=attn)
    torch.testing.assert_close(cand(ids), ref(ids).logits)
    al = fxdebug.align(ref, cand, (ids,))
    assert al.first_divergent is None, al
    rows = {r.candidate: r for r in al.rows}
    # the hand-written model's one wqkv projection against Hugging Face's three
    fused = [r for r in al.rows if r.match == "fused (slices match)" and r.candidate[1] == "layers.0.attn.wqkv"]
    assert fused and {m for _, m in fused[0].references} >= {"model.layers.0.self_attn.q_proj",
                                                             "model.layers.0.self_attn.k_proj",
                                                             "model.layers.0.self_attn.v_proj"}
    # each op of the candidate's MLP is matched to the reference's MLP in the same layer
    down = next(r for c, r in rows.items() if c[1] == "layers.1.mlp.w2" and r.op == "mm")
    assert down.reference[1] == "model.layers.1.mlp.down_proj" and down.error <= down.tolerance
    assert rows[next(c for c in rows if c[1] == "head" and rows[c].op == "mm")].reference[1] == "lm_head"
    assert "first divergent: none" in str(al)


def test_dtype_only_difference_is_no_alarm():
    ref, cand, ids = llama_pair()
    al = fxdebug.align(ref, Autocast(cand), (ids,))
    assert al.first_divergent is None, al
    assert al.dtypes == (torch.float32, torch.bfloat16) and al.eps == torch.finfo(torch.bfloat16).eps
    # judged at bf16's floor, the bf16 run really differs by more than fp32's floor would allow
    assert max(r.error for r in al.rows) > 1e-3
    ref_r, cand_r, x = resnet_pair()
    assert fxdebug.align(Autocast(ref_r), cand_r, (x,)).first_divergent is None

    class Bf16Linear(nn.Linear):  # enters autocast in its own forward: no submodule to hook
        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return super().forward(x).float()

    torch.manual_seed(0)
    plain, low = nn.Linear(64, 64), Bf16Linear(64, 64)
    low.load_state_dict(plain.state_dict())
    al = fxdebug.align(plain, low, (torch.randn(8, 64),))
    assert al.first_divergent is None and al.dtypes == (torch.float32, torch.bfloat16)
    assert fxdebug.align(plain, low, (torch.randn(8, 64),), rtol=1e-6).first_divergent is not None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("bug", list(LLAMA_BUGS))
def test_each_planted_llama_bug_is_named_in_its_module(bug, attn):
    planted, cand_module, ref_module = LLAMA_BUGS[bug]
    ref, cand, ids = llama_pair(planted, attn=attn)
    al = fxdebug.align(ref, cand, (ids,))
    d = al.first_divergent
    assert d is not None, f"{bug}: no divergence found\n{al}"
    assert d.candidate[1].startswith(cand_module), f"{bug}: named {d}"
    assert d.reference[1].startswith(ref_module), f"{bug}: named {d}"
    assert not d.error <= d.tolerance  # nan (ops of other sizes) or beyond the floor
    assert "DIVERGES" in str(al) and d.candidate[0] in str(al)


def test_the_named_op_is_the_planted_one_when_the_reference_has_it():
    """Against eager attention (every intermediate exists in the reference) the op itself is named."""
    cases = {"softmax in bf16": ("_to_copy", "_softmax"), "causal mask off by one": ("masked_fill", "add"),
             "gate/up swapped in layer 1": ("silu", "silu")}
    for bug, (cand_op, ref_op) in cases.items():
        ref, cand, ids = llama_pair(LLAMA_BUGS[bug][0], attn="eager")
        d = fxdebug.align(ref, cand, (ids,)).first_divergent
        assert d is not None and d.op == cand_op, (bug, d)
        assert re.fullmatch(rf"{ref_op}(_\d+)?", str(d.reference[0])), (bug, d)


def test_exact_resnet_pair_matches_slices_of_the_fused_qkv():
    ref, cand, x = resnet_pair()
    torch.testing.assert_close(cand(x), ref(x))
    al = fxdebug.align(ref, cand, (x,))
    assert al.first_divergent is None, al
    kinds = {r.candidate[1]: r.match for r in al.rows if r.op == "mm"}
    # the hand-written q, k, v Linears are slices of the reference's one qkv Linear
    assert kinds["mix.q"] == kinds["mix.k"] == kinds["mix.v"] == "slice of fused"
    qrow = next(r for r in al.rows if r.candidate[1] == "mix.q" and r.op == "mm")
    assert qrow.reference[1] == "attn.qkv"
    # q with its bias added is the first of the reference's three unbound heads-first views
    q = next(r for r in al.rows if r.candidate[1] == "mix.q" and r.op == "add")
    assert q.match == "transposed/reshaped" and q.reference == ("unbind", "attn")
    assert any(r.match == "transposed/reshaped" for r in al.rows)
    conv = next(r for r in al.rows if r.candidate[1] == "stages.1.blocks.0.shortcut.conv")
    assert conv.reference[1] == "layer2.0.downsample.0" and conv.match == "same"


@pytest.mark.parametrize("bug", list(RESNET_BUGS))
def test_each_planted_resnet_bug_is_named_in_its_module(bug):
    planted, cand_module, ref_module = RESNET_BUGS[bug]
    ref, cand, x = resnet_pair(planted)
    d = fxdebug.align(ref, cand, (x,)).first_divergent
    assert d is not None and d.candidate[1].startswith(cand_module), (bug, d)
    assert d.reference[1].startswith(ref_module), (bug, d)


class _Parallel(nn.Module):
    """A parallel block: ``x + attn(x) + mlp(x)``; ``late_sum`` adds the two branches first."""

    def __init__(self, late_sum: bool) -> None:
        super().__init__()
        self.late_sum = late_sum
        self.attn, self.mlp = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        a, m = self.attn(x), torch.tanh(self.mlp(x))
        return x + (a + m) if self.late_sum else (x + a) + m


def test_sum_of_several_and_candidate_inputs_in_another_layout():
    torch.manual_seed(0)
    ref, cand = _Parallel(False), _Parallel(True)
    cand.load_state_dict(ref.state_dict())
    x = torch.randn(3, 16)
    al = fxdebug.align(ref, cand, (x,))
    assert al.first_divergent is None
    summed = [r for r in al.rows if r.match == "sum of several"]
    assert summed and set(summed[0].references) == {("addmm", "attn"), ("tanh", "")}  # a, and m = tanh(mlp(x))

    class Transposed(nn.Module):  # takes its input features-first
        def __init__(self) -> None:
            super().__init__()
            self.inner = _Parallel(False)

        def forward(self, xt):
            return self.inner(xt.t())

    other = Transposed()
    other.inner.load_state_dict(ref.state_dict())
    with pytest.raises(UsageError, match="candidate_inputs"):
        fxdebug.align(ref, other, (x,))
    al = fxdebug.align(ref, other, (x,), candidate_inputs=(x.t().contiguous(),))
    assert al.first_divergent is None
    assert {r.reference[1] for r in al.rows if r.op == "addmm"} == {"attn", "mlp"}


def test_tolerances_and_errors():
    ref, cand, ids = llama_pair(Bug(norm_eps=1e-5))
    al = fxdebug.align(ref, cand, (ids,))
    assert al.first_divergent is not None and al.first_divergent.error < 0.01
    assert fxdebug.align(ref, cand, (ids,), rtol=0.05).first_divergent is None  # a looser tolerance forgives it
    with pytest.raises(ArgumentTypeError, match="instantiate"):
        fxdebug.align(ref, TinyLlama, (ids,))
    with pytest.raises(UsageError, match="rtol"):
        fxdebug.align(ref, cand, (ids,), rtol=-1.0)


def test_runs_leave_the_models_as_they_were():
    ref, cand, x = resnet_pair({"bn_eps": "stages.0.blocks.1.c2.bn"})
    cand.train()
    cand.stages[0].blocks[0].c1.bn.momentum = 0.5
    buffers = {k: v.clone() for k, v in cand.state_dict().items()}
    rng = torch.get_rng_state()
    d = fxdebug.align(ref, cand, (x,)).first_divergent
    assert d is not None and d.candidate[1].startswith("stages.0.blocks.1.c2.bn")  # run in eval mode
    assert cand.training and all(m.training for m in cand.modules()) and not ref.training
    assert all(torch.equal(v, cand.state_dict()[k]) for k, v in buffers.items())
    assert torch.equal(rng, torch.get_rng_state())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in cand.modules())

    class InPlace(nn.Module):  # writes into its input
        def forward(self, x):
            return x.mul_(2).sum(1)

    x = torch.ones(2, 3)
    assert fxdebug.align(InPlace(), InPlace(), (x,)).first_divergent is None
    assert torch.equal(x, torch.ones(2, 3))


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_render_colours_both_graphs(tmp_path):
    ref, cand, ids = llama_pair(LLAMA_BUGS["gate/up swapped in layer 1"][0])
    al = fxdebug.align(ref, cand, (ids,))
    ref_svg, cand_svg = al.render(tmp_path / "pair")
    d = al.first_divergent
    assert f"first divergent node: {d.candidate[0]}" in Path(cand_svg).read_text()
    assert f"first divergent node: {d.reference[0]}" in Path(ref_svg).read_text()
    html = fxdebug.render(al.graph("candidate"), str(tmp_path / "c.html"), diff=al.side("candidate"))
    assert d.candidate[0] in Path(html).read_text()
    scores = al.side("candidate").node_divergence()
    assert math.isinf(scores[d.candidate[0]]) and all(v <= 1 for k, v in scores.items() if k.startswith("t_"))
    # render(..., diff=al) colours whichever of the two recorded graphs it draws
    drawn = fxdebug.render(al.graph("reference"), str(tmp_path / "r.svg"), diff=al)
    assert f"first divergent node: {d.reference[0]}" in Path(drawn).read_text()


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_render_colours_the_models_own_graphs(tmp_path):
    """render(model, diff=al) on each model's own (fxdebug.trace) graph: nodes coloured by module,
    the divergent module's first node highlighted on each side."""
    ref, cand, x = resnet_pair(RESNET_BUGS["missing activation"][0])
    al = fxdebug.align(ref, cand, (x,))
    cand_svg = Path(fxdebug.render(cand, str(tmp_path / "cand.svg"), (x,), diff=al)).read_text()
    ref_svg = Path(fxdebug.render(ref, str(tmp_path / "ref.svg"), (x,), diff=al)).read_text()
    assert "first divergent node: stages_1_blocks_0_c2_conv" in cand_svg
    assert "first divergent node: layer2_0_relu" in ref_svg
    colours = al.for_graph(fxdebug.trace(cand, (x,)))
    assert colours.node_divergence()["stem_conv"] <= 1 and math.isinf(colours.node_divergence()["stages_1_blocks_0_c2_conv"])


def _section(relative: str, heading: str) -> list[str]:
    text = (ROOT / relative).read_text()
    part = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", part, flags=re.S)


def test_numerics_doc_align_section_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    blocks = _section("docs/numerics.md", "## align: two implementations")
    assert blocks
    for block in blocks:
        exec(compile(block.replace("print(", "_ = ("), "numerics.md", "exec"), ns)
    assert ns["al"].first_divergent.candidate == ("gelu", "mlp")
    assert ns["fixed"].first_divergent is None and ns["low"].first_divergent is None

