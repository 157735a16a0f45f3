"""Row identity = call site (issue 34, item 1): a helper behind a graph break is one Dynamo frame, whichever
call site runs it; the live report still gives each site its own rows, and ShapeAssert checks a site against
that site's own earlier shapes.

The R-CNN pattern (torchvision's box helpers, called from the box head and the mask head on (N, 4) and
(N, 5) tensors) is rebuilt here in a few lines: torchvision does not import with this torch.
"""

import copy

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector


def clip_boxes(boxes):
    torch._dynamo.graph_break()  # torchvision's box ops break the graph (data-dependent, Python-side)
    return boxes.clamp(min=0.0) * 2.0


class TwoWidths(nn.Module):
    """One forward, one helper, two call sites: a width-4 and a width-5 tensor."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(3, 5)

    def forward(self, x):
        return clip_boxes(self.a(x)).sum(-1) + clip_boxes(self.b(x)).sum(-1)


class SameWidth(nn.Module):
    """The helper at two sites with the same width: two tensors of different values."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)

    def forward(self, x):
        first = clip_boxes(self.a(x))
        second = clip_boxes(self.a(x) + 100.0)
        return first + second


class Head(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(8, width)

    def forward(self, feats):
        return clip_boxes(self.fc(feats)).relu()


class MiniRCNN(nn.Module):
    """A box head on (N, 4) boxes and a mask head on (N, 5) boxes, both through one box helper."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(8, 8)
        self.box_head, self.mask_head = Head(4), Head(5)

    def forward(self, x):
        feats = self.backbone(x).relu()
        return self.box_head(feats).sum(-1) + self.mask_head(feats).mean(-1)


def _rows(dbg):
    return {r["node"]: r for r in dbg.report().rows}


def _bitwise(dbg, model, ref, *args):
    out = dbg(*args)
    assert torch.equal(out, ref(*args))
    return out


def test_two_widths_one_helper_no_false_shape_error_and_two_rows():
    torch.manual_seed(0)
    model = TwoWidths()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [ShapeAssert(), StatCollector()], frontend="dynamo")
    x = torch.randn(2, 3)
    for _ in range(2):  # the old key raised ShapeMismatchError "(N, 5); expected (N, 4)" at the second site
        _bitwise(dbg, model, ref, x)
    rows = dbg.report().rows
    muls = [r for r in rows if r["op"].endswith("mul")]
    assert sorted(tuple(r["shape"]) for r in muls) == [(2, 4), (2, 5)]
    assert all(r["calls"] == 2 for r in muls)  # each site once per call, twice in all
    line = clip_boxes.__code__.co_firstlineno + 1
    assert any(f"graph break at test_call_sites.py:{line} in clip_boxes" in n and "eagerly" in n
               for n in dbg.report().notes)  # the stretch that ran eagerly: file:line, function, reason


def test_same_width_two_sites_keep_their_own_statistics():
    torch.manual_seed(0)
    model = SameWidth()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [StatCollector()], frontend="dynamo")
    x = torch.randn(6, 3)
    _bitwise(dbg, model, ref, x)
    _bitwise(dbg, model, ref, x)
    muls = [r for r in dbg.report().rows if r["op"].endswith("mul")]
    assert len(muls) == 2  # merged into one row before
    means = sorted(r["mean"] for r in muls)
    assert means[1] > 100 > means[0]  # the second site's tensor is ~+200 (clamp, *2): its own row says so
    assert all(r["calls"] == 2 for r in muls)


def test_rcnn_pattern_box_and_mask_heads_rows_per_head_stable_across_calls_and_modes():
    torch.manual_seed(0)
    model = MiniRCNN()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], frontend="dynamo")
    x = torch.randn(5, 8)
    first = _bitwise(dbg, model, ref, x)
    second = _bitwise(dbg, model, ref, x)
    assert torch.equal(first, second)
    rows = _rows(dbg)
    names = set(rows)
    helper = {n: r for n, r in rows.items() if r["op"].endswith("clamp")}
    assert {r["module"] for r in helper.values()} == {"box_head", "mask_head"}
    assert {r["module"]: tuple(r["shape"]) for r in helper.values()} == {"box_head": (5, 4), "mask_head": (5, 5)}
    # a head's own frame (Dynamo compiles its forward on its own after the break) is attributed to the head
    assert {"box_head_fc", "mask_head_fc"} <= names
    assert rows["box_head_fc"]["module"] == "box_head.fc" and tuple(rows["mask_head_fc"]["shape"]) == (5, 5)
    dbg.eval()
    ref.eval()
    _bitwise(dbg, model, ref, x)  # a recompile (the training flag): the same rows, not new ones
    dbg.train()
    ref.train()
    _bitwise(dbg, model, ref, torch.randn(7, 8))  # another N: still the same rows, no false mismatch
    report = dbg.report()
    assert {r["node"] for r in report.rows} == names
    assert report.calls == 4
    assert all(r["calls"] == 4 for r in report.rows if r["node"] in helper)


def test_shape_assert_still_checks_each_site_against_its_own_shape():
    torch.manual_seed(0)
    model = MiniRCNN()
    dbg = fxdebug.instrument(model, [ShapeAssert()], frontend="dynamo")
    x = torch.randn(5, 8)
    dbg(x)
    dbg(torch.randn(3, 8))  # the batch dim may vary
    model.box_head.fc = nn.Linear(8, 5)  # the box head's boxes now have the mask head's width: a real change there
    with pytest.raises(fxdebug.ShapeMismatchError, match=r"\(N, 5\); expected \(N, 4\)"):
        dbg(x)


def test_helper_in_a_loop_each_occurrence_its_own_row():
    torch.manual_seed(0)

    class Levels(nn.Module):
        """An FPN-like loop: one helper per level, each level its own width."""

        def __init__(self):
            super().__init__()
            self.levels = nn.ModuleList(nn.Linear(3, w) for w in (2, 3, 4))

        def forward(self, x):
            out = []
            for level in self.levels:
                out.append(clip_boxes(level(x)).sum(-1))
            return torch.stack(out).sum(0)

    model = Levels()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [ShapeAssert(), StatCollector()], frontend="dynamo")
    x = torch.randn(2, 3)
    _bitwise(dbg, model, ref, x)
    _bitwise(dbg, model, ref, x)
    shapes = sorted(tuple(r["shape"]) for r in dbg.report().rows if r["op"].endswith("mul"))
    assert shapes == [(2, 2), (2, 3), (2, 4)]


@pytest.mark.parametrize("save", [False, True])
def test_site_names_survive_a_copy_or_save(save, tmp_path):
    torch.manual_seed(0)
    model = MiniRCNN()
    dbg = fxdebug.instrument(model, [StatCollector()], frontend="dynamo")
    x = torch.randn(5, 8)
    dbg(x)
    before = {r["node"] for r in dbg.report().rows}
    if save:
        torch.save(dbg, tmp_path / "m.pt")
        again = torch.load(tmp_path / "m.pt", weights_only=False)
    else:
        again = fxdebug.instrument(copy.deepcopy(model), [StatCollector()], frontend="dynamo")
    again(x)
    assert {r["node"] for r in again.report().rows} == before


def test_a_module_called_before_and_after_a_graph_break_is_two_places():
    torch.manual_seed(0)

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            first = self.a(x)
            torch._dynamo.graph_break()
            return first + self.a(first * 10.0)

    model = Shared()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [StatCollector()], frontend="dynamo")
    x = torch.randn(3, 4)
    _bitwise(dbg, model, ref, x)
    _bitwise(dbg, model, ref, x)
    rows = [r for r in dbg.report().rows if r["module"] == "a"]
    assert len(rows) == 2 and all(r["calls"] == 2 for r in rows)  # one row with 4 calls before


def test_faster_rcnn_shaped_detector_each_box_helper_call_its_own_rows():
    """tests/real_models.py's detector: clip_boxes/decode_boxes run behind graph breaks from the RPN (once per
    image) and from the ROI heads; the RPN's and ROI heads' forwards are skipped by Dynamo (a data-dependent
    step in a loop) and said so."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from real_models import RegionProposalNetwork, RoIHeads, detector

    torch.manual_seed(0)
    model, (images,) = detector()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], frontend="dynamo")
    for _ in range(2):
        got, want = dbg(images), ref(images)
        assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want) for k in w)
    report = dbg.report()
    stacks = {r["module"]: tuple(r["shape"]) for r in report.rows if r["node"].endswith("clip_boxes_stack")}
    assert set(stacks) == {"rpn", "roi_heads"}
    names = {r["node"] for r in report.rows}
    assert {"rpn_clip_boxes_stack", "rpn_clip_boxes_1_stack", "roi_heads_clip_boxes_stack"} <= names  # per image
    for cls in (RegionProposalNetwork, RoIHeads):
        line = f"real_models.py:{cls.forward.__code__.co_firstlineno}"
        assert any(f"skipped frame forward ({line})" in n and "graph break in loop" in n for n in report.notes)
    assert not any("could not tell a value from the captures' rows" in n for n in report.notes)  # nothing merged


