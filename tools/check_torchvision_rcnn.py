"""Issue 34's done-when on real torchvision R-CNNs, outside CI (torchvision does not import beside torch 2.13):

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 networkx graphviz numpy
    /tmp/tv/bin/pip install --no-deps . && /tmp/tv/bin/python tools/check_torchvision_rcnn.py [model names]

Random weights, no download: ShapeAssert + NaNCheck + StatCollector on the live capture, two calls bitwise equal
to eager (a false ShapeMismatchError from two call sites of one box helper would raise), rows per call site."""
import sys, time, torch
import fxdebug
from fxdebug.passes import NaNCheck, ShapeAssert, StatCollector
from torchvision.models import detection as D

torch.manual_seed(0)
names = sys.argv[1:] or ["fasterrcnn_resnet50_fpn", "maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn"]
for name in names:
    model = getattr(D, name)(weights=None, weights_backbone=None, min_size=128, max_size=128).eval()
    imgs = [torch.rand(3, 128, 128)]
    t = time.process_time()
    with torch.no_grad():
        ref1 = model(imgs); ref2 = model(imgs)
        dbg = fxdebug.instrument(model, [ShapeAssert(), NaNCheck(), StatCollector()], example_inputs=(imgs,))
        t_inst = time.process_time() - t
        out1 = dbg(imgs); out2 = dbg(imgs)
    same = all(torch.equal(a[k], b[k]) for o, r in ((out1, ref1), (out2, ref2)) for a, b in zip(o, r) for k in a)
    rows = dbg.report().rows
    helper_rows = [r["node"] for r in rows if "box" in r["node"] and ("clip" in r["node"] or "decode" in r["node"])]
    print(f"{name}: instrument {t_inst:.1f}s, bitwise={same}, rows={len(rows)}, parts={len(dbg.parts())}, "
          f"box-helper rows e.g. {helper_rows[:4]}, notes={len(dbg.report().notes)}", flush=True)
