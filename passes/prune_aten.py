"""Structured pruning on graphs that call ``linear`` as a function (Dynamo's and export's graphs).

A transformer's feed-forward block is ``linear -> activation -> linear`` (BERT's
``intermediate.dense -> gelu -> output.dense``, GPT-2's ``c_fc -> gelu -> c_proj`` as Linear
layers, LLaMA's MLP without its gate). Its hidden channels are private to the block: pruning
channel ``c`` zeroes row ``c`` (and bias ``c``) of the first layer and input column ``c`` of the
second, so the channel contributes nothing anywhere — whatever the activation makes of 0.

``ffn_pairs`` finds such pairs in a graph whose layers are ``linear(x, weight, bias)`` calls
reading their weights as ``get_attr`` nodes: the first layer's output must reach the second
layer's input alone, through elementwise ops (activations, dropout) that nothing else reads.
Every other layer (attention projections, the residual stream's writers) mixes channels that
other paths read as well; they are kept, and the notes say so.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node
from torch.nn import functional as F

from fxdebug.authoring import is_instrumentation

__all__ = ["FfnPair", "before_first_user", "ffn_pairs", "pair_masks"]

# elementwise ops a hidden channel passes through unchanged in position (value 0 may not stay 0: the
# consumer's input column is masked too, so it does not matter)
_PASS = {torch.relu, F.relu, F.gelu, torch._C._nn.gelu, F.silu, torch.tanh, torch.sigmoid, F.dropout, F.leaky_relu,
         F.elu, F.mish, F.relu6, F.hardswish}
_aten = torch.ops.aten
_PASS |= {_aten.relu.default, _aten.gelu.default, _aten.silu.default, _aten.tanh.default, _aten.sigmoid.default,
          _aten.dropout.default, _aten.leaky_relu.default, _aten.elu.default, _aten.mish.default, _aten.hardswish.default,
          _aten.clone.default}
_PASS_METHODS = {"relu", "tanh", "sigmoid", "contiguous"}


@dataclass(eq=False)
class FfnPair:
    """A producer layer whose output channels feed only the consumer layer's input columns."""

    producer: str  # module path of the first linear
    consumer: str  # module path of the second
    reads: dict[str, Node]  # "weight", "bias" (producer), "consumer_weight": the get_attr nodes to mask


def _linear_call(node: Node) -> bool:
    return node.op == "call_function" and node.target in (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)


def _param_read(value: Any, suffix: str) -> str | None:
    if isinstance(value, Node) and value.op == "get_attr" and str(value.target).endswith(suffix):
        return str(value.target)[: -len(suffix)]
    return None


def _users(node: Node) -> list[Node]:
    return [u for u in node.users if not is_instrumentation(u)]


def _passes(node: Node, value: Node) -> bool:
    """``node`` is an elementwise op of ``value`` alone (an activation, dropout)."""
    others = [a for a in node.all_input_nodes if a is not value]
    if others:
        return False
    if node.op == "call_function":
        return node.target in _PASS or node.target is operator.neg
    return node.op == "call_method" and str(node.target) in _PASS_METHODS


def ffn_pairs(gm: GraphModule, layers: dict[str, nn.Module]) -> tuple[list[FfnPair], dict[str, str]]:
    """The prunable ``linear -> elementwise -> linear`` pairs among ``layers`` (module path -> Linear),
    and ``{layer: why it is kept}`` for the other layers."""
    pairs: list[FfnPair] = []
    why: dict[str, str] = {}
    consumers: set[str] = set()
    for node in gm.graph.nodes:
        if not _linear_call(node) or len(node.args) < 2:
            continue
        path = _param_read(node.args[1], ".weight")
        if path is None or path not in layers:
            continue
        value, chain = node, 0
        while True:
            users = _users(value)
            if len(users) != 1:
                why.setdefault(path, f"its output feeds {len(users)} nodes ({', '.join(u.name for u in users[:4])}): "
                                     "its channels are read beyond one layer")
                break
            user = users[0]
            if _linear_call(user) and user.args and user.args[0] is value:
                other = _param_read(user.args[1] if len(user.args) > 1 else None, ".weight")
                if other is None or other not in layers or other == path:
                    why.setdefault(path, f"{user.name} is not a Linear of the model")
                    break
                reads = {"weight": node.args[1]}
                bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
                if _param_read(bias, ".bias") == path:
                    reads["bias"] = bias
                elif bias is not None:
                    why.setdefault(path, "its bias is not its own parameter")
                    break
                reads["consumer_weight"] = user.args[1]
                pairs.append(FfnPair(path, other, reads))  # type: ignore[arg-type]
                consumers.add(other)
                break
            if not _passes(user, value) or chain > 8:
                why.setdefault(path, f"its output goes into {user.name} ({user.target if user.op != 'call_function' else getattr(user.target, '__name__', user.target)}), "
                                     "not through an activation into one Linear")
                break
            value, chain = user, chain + 1
    producers = {p.producer for p in pairs}
    for path in layers:
        if path in producers:
            why.pop(path, None)
        elif path in consumers:
            why[path] = why.get(path) or "its input columns are pruned with its producer's channels"
        else:
            why.setdefault(path, "not read as linear(x, weight, bias) in this graph")
    return pairs, why


def _scores(pair: FfnPair, layers: dict[str, nn.Module], norm: int) -> Tensor:
    w = layers[pair.producer].weight.detach().float()
    s = w.abs().sum(1) if norm == 1 else w.norm(dim=1)
    return (s / (s.mean() + 1e-12)).cpu()


def pair_masks(pairs: list[FfnPair], layers: dict[str, nn.Module], amount: float, scope: str,
               norm: int) -> dict[FfnPair, Tensor]:
    """``{pair: bool tensor of the producer's pruned output channels}``: the ``amount`` fraction of
    channels with the lowest weight norm (relative to the layer's mean), per pair or over all pairs."""
    scores = {p: _scores(p, layers, norm) for p in pairs}
    cut: dict[FfnPair, Tensor] = {p: torch.zeros(len(s), dtype=torch.bool) for p, s in scores.items()}
    pools = [[p] for p in pairs] if scope == "layer" else [pairs]
    for pool in pools:
        flat = torch.cat([scores[p] for p in pool]) if pool else torch.zeros(0)
        # never every channel of a pair: keep at least one, or the block would compute nothing
        picked = torch.argsort(flat, stable=True)[: round(amount * flat.numel())]
        offset = 0
        for p in pool:
            n = len(scores[p])
            here = picked[(picked >= offset) & (picked < offset + n)] - offset
            cut[p][here] = True
            if bool(cut[p].all()):
                cut[p][int(torch.argmax(scores[p]))] = False
            offset += n
    return cut


def before_first_user(read: Node) -> Node:
    """Where a mask of ``read`` goes: right before the first op that reads it. A live (Dynamo) graph reads the model's
    parameters at its start, before fxdebug's clock; a mask there would be observed before the clock exists."""
    order = {n: i for i, n in enumerate(read.graph.nodes)}
    first = min(read.users, key=lambda u: order[u], default=None)
    return first.prev if first is not None else read
