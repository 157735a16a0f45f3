"""Batch-norm folding computed in the graph, for graphs that read the model's state live (Dynamo's).

A live capture (``frontend="dynamo"``) calls layers as functions on the model's own parameters and
buffers (``torch.conv2d(x, conv.weight, conv.bias, ...)`` then ``F.batch_norm(h, bn.running_mean,
...)``), read afresh at every call. Folding into a *copy* of the layer would freeze the weights of the
moment ``instrument()`` ran: a ``load_state_dict``, an optimizer step or a change of the running
statistics would be lost. So the fold is part of the graph: two small nodes compute the folded weight
and bias from the live reads on every call, and one layer call uses them in place of the pair. It
costs a per-channel scale of the weights per call (no activation is touched twice) and gradients flow
into the conv's weight and the batch-norm's affine parameters as they would through the pair.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import GraphModule, Node

from fxdebug.authoring import get_attr

__all__ = ["LIVE_BATCH_NORMS", "folded_bias", "folded_value", "folded_weight", "live_batch_norm_reads", "live_fold_of"]

# functional batch-norm calls as Dynamo records them (nn.BatchNorm*d.forward inlined): input, running_mean,
# running_var, weight, bias, training, momentum, eps
LIVE_BATCH_NORMS = (F.batch_norm,)
_ORDER = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


def live_batch_norm_reads(node: Node) -> dict[str, Any] | None:
    """``{argument name: value}`` of a functional batch-norm call, or ``None`` for another op."""
    if node.op != "call_function" or node.target not in LIVE_BATCH_NORMS:
        return None
    out: dict[str, Any] = dict(_DEFAULTS)
    out.update(zip(_ORDER, node.args))
    out.update(node.kwargs)
    return out


def _scale(var: Tensor, gamma: Tensor | None, eps: float, dtype: torch.dtype) -> Tensor:
    scale = torch.rsqrt(var.to(dtype) + eps)
    return scale * gamma.to(dtype) if gamma is not None else scale


def folded_weight(weight: Tensor, var: Tensor, gamma: Tensor | None, eps: float, transpose_groups: int = 0) -> Tensor:
    """``weight`` scaled per output channel by ``gamma / sqrt(var + eps)``; ``transpose_groups`` > 0 for a
    conv-transpose (its output channels are dim 1 within each group). Computed in at least float32."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    scale = _scale(var, gamma, eps, dtype)
    w = weight.to(dtype)
    if transpose_groups:
        g = transpose_groups
        shaped = w.reshape(g, w.shape[0] // g, w.shape[1], *w.shape[2:])
        w = (shaped * scale.reshape(g, 1, -1, *([1] * (w.dim() - 2)))).reshape(w.shape)
    else:
        w = w * scale.reshape(-1, *([1] * (w.dim() - 1)))
    return w.to(weight.dtype)


def folded_bias(bias: Tensor | None, mean: Tensor, var: Tensor, gamma: Tensor | None, beta: Tensor | None,
                eps: float, like: Tensor) -> Tensor:
    """``(bias - mean) * gamma / sqrt(var + eps) + beta`` in ``like``'s dtype (the layer's weight)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    scale = _scale(var, gamma, eps, dtype)
    b = (bias.to(dtype) if bias is not None else torch.zeros_like(mean, dtype=dtype)) - mean.to(dtype)
    out = b * scale
    if beta is not None:
        out = out + beta.to(dtype)
    return out.to(like.dtype)


def live_fold_of(node: Any) -> Node | None:
    """The model's weight read behind ``node`` when ``node`` is a fold's ``folded_weight`` call, else ``None``.

    A pass after ``Fuse`` that ranks or masks layer weights (``PruneMasks``) sees a folded layer through it: the
    layer computes with the folded weight, as the snapshot's fused copy does, so that is what it ranks and masks."""
    if isinstance(node, Node) and node.op == "call_function" and node.target is folded_weight and node.args:
        read = node.args[0]
        return read if isinstance(read, Node) and read.op == "get_attr" else None
    return None


def folded_value(gm: GraphModule, node: Node) -> Tensor:
    """What a ``folded_weight`` node of ``gm`` computes now, from the model's parameters and buffers as they are."""
    weight, var, gamma, eps, groups = (get_attr(gm, str(a.target)) if isinstance(a, Node) else a for a in node.args)
    return folded_weight(weight, var, gamma, eps, groups).detach()
