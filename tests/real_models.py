"""Real-architecture models written in-repo, shaped like torchvision's detection and video models.

torchvision cannot be imported beside torch 2.13 here, and these architectures are exactly where
fxdebug met trouble on the real thing:

* ``TinyFasterRCNN`` follows Faster R-CNN's structure: a transform batching a *list* of images of
  different sizes into one padded tensor, a ResNet-style body whose ``IntermediateLayerGetter``
  returns an ``OrderedDict``, an FPN returning an ``OrderedDict`` of feature maps (with the extra
  ``'pool'`` level from ``F.max_pool2d``), an RPN (anchors, box decoding, per-image top-k and a
  data-dependent filter) and ROI heads (multi-scale ROI pooling over the ``OrderedDict`` and a
  list of proposals, a two-layer box head, per-image post-processing). Its root loops over a list
  and reads tensor values, so neither FX nor ``torch.export`` can capture it: the subtrees
  frontend instruments its parts.
* ``TinySwin3D`` follows Swin3D: patch embedding, shifted-window attention whose window and shift
  are adapted by a ``torch.fx.wrap``-ped helper that *mutates its list arguments*, and the
  attention itself as a wrapped function taking those lists.

Factories return ``(model, example_inputs)`` like ``tests/zoo.py``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TinyFasterRCNN", "TinySwin3D", "detector", "detector_images", "swin3d"]


# -- detector ---------------------------------------------------------------------------------
class ImageList:
    """Padded batch of images plus each image's own size (torchvision's ``ImageList``)."""

    def __init__(self, tensors: Tensor, image_sizes: list[tuple[int, int]]) -> None:
        self.tensors = tensors
        self.image_sizes = image_sizes


class Transform(nn.Module):
    """Normalise each image and pad the list into one batch divisible by ``size_divisible``."""

    def __init__(self, size_divisible: int = 32) -> None:
        super().__init__()
        self.size_divisible = size_divisible
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]))

    def forward(self, images: list[Tensor]) -> ImageList:
        images = [(img - self.mean[:, None, None]) / self.std[:, None, None] for img in images]
        sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
        d = self.size_divisible
        h = int(math.ceil(max(s[0] for s in sizes) / d) * d)
        w = int(math.ceil(max(s[1] for s in sizes) / d) * d)
        batched = images[0].new_zeros(len(images), images[0].shape[0], h, w)
        for i, img in enumerate(images):
            batched[i, :, : img.shape[1], : img.shape[2]].copy_(img)
        return ImageList(batched, sizes)


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.down(x))


class IntermediateLayerGetter(nn.ModuleDict):
    """Runs its children in order and returns the named ones in an ``OrderedDict``."""

    def __init__(self, layers: OrderedDict, return_layers: dict[str, str]) -> None:
        super().__init__(layers)
        self.return_layers = dict(return_layers)

    def forward(self, x: Tensor) -> OrderedDict:
        out = OrderedDict()
        for name, module in self.items():
            x = module(x)
            if name in self.return_layers:
                out[self.return_layers[name]] = x
        return out


class FPN(nn.Module):
    """Feature pyramid: lateral 1x1 convs, top-down nearest upsampling, 3x3 outputs, max-pool level."""

    def __init__(self, in_channels: list[int], out_channels: int) -> None:
        super().__init__()
        self.inner_blocks = nn.ModuleList(nn.Conv2d(c, out_channels, 1) for c in in_channels)
        self.layer_blocks = nn.ModuleList(nn.Conv2d(out_channels, out_channels, 3, padding=1) for _ in in_channels)

    def forward(self, x: OrderedDict) -> OrderedDict:
        names = list(x.keys())
        feats = list(x.values())
        last_inner = self.inner_blocks[-1](feats[-1])
        results = [self.layer_blocks[-1](last_inner)]
        for idx in range(len(feats) - 2, -1, -1):
            lateral = self.inner_blocks[idx](feats[idx])
            top_down = F.interpolate(last_inner, size=lateral.shape[-2:], mode="nearest")
            last_inner = lateral + top_down
            results.insert(0, self.layer_blocks[idx](last_inner))
        names.append("pool")
        results.append(F.max_pool2d(results[-1], 1, 2, 0))
        return OrderedDict([(k, v) for k, v in zip(names, results)])


class BackboneWithFPN(nn.Module):
    def __init__(self, width: int = 8, out_channels: int = 16) -> None:
        super().__init__()
        stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                             nn.MaxPool2d(3, 2, 1))
        layers = OrderedDict([("stem", stem), ("layer1", Block(width, width, 1)),
                              ("layer2", Block(width, 2 * width, 2)), ("layer3", Block(2 * width, 4 * width, 2))])
        self.body = IntermediateLayerGetter(layers, {"layer1": "0", "layer2": "1", "layer3": "2"})
        self.fpn = FPN([width, 2 * width, 4 * width], out_channels)
        self.out_channels = out_channels

    def forward(self, x: Tensor) -> OrderedDict:
        return self.fpn(self.body(x))


class AnchorGenerator(nn.Module):
    """One anchor size per level, three aspect ratios, anchors on every feature-map cell."""

    def __init__(self, sizes: tuple[int, ...] = (16, 32, 64, 128), ratios: tuple[float, ...] = (0.5, 1.0, 2.0)) -> None:
        super().__init__()
        self.sizes = sizes
        self.ratios = ratios

    def cell_anchors(self, size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        ratios = torch.tensor(self.ratios, dtype=dtype, device=device)
        h_ratios = torch.sqrt(ratios)
        ws = size / h_ratios
        hs = size * h_ratios
        return (torch.stack([-ws, -hs, ws, hs], dim=1) / 2).round()

    def forward(self, images: ImageList, features: list[Tensor]) -> list[Tensor]:
        image_size = images.tensors.shape[-2:]
        dtype, device = features[0].dtype, features[0].device
        per_level = []
        for size, feat in zip(self.sizes, features):
            gh, gw = feat.shape[-2:]
            sh, sw = image_size[0] // gh, image_size[1] // gw
            ys = torch.arange(gh, dtype=dtype, device=device) * sh
            xs = torch.arange(gw, dtype=dtype, device=device) * sw
            yy, xx = torch.meshgrid(ys, xs, indexing="ij")
            shifts = torch.stack([xx.reshape(-1), yy.reshape(-1), xx.reshape(-1), yy.reshape(-1)], dim=1)
            base = self.cell_anchors(size, dtype, device)
            per_level.append((shifts[:, None, :] + base[None, :, :]).reshape(-1, 4))
        anchors = torch.cat(per_level)
        return [anchors for _ in range(images.tensors.shape[0])]


class RPNHead(nn.Module):
    def __init__(self, channels: int, anchors: int = 3) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU())
        self.cls_logits = nn.Conv2d(channels, anchors, 1)
        self.bbox_pred = nn.Conv2d(channels, anchors * 4, 1)

    def forward(self, x: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        logits, deltas = [], []
        for feature in x:
            t = self.conv(feature)
            logits.append(self.cls_logits(t))
            deltas.append(self.bbox_pred(t))
        return logits, deltas


def decode_boxes(deltas: Tensor, boxes: Tensor) -> Tensor:
    """Box-coder decoding of (dx, dy, dw, dh) against reference boxes."""
    widths = boxes[:, 2] - boxes[:, 0]
    heights = boxes[:, 3] - boxes[:, 1]
    cx = boxes[:, 0] + 0.5 * widths
    cy = boxes[:, 1] + 0.5 * heights
    dx, dy = deltas[:, 0], deltas[:, 1]
    dw = deltas[:, 2].clamp(max=math.log(1000.0 / 16))
    dh = deltas[:, 3].clamp(max=math.log(1000.0 / 16))
    pcx, pcy = dx * widths + cx, dy * heights + cy
    pw, ph = torch.exp(dw) * widths, torch.exp(dh) * heights
    return torch.stack([pcx - 0.5 * pw, pcy - 0.5 * ph, pcx + 0.5 * pw, pcy + 0.5 * ph], dim=1)


def clip_boxes(boxes: Tensor, size: tuple[int, int]) -> Tensor:
    h, w = size
    x = boxes[..., 0::2].clamp(0, w)
    y = boxes[..., 1::2].clamp(0, h)
    return torch.stack([x[..., 0], y[..., 0], x[..., 1], y[..., 1]], dim=-1)


class RegionProposalNetwork(nn.Module):
    def __init__(self, channels: int, pre_nms_top_n: int = 64, post_top_n: int = 16, min_size: float = 1.0) -> None:
        super().__init__()
        self.anchor_generator = AnchorGenerator()
        self.head = RPNHead(channels)
        self.pre_nms_top_n = pre_nms_top_n
        self.post_top_n = post_top_n
        self.min_size = min_size

    def forward(self, images: ImageList, features: OrderedDict) -> list[Tensor]:
        feats = list(features.values())[: len(self.anchor_generator.sizes)]
        objectness, deltas = self.head(feats)
        anchors = self.anchor_generator(images, feats)
        n = len(anchors)
        obj = torch.cat([o.permute(0, 2, 3, 1).reshape(n, -1) for o in objectness], dim=1)
        reg = torch.cat([d.reshape(n, -1, 4, d.shape[-2], d.shape[-1]).permute(0, 3, 4, 1, 2).reshape(n, -1, 4)
                         for d in deltas], dim=1)
        proposals = decode_boxes(reg.reshape(-1, 4), torch.cat(anchors)).reshape(n, -1, 4)
        out = []
        for i in range(n):
            scores, order = obj[i].topk(min(self.pre_nms_top_n, obj.shape[1]))
            boxes = clip_boxes(proposals[i][order], images.image_sizes[i])
            wide = (boxes[:, 2] - boxes[:, 0] >= self.min_size) & (boxes[:, 3] - boxes[:, 1] >= self.min_size)
            keep = int(wide.sum())  # data-dependent: how many boxes survive
            boxes = boxes[wide][: min(keep, self.post_top_n)]
            out.append(boxes)
        return out


class MultiScaleRoIPool(nn.Module):
    """Bilinear ROI pooling from the FPN level matching each box's size (torchvision's MultiScaleRoIAlign)."""

    def __init__(self, featmap_names: list[str], output_size: int = 4) -> None:
        super().__init__()
        self.featmap_names = featmap_names
        self.output_size = output_size

    def forward(self, x: OrderedDict, boxes: list[Tensor], image_shapes: list[tuple[int, int]]) -> Tensor:
        feats = [x[k] for k in self.featmap_names]
        rois = torch.cat([torch.cat([b.new_full((b.shape[0], 1), float(i)), b], dim=1) for i, b in enumerate(boxes)])
        image_h = max(s[0] for s in image_shapes)
        areas = (rois[:, 3] - rois[:, 1]) * (rois[:, 4] - rois[:, 2])
        levels = torch.floor(4 + torch.log2(torch.sqrt(areas.clamp(min=1e-6)) / 224 + 1e-6)).clamp(2, 5) - 2
        s = self.output_size
        steps = (torch.arange(s, dtype=rois.dtype, device=rois.device) + 0.5) / s
        result = rois.new_zeros(rois.shape[0], feats[0].shape[1], s, s)
        for level, feat in enumerate(feats):
            scale = feat.shape[-2] / (math.ceil(image_h / 32) * 32)
            fh, fw = feat.shape[-2:]
            x0, y0, x1, y1 = (rois[:, 1:] * scale).unbind(1)
            gx = x0[:, None] + (x1 - x0)[:, None] * steps[None, :]
            gy = y0[:, None] + (y1 - y0)[:, None] * steps[None, :]
            grid = torch.stack([gx[:, None, :].expand(-1, s, -1) / fw * 2 - 1,
                                gy[:, :, None].expand(-1, -1, s) / fh * 2 - 1], dim=-1)
            per_box = feat.index_select(0, rois[:, 0].long())
            pooled = F.grid_sample(per_box, grid, mode="bilinear", align_corners=False)
            result = torch.where((levels == level)[:, None, None, None], pooled, result)
        return result


class TwoMLPHead(nn.Module):
    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.fc6 = nn.Linear(in_features, hidden)
        self.fc7 = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.fc7(F.relu(self.fc6(x.flatten(start_dim=1)))))


class FastRCNNPredictor(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.cls_score = nn.Linear(hidden, classes)
        self.bbox_pred = nn.Linear(hidden, classes * 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.cls_score(x), self.bbox_pred(x)


class RoIHeads(nn.Module):
    def __init__(self, channels: int, classes: int = 5, hidden: int = 32, score_thresh: float = 0.05) -> None:
        super().__init__()
        self.box_roi_pool = MultiScaleRoIPool(["0", "1", "2"], 4)
        self.box_head = TwoMLPHead(channels * 16, hidden)
        self.box_predictor = FastRCNNPredictor(hidden, classes)
        self.score_thresh = score_thresh

    def forward(self, features: OrderedDict, proposals: list[Tensor], image_shapes: list[tuple[int, int]]) -> list[dict]:
        pooled = self.box_roi_pool(features, proposals, image_shapes)
        logits, deltas = self.box_predictor(self.box_head(pooled))
        classes = logits.shape[-1]
        boxes = decode_boxes(deltas.reshape(-1, 4), torch.cat(proposals).repeat_interleave(classes, dim=0))
        boxes = boxes.reshape(-1, classes, 4)
        scores = F.softmax(logits, -1)
        out = []
        for b, s, shape in zip(boxes.split([len(p) for p in proposals]), scores.split([len(p) for p in proposals]),
                               image_shapes):
            b = clip_boxes(b[:, 1:], shape).reshape(-1, 4)
            s = s[:, 1:].reshape(-1)
            labels = torch.arange(1, classes, device=s.device).repeat(len(s) // (classes - 1))
            keep = torch.nonzero(s > self.score_thresh).squeeze(1)
            out.append({"boxes": b[keep], "scores": s[keep], "labels": labels[keep]})
        return out


class TinyFasterRCNN(nn.Module):
    """Faster R-CNN's shape at toy size: list of images in, list of detection dicts out."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.transform = Transform()
        self.backbone = BackboneWithFPN()
        self.rpn = RegionProposalNetwork(self.backbone.out_channels)
        self.roi_heads = RoIHeads(self.backbone.out_channels, classes)

    def forward(self, images: list[Tensor]) -> list[dict]:
        original_sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
        batch = self.transform(images)
        features = self.backbone(batch.tensors)
        if isinstance(features, Tensor):
            features = OrderedDict([("0", features)])
        proposals = self.rpn(batch, features)
        detections = self.roi_heads(features, proposals, batch.image_sizes)
        for det, now, orig in zip(detections, batch.image_sizes, original_sizes):
            ratio = torch.tensor([orig[1] / now[1], orig[0] / now[0]] * 2)
            det["boxes"] = det["boxes"] * ratio
        return detections


