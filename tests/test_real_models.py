"""Real architectures (tests/real_models.py): a Faster R-CNN-shaped detector and Swin3D-style attention.

Both failed on the torchvision originals: the detector at call time, because a captured part was
fed the FPN's feature maps in a container whose pytree spec differed from the captured one, and
Swin3D in the example run, because a ``torch.fx.wrap``-ped helper mutated FX's immutable list.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.fx

import fxdebug
from fxdebug.passes import NaNCheck, StatCollector
from real_models import detector, swin3d


def _same_detections(a, b) -> None:
    assert len(a) == len(b)
    for da, db in zip(a, b):
        assert list(da) == list(db)
        for key in da:
            assert torch.equal(da[key], db[key]), key


def test_detector_runs_bitwise_equal_on_its_example_inputs():
    model, (images,) = detector()
    with torch.no_grad():
        expected = model(images)
    # the subtrees capture's parts (fed the FPN's maps in another container) are the subject: pinned
    dbg = fxdebug.instrument(model, [StatCollector(), NaNCheck(mode="record")], example_inputs=(images,),
                             frontend="subtrees")
    assert dbg.trace_info.frontend == "subtrees"
    assert {"backbone", "roi_heads"} <= set(dbg.trace_info.captured)
    with torch.no_grad():
        got = dbg(images)
    _same_detections(got, expected)
    rows = dbg.report().rows
    assert any(r["node"].startswith("backbone/") for r in rows)
    assert any(r["node"].startswith("roi_heads/") for r in rows)


def test_symbolic_part_keeps_the_ordered_dict_the_model_returns():
    model, (images,) = detector()
    batch = model.transform(images).tensors
    dbg = fxdebug.trace(model.backbone, (batch,), frontend="symbolic")
    with torch.no_grad():
        got, want = dbg(batch), model.backbone(batch)
    assert type(got) is OrderedDict and list(got) == list(want) == ["0", "1", "2", "pool"]
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_export_part_takes_a_plain_dict_where_it_was_captured_with_an_ordered_dict():
    model, (images,) = detector()
    with torch.no_grad():
        batch = model.transform(images)
        features = model.backbone(batch.tensors)
        proposals = model.rpn(batch, features)
        want = model.roi_heads.box_roi_pool(features, proposals, batch.image_sizes)
        part = fxdebug.trace(model.roi_heads.box_roi_pool, (features, proposals, batch.image_sizes),
                             frontend="export")
        got = part(dict(features), proposals, batch.image_sizes)
    assert torch.equal(got, want)


def test_swin3d_wrapped_helper_may_mutate_its_list_arguments():
    model, (x,) = swin3d()
    with torch.no_grad():
        want = model(x)
        assert torch.equal(torch.fx.symbolic_trace(model)(x), want)  # plain FX handles it
        # symbolic tracing's torch.fx.wrap-ped helper is the subject: pinned
        dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="symbolic")
        assert dbg.trace_info.frontend == "symbolic"
        assert torch.equal(dbg(x), want)
        assert torch.equal(dbg(x), want)  # the model's own window lists are untouched by the calls
    assert model.features[0][0].attn.window_size == [2, 4, 4]
    helpers = [n for n in dbg.graph.nodes if n.op == "call_function"
               and getattr(n.target, "__name__", "") == "_get_window_and_shift_size"]
    assert len(helpers) == 2
    assert any(r["module"] == "features.0.1.attn" for r in dbg.report().rows)


def test_where_names_root_paths_inside_captured_parts():
    model, (images,) = detector()
    dbg = fxdebug.instrument(model, [StatCollector(where="backbone.body.*")], example_inputs=(images,),
                             frontend="subtrees")  # observers named `part/node`: the subtrees capture's
    observed = list(dbg.observers())
    assert observed and all(name.startswith("backbone/") for name in observed)
    with torch.no_grad():
        _same_detections(dbg(images), model(images))