def test_a_helper_in_a_long_loop_shares_rows_past_the_cap_and_says_so():
    from fxdebug.capture.dynamo_sites import MAX_OCCURRENCES

    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            y = self.fc(x)
            total = y
            for _ in range(MAX_OCCURRENCES + 3):
                total = total + clip_boxes(y)
            return total

    torch.manual_seed(0)
    model = Many()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [StatCollector()], frontend="dynamo")
    x = torch.randn(2, 3)
    assert torch.equal(dbg(x), ref(x))
    report = dbg.report()
    muls = [r for r in report.rows if r["op"].endswith("mul")]
    assert len(muls) == MAX_OCCURRENCES + 1
    assert max(r["calls"] for r in muls) == 3  # the 33rd..35th calls share the last row
    assert any(f"more than {MAX_OCCURRENCES} times" in n for n in report.notes)


def test_a_resume_function_s_inputs_and_builtin_named_ops_are_their_own_rows():
    """After a graph break the resume function's ``x`` is the local's value there (a's output), not the model's input
    ``x``; and two frames' ``.sum()`` ops (FX renames a builtin's name) are two rows."""
    torch.manual_seed(0)

    class Rebinds(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            s = x.sum()
            x = self.a(x) + 10.0
            torch._dynamo.graph_break()
            return x * 2 + x.sum() + s

    model = Rebinds()
    ref = copy.deepcopy(model)
    dbg = fxdebug.instrument(model, [ShapeAssert(), StatCollector()], frontend="dynamo")
    x = torch.randn(3, 4)
    for _ in range(3):
        _bitwise(dbg, model, ref, x)
    rows = {r["node"]: r for r in dbg.report().rows}
    assert rows["x"]["calls"] == 3  # the input, once per call (it was 6: the resume function's x merged in)
    inputs = [r for n, r in rows.items() if n.startswith("x_") and r["op"] == "placeholder"]
    assert len(inputs) == 1 and inputs[0]["calls"] == 3  # a's output + 10, its own row
    sums = [r for r in rows.values() if r["op"].endswith("sum")]
    assert len(sums) == 2 and all(r["calls"] == 3 for r in sums)


def test_a_frame_whose_code_holds_an_unhashable_constant_is_still_placed():
    # code Dynamo generates may carry a dict among its constants (torchvision's Mask R-CNN, paste_masks_in_image):
    # such a code object cannot be a dict key, and the site look-up raised "unhashable type: 'dict'" mid-call
    from fxdebug.capture import dynamo_sites

    def helper():
        return 1

    code = helper.__code__.replace(co_consts=(*helper.__code__.co_consts, {"a": 1}))
    with pytest.raises(TypeError):
        hash(code)
    kind, (file, function), base, ours = dynamo_sites._cached_info(code)
    assert function == "helper" and base == "test_call_sites.py" and not ours