def detector_images(sizes: tuple[tuple[int, int], ...] = ((60, 80), (72, 64))) -> list[Tensor]:
    return [torch.rand(3, h, w) for h, w in sizes]


def detector() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = TinyFasterRCNN().eval()
    return model, (detector_images(),)


# -- Swin3D-style video transformer -----------------------------------------------------------
def _get_window_and_shift_size(shift_size: list[int], size_dhw: list[int], window_size: list[int]
                               ) -> tuple[list[int], list[int]]:
    """Shrink the window to the input where the input is smaller; mutates its list arguments."""
    for i in range(3):
        if size_dhw[i] <= window_size[i]:
            window_size[i] = size_dhw[i]
            shift_size[i] = 0
    return window_size, shift_size


torch.fx.wrap("_get_window_and_shift_size")


def _relative_bias(table: Tensor, index: Tensor, window_size: list[int]) -> Tensor:
    vol = window_size[0] * window_size[1] * window_size[2]
    bias = table[index[:vol, :vol].flatten()].view(vol, vol, -1)
    return bias.permute(2, 0, 1).contiguous().unsqueeze(0)


torch.fx.wrap("_relative_bias")


def _window_attention_3d(x: Tensor, qkv: nn.Linear, proj: nn.Linear, bias: Tensor, window_size: list[int],
                         shift_size: list[int], heads: int) -> Tensor:
    """Pad to whole windows, shift, attend within each window, shift back, unpad."""
    b, t, h, w, c = x.shape
    pad = [(window_size[i] - s % window_size[i]) % window_size[i] for i, s in enumerate((t, h, w))]
    x = F.pad(x, (0, 0, 0, pad[2], 0, pad[1], 0, pad[0]))
    _, tp, hp, wp, _ = x.shape
    if sum(shift_size) > 0:
        x = torch.roll(x, shifts=tuple(-s for s in shift_size), dims=(1, 2, 3))
    wd, wh, ww = window_size
    nw = (tp // wd) * (hp // wh) * (wp // ww)
    x = x.view(b, tp // wd, wd, hp // wh, wh, wp // ww, ww, c).permute(0, 1, 3, 5, 2, 4, 6, 7)
    x = x.reshape(b * nw, wd * wh * ww, c)
    q, k, v = qkv(x).reshape(x.shape[0], x.shape[1], 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    attn = (q * (c // heads) ** -0.5) @ k.transpose(-2, -1) + bias
    x = (attn.softmax(-1) @ v).transpose(1, 2).reshape(b * nw, wd * wh * ww, c)
    x = proj(x).view(b, tp // wd, hp // wh, wp // ww, wd, wh, ww, c).permute(0, 1, 4, 2, 5, 3, 6, 7)
    x = x.reshape(b, tp, hp, wp, c)
    if sum(shift_size) > 0:
        x = torch.roll(x, shifts=tuple(shift_size), dims=(1, 2, 3))
    return x[:, :t, :h, :w, :].contiguous()


torch.fx.wrap("_window_attention_3d")


class ShiftedWindowAttention3d(nn.Module):
    def __init__(self, dim: int, window_size: list[int], shift_size: list[int], heads: int) -> None:
        super().__init__()
        self.window_size, self.shift_size, self.heads = window_size, shift_size, heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        vol = (2 * window_size[0] - 1) * (2 * window_size[1] - 1) * (2 * window_size[2] - 1)
        self.relative_position_bias_table = nn.Parameter(torch.randn(vol, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(*[torch.arange(s) for s in window_size], indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        for i in range(3):
            rel[:, :, i] += window_size[i] - 1
        rel[:, :, 0] *= (2 * window_size[1] - 1) * (2 * window_size[2] - 1)
        rel[:, :, 1] *= 2 * window_size[2] - 1
        self.register_buffer("relative_position_index", rel.sum(-1))

    def forward(self, x: Tensor) -> Tensor:
        _, t, h, w, _ = x.shape
        size_dhw = [t, h, w]
        window_size, shift_size = self.window_size.copy(), self.shift_size.copy()
        window_size, shift_size = _get_window_and_shift_size(shift_size, size_dhw, window_size)
        bias = _relative_bias(self.relative_position_bias_table, self.relative_position_index, window_size)
        return _window_attention_3d(x, self.qkv, self.proj, bias, window_size, shift_size, self.heads)


class SwinBlock3d(nn.Module):
    def __init__(self, dim: int, heads: int, window_size: list[int], shift_size: list[int]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ShiftedWindowAttention3d(dim, window_size, shift_size, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinySwin3D(nn.Module):
    """Swin3D at toy size: patch embedding, two blocks (plain and shifted windows), pooled head."""

    def __init__(self, dim: int = 16, heads: int = 2, classes: int = 4, window: tuple[int, int, int] = (2, 4, 4)) -> None:
        super().__init__()
        self.patch = nn.Conv3d(3, dim, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        win = list(window)
        self.features = nn.Sequential(
            nn.Sequential(SwinBlock3d(dim, heads, win, [0, 0, 0]), SwinBlock3d(dim, heads, win, [w // 2 for w in win])))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch(x).permute(0, 2, 3, 4, 1)
        x = self.norm(self.features(x))
        return self.head(x.mean(dim=(1, 2, 3)))


def swin3d() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    # 2 frames of 16x16: the temporal window (2) meets the input size (1 after patching), so the
    # helper shrinks the window and zeroes that shift, as on short clips.
    return TinySwin3D().eval(), (torch.randn(1, 3, 2, 16, 16),)
