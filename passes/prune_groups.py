"""Coupled output channels for structured pruning, computed on the graph with networkx.

Pruning output channel ``c`` of a conv zeroes it — but only if everything that lands in the same
position stays zero too. Channels are *coupled* when values of two producers meet elementwise:
the two branches of a residual add, the operands of a mul, and a batch-norm that follows (whose
``weight``/``bias`` at ``c`` must be zeroed with the conv). Concatenation along the channel axis
does not couple its inputs, it lines them up: channel ``k`` of the result is channel ``k - off``
of one input, so a later add couples each part with the right slice.

Each tensor in the graph gets a list of channel ids along its channel axis (or ``None`` when
unknown). Ids are ``("w", module path, c)`` for prunable layers; values that come from anything
fxdebug cannot prune (inputs, excluded layers, opaque ops) meeting a prunable channel
elementwise add a ``("pin", ...)`` id, and a group holding a pin is never pruned. The groups are
the connected components of the resulting graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from fxdebug.authoring import PassContext, get_module, is_relu

__all__ = ["ChannelGroups", "channel_groups"]

ChannelId = tuple[Any, ...]
Info = tuple[int, list[ChannelId]]  # (channel axis, ids along it)

_UNARY_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.ELU, nn.Hardswish, nn.Mish,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
_UNARY_FUNCS = {
    F.leaky_relu, F.gelu, F.silu, F.elu, F.relu6, F.hardswish, F.dropout, torch.sigmoid, torch.tanh,
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, torch.clone,
}
_UNARY_METHODS = {"sigmoid", "tanh", "contiguous", "clone", "sigmoid_", "tanh_"}
_ADD = {operator.add, operator.iadd, operator.sub, operator.isub, torch.add, torch.sub}
_MUL = {operator.mul, operator.imul, operator.truediv, operator.itruediv, torch.mul, torch.div}
_ADD_METHODS = {"add", "add_", "sub", "sub_"}
_MUL_METHODS = {"mul", "mul_", "div", "div_"}


@dataclass
class ChannelGroups:
    """Output channels that must be pruned together.

    Attributes:
        groups: each group is a list of ``(module path, channel)`` of prunable layers.
        pinned: ``pinned[i]`` is why group ``i`` must be kept (``None`` when it can be pruned).
        followers: batch-norm module path -> the group index of each of its channels (or ``None``).
    """

    groups: list[list[tuple[str, int]]] = field(default_factory=list)
    pinned: list[str | None] = field(default_factory=list)
    followers: dict[str, list[int | None]] = field(default_factory=dict)

    def families(self) -> list[list[int]]:
        """Group indices bundled by the layers they touch (layers tied by any coupling are one family)."""
        g = nx.Graph()
        for i, members in enumerate(self.groups):
            g.add_node(("g", i))
            for path, _ in members:
                g.add_edge(("g", i), ("m", path))
        return [sorted(i for kind, i in comp if kind == "g") for comp in nx.connected_components(g)
                if any(kind == "g" for kind, _ in comp)]


class _Builder:
    def __init__(self, gm: GraphModule, ctx: PassContext, producers: dict[str, int]) -> None:
        self.gm, self.ctx, self.producers = gm, ctx, producers
        self.graph = nx.Graph()
        self.info: dict[Node, Info | None] = {}
        self.followers: dict[str, list[ChannelId]] = {}
        self.pin_reasons: dict[ChannelId, str] = {}

    def shape(self, node: Any) -> tuple[int, ...] | None:
        spec = self.ctx.tensor_spec(node) if isinstance(node, Node) else None
        return spec.shape if spec is not None else None

    def pin(self, ids: list[ChannelId], reason: str) -> None:
        for cid in ids:
            pid = ("pin", reason)
            self.pin_reasons[pid] = reason
            self.graph.add_edge(cid, pid)

    def tie(self, a: list[ChannelId], b: list[ChannelId]) -> None:
        for x, y in zip(a, b):
            self.graph.add_edge(x, y)

    def keep(self, node: Node, src: Any) -> Info | None:
        """``node`` keeps the channels of ``src`` if its output has the same rank and channel count."""
        info = self.info.get(src) if isinstance(src, Node) else None
        out, inp = self.shape(node), self.shape(src)
        if info is None or out is None or inp is None or len(out) != len(inp) or out[info[0]] != len(info[1]):
            return None
        return info

    def visit(self, node: Node) -> Info | None:
        mod = get_module(self.gm, node)
        first = node.args[0] if node.args else None
        if mod is not None:
            path = str(node.target)
            if path in self.producers:
                out = self.shape(node)
                axis = 1 if not isinstance(mod, nn.Linear) else (len(out) - 1 if out else 1)
                ids = [("w", path, c) for c in range(self.producers[path])]
                self.graph.add_nodes_from(ids)
                return axis, ids
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                info = self.keep(node, first)
                if info is not None and info[0] == 1:
                    self.followers.setdefault(path, info[1])
                    if not mod.affine:
                        self.pin(info[1], f"batch-norm {path} has no affine parameters to zero")
                return info
            return self.keep(node, first) if isinstance(mod, _UNARY_MODULES) else None
        if is_relu(node, self.gm) or (node.op == "call_function" and node.target in _UNARY_FUNCS) \
                or (node.op == "call_method" and node.target in _UNARY_METHODS):
            return self.keep(node, first)
        is_add = node.target in _ADD if node.op == "call_function" else node.op == "call_method" and node.target in _ADD_METHODS
        is_mul = node.target in _MUL if node.op == "call_function" else node.op == "call_method" and node.target in _MUL_METHODS
        if is_add or is_mul:
            return self.elementwise(node, list(node.args[:2]), is_add)
        if node.op == "call_function" and node.target in (torch.cat, torch.concat):
            return self.cat(node)
        return None

    def elementwise(self, node: Node, operands: list[Any], is_add: bool) -> Info | None:
        infos = [self.keep(node, a) for a in operands]
        known = [i for i in infos if i is not None]
        if not known:
            return None
        axis, ids = known[0]
        for a, info in zip(operands, infos):
            if info is None:
                if is_add and (isinstance(a, Node) or a != 0):  # zero + something is no longer zero
                    self.pin(ids, f"'{node.name}' adds a value fxdebug cannot prune")
            elif info[0] == axis:
                self.tie(ids, info[1])
            else:
                self.pin(ids + info[1], f"'{node.name}' mixes channel axes")
        return axis, ids

    def cat(self, node: Node) -> Info | None:
        parts = node.args[0] if node.args else node.kwargs.get("tensors", ())
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        out = self.shape(node)
        if out is None or not isinstance(parts, (list, tuple)):
            return None
        dim = dim % len(out)
        infos = [self.info.get(p) if isinstance(p, Node) and len(self.shape(p) or ()) == len(out) else None for p in parts]
        axis = next((i[0] for i in infos if i is not None), None)
        if axis is None:
            return None
        if dim != axis:
            known = [i for i in infos if i is not None]
            for other in known[1:]:
                self.tie(known[0][1], other[1])
            if len(known) < len(infos):
                self.pin(known[0][1], f"'{node.name}' concatenates with a value fxdebug cannot prune")
            return known[0]
        ids: list[ChannelId] = []
        for k, (p, info) in enumerate(zip(parts, infos)):
            if info is not None and info[0] == axis:
                ids.extend(info[1])
            else:
                size = (self.shape(p) or (0,) * len(out))[axis]
                reason = f"'{node.name}' concatenates a value fxdebug cannot prune"
                fresh = [("pin", reason, k, c) for c in range(size)]
                self.pin_reasons.update((f, reason) for f in fresh)
                self.graph.add_nodes_from(fresh)
                ids.extend(fresh)
        return axis, ids


def channel_groups(gm: GraphModule, ctx: PassContext, producers: dict[str, int]) -> ChannelGroups:
    """Group the output channels of ``producers`` (module path -> channel count) that are coupled.

    Needs the context's example inputs (channel counts along each tensor come from a run).
    """
    b = _Builder(gm, ctx, producers)
    for node in gm.graph.nodes:
        if node.op in ("call_module", "call_function", "call_method"):
            b.info[node] = b.visit(node)
    result = ChannelGroups()
    index: dict[ChannelId, int] = {}
    for comp in nx.connected_components(b.graph):
        members = sorted((cid[1], cid[2]) for cid in comp if cid[0] == "w")
        if not members:
            continue
        pins = sorted(b.pin_reasons[c] for c in comp if c[0] == "pin")
        for cid in comp:
            index[cid] = len(result.groups)
        result.groups.append(members)
        result.pinned.append(pins[0] if pins else None)
    for path, ids in b.followers.items():
        result.followers[path] = [index.get(cid) for cid in ids]
    return result
