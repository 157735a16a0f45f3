"""``Fuse``: fold eval-mode batch-norm into the conv / conv-transpose / linear that feeds it.

For ``y = bn(conv(x))`` with running statistics, ``bn`` is a per-channel affine map, so it can
be folded into the conv's weights and bias: ``scale = gamma / sqrt(var + eps)``,
``W' = W * scale`` (per output channel), ``b' = (b - mean) * scale + beta``. The fused layer is a
*copy* of the conv with new weight tensors, registered under fxdebug's namespace; the user's conv
and batch-norm keep their own parameters and stay in the model untouched.

A pair is left alone, with the reason in the result's notes, when the batch-norm is in training
mode or has no running statistics, when the conv's output has other users (fxdebug's own observers
do not count: on an instrumented model the conv's observation is dropped, with a note), or (Linear +
BatchNorm1d) when the batch-norm does not normalise the linear's feature dimension.

Each fused layer is checked against the pair it replaces on the example inputs; the maximum
absolute difference goes to the notes and to ``node_meta(n).transforms["fuse"]``, and a difference
beyond the tolerance raises ``PassError`` instead of returning a wrong model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from .derived import mark_derived
from .fuse_live import folded_bias, folded_weight, live_batch_norm_reads
from fxdebug import PassError
from fxdebug.authoring import (
    INSTRUMENTATION, Match, Options, Pass, PassContext, PassResult, Where, describe, find_pattern, get_attr,
    is_batchnorm, is_conv, is_instrumentation, is_linear, node_meta, node_values, replace_pattern,
)

__all__ = ["Fuse", "fold_batchnorm"]

_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_CONV = {1: (nn.Conv1d, nn.ConvTranspose1d), 2: (nn.Conv2d, nn.ConvTranspose2d), 3: (nn.Conv3d, nn.ConvTranspose3d)}


def _patterns() -> list[nn.Module]:
    """One tiny model per foldable pair: conv{1,2,3}d / conv-transpose{1,2,3}d / linear + batch-norm."""
    pats: list[nn.Module] = []
    for dim, convs in _CONV.items():
        for conv in convs:
            pats.append(nn.Sequential(conv(1, 1, 1), _BN[dim](1)))
    pats.append(nn.Sequential(nn.Linear(1, 1), nn.BatchNorm1d(1)))
    return pats


def fold_batchnorm(layer: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A copy of ``layer`` (Conv*, ConvTranspose*, Linear) with ``bn`` folded into new weights.

    The arithmetic runs in float64 and is cast back to the layer's dtype. ``layer`` and ``bn``
    are not modified.
    """
    fused = copy.deepcopy(layer)
    w = layer.weight.detach().double()
    mean, var = bn.running_mean.double(), bn.running_var.double()
    gamma = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(mean)
    beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(mean)
    scale = gamma / torch.sqrt(var + bn.eps)
    bias = layer.bias.detach().double() if layer.bias is not None else torch.zeros_like(mean)
    if isinstance(layer, nn.modules.conv._ConvTransposeNd):
        g = layer.groups
        shaped = w.reshape(g, w.shape[0] // g, w.shape[1], *w.shape[2:])
        w = (shaped * scale.reshape(g, 1, -1, *([1] * (w.dim() - 2)))).reshape(w.shape)
    else:
        w = w * scale.reshape(-1, *([1] * (w.dim() - 1)))
    b = (bias - mean) * scale + beta
    fused.weight = nn.Parameter(w.to(layer.weight.dtype), requires_grad=layer.weight.requires_grad)
    fused.bias = nn.Parameter(b.to(layer.weight.dtype), requires_grad=layer.weight.requires_grad)
    return mark_derived(fused)  # derived from the model's weights: not in dbg.state_dict()


class Fuse(Pass):
    """Fold eval-mode BatchNorm into the preceding Conv1d/2d/3d, ConvTranspose1d/2d/3d or Linear.

    Args:
        atol, rtol: the fused output may differ from the original by at most
            ``atol + rtol * max|original|`` on the example inputs (float16/bfloat16: at least 1e-2).
        where: limit the pass to some nodes / modules (both nodes of a pair must be selected).
    """

    name = "fuse"
    # works on the live (Dynamo) capture: the fold is computed in the graph from the live reads (fuse_live.py)
    live_capture = True

    def __init__(self, *, atol: float = 1e-4, rtol: float = 1e-4, where: Where = None) -> None:
        super().__init__(where=where)
        opts = Options(self)
        self.atol, self.rtol = opts.number("atol", atol, low=0), opts.number("rtol", rtol, low=0)

    def fold(self, layer: nn.Module, bn: nn.Module) -> nn.Module:
        """The fused layer for one pair; override to change how folding is done."""
        return fold_batchnorm(layer, bn)

    def _why_not(self, match: Match, ctx: PassContext) -> str | None:
        layer, bn = match.modules()
        if bn.training:
            return f"{describe(match.anchor)} is in training mode (it uses batch statistics); call model.eval() first."
        if bn.running_mean is None or bn.running_var is None:
            return f"{describe(match.anchor)} has no running statistics (track_running_stats=False)."
        if isinstance(layer, nn.Linear):
            spec = ctx.tensor_spec(match.nodes[0]) if ctx.inputs is not None else None
            if spec is None:
                return f"{describe(match.nodes[0])}: Linear + BatchNorm1d fusion needs example inputs to check the shape."
            if len(spec.shape) != 2:
                return (f"{describe(match.nodes[0])} outputs shape {spec.shape}; BatchNorm1d then normalises dim 1, "
                        "not the Linear's features, so they cannot be folded.")
        return None

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        notes: list[str] = []
        replaced: dict[str, str] = {}
        by_pattern = [(p, find_pattern(gm, p, where=self.where)) for p in _patterns()]  # matched once
        found = [m for _, ms in by_pattern for m in ms]
        for m in found:  # an instrumented model: fxdebug's own observers of the conv are no reason to stay
            if m.blocked and all(_observes_only(u) or u in m.nodes for n in m.nodes if n is not m.anchor
                                 for u in n.users):
                self._unobserve(ctx, [n for n in m.nodes if n is not m.anchor], notes)
                m.blocked = None
        aten = _aten_pairs(gm, ctx) if not found else []
        wanted = [n for m in found if not m.blocked for n in (m.inputs[0], m.anchor)]
        wanted += [n for layer, bn in aten for n in (layer.args[0], bn) if isinstance(n, Node)]
        values = node_values(gm, ctx, wanted) if ctx.inputs is not None and wanted else {}
        if ctx.inputs is None:
            notes.append("no example inputs: fused layers were not checked numerically.")

        infos: dict[str, dict[str, Any]] = {}

        def build(match: Match) -> nn.Module | None:
            reason = self._why_not(match, ctx)
            if reason:
                notes.append(f"left {match.describe()} alone: {reason}")
                return None
            layer, bn = match.modules()
            fused = self.fold(layer, bn)
            info: dict[str, Any] = {"from": [n.name for n in match.nodes], "layer": str(match.nodes[0].target)}
            if values:
                info["max_abs_diff"] = self._check(fused, match, values)
            infos[match.anchor.name] = info
            return fused

        for layer_node, bn_node in aten:
            self._fuse_aten(gm, ctx, layer_node, bn_node, values, replaced, notes)
        for pattern, matches in by_pattern:
            for rep in replace_pattern(gm, pattern, build=build, ctx=ctx, where=self.where, matches=matches):
                info = infos[rep.match.anchor.name]
                ctx.record(rep.output, info, stands_for=info["layer"])
                replaced[rep.match.anchor.name] = rep.output.name
                replaced[rep.match.nodes[0].name] = rep.output.name
                diff = f": max |diff| {info['max_abs_diff']:.2e}" if "max_abs_diff" in info else ""
                notes.append(f"fused {rep.match.describe()} into {rep.output.name}{diff}.")
        notes.extend(f"left {m.describe()} alone: {m.blocked}" for m in found if m.blocked)
        return PassResult(gm, replaced=replaced, notes=notes)

    def _fuse_aten(self, gm: GraphModule, ctx: PassContext, layer_node: Node, bn_node: Node,
                   values: dict[str, Any], replaced: dict[str, str], notes: list[str]) -> None:
        """An export graph's ``aten.conv*/linear`` → ``aten.batch_norm``: one call of the folded layer."""
        weight, x = layer_node.args[1], layer_node.args[0]
        assert isinstance(weight, Node) and isinstance(x, Node)
        path = str(weight.target).rpartition(".")[0]
        layer, bn = gm.get_submodule(path), _bn_module(gm, bn_node)
        pair = f"{describe(layer_node)} + {describe(bn_node)}"
        reason = _aten_why_not(layer_node, bn_node, layer, bn)
        if reason:
            notes.append(f"left {pair} alone: {reason}")
            return
        if live_batch_norm_reads(bn_node) is not None:  # a live (Dynamo) graph: the fold is computed in the graph
            self._fold_in_graph(gm, ctx, layer_node, bn_node, layer, values, replaced, notes)
            return
        fused = self.fold(layer, bn)
        info: dict[str, Any] = {"from": [layer_node.name, bn_node.name], "layer": path}
        if values:
            info["max_abs_diff"] = self._compare(fused, values[x.name], values[bn_node.name], pair, bn_node.name,
                                                 type(layer).__name__)
        reads = [a for a in (*layer_node.args, *bn_node.args) if isinstance(a, Node) and a.op == "get_attr"]
        self._unobserve(ctx, [layer_node], notes)
        new = ctx.replace_with_module(bn_node, fused, (x,))
        gm.graph.erase_node(layer_node)
        for read in reads:  # the pair's parameter reads, now unused: the fused layer owns its weights
            if not read.users:
                gm.graph.erase_node(read)
        ctx.record(new, info, stands_for=path)
        replaced[bn_node.name] = replaced[layer_node.name] = new.name
        diff = f": max |diff| {info['max_abs_diff']:.2e}" if "max_abs_diff" in info else ""
        notes.append(f"fused {pair} into {new.name}{diff}.")

    def _fold_in_graph(self, gm: GraphModule, ctx: PassContext, layer_node: Node, bn_node: Node, layer: nn.Module,
                       values: dict[str, Any], replaced: dict[str, str], notes: list[str]) -> None:
        """A Dynamo graph's ``conv/linear`` -> ``F.batch_norm``: the folded weight and bias computed in the graph from
        the live parameter and buffer reads (``fuse_live``), one layer call on them; follows ``load_state_dict``."""
        reads = live_batch_norm_reads(bn_node)
        assert reads is not None
        pair = f"{describe(layer_node)} + {describe(bn_node)}"
        weight = layer_node.args[1]
        bias = layer_node.args[2] if len(layer_node.args) > 2 else layer_node.kwargs.get("bias")
        groups = layer.groups if isinstance(layer, nn.modules.conv._ConvTransposeNd) else 0
        mean, var, gamma, beta, eps = (reads[k] for k in ("running_mean", "running_var", "weight", "bias", "eps"))
        tensors = [a for a in (weight, bias, mean, var, gamma, beta) if a is not None]
        if not all(isinstance(a, Node) and a.op == "get_attr" for a in tensors) or not isinstance(eps, float):
            notes.append(f"left {pair} alone: its weights are not read straight from the model's parameters.")
            return
        x = layer_node.args[0]
        assert isinstance(x, Node)
        info: dict[str, Any] = {"from": [layer_node.name, bn_node.name], "layer": str(weight.target).rpartition(".")[0],
                                "in_graph": True}
        # the input may be an earlier pair's fused call (a chain): its value is that pair's batch-norm output
        x_value = values.get(x.name, next((values[o] for o, new in reversed(replaced.items()) if new == x.name and o in values),
                                          None))
        if x_value is not None:
            now = {a: get_attr(gm, str(a.target)) for a in tensors}
            w_now = folded_weight(now[weight], now[var], now.get(gamma), eps, groups)
            b_now = folded_bias(now.get(bias), now[mean], now[var], now.get(gamma), now.get(beta), eps, now[weight])
            with torch.no_grad():
                out = layer_node.target(x_value, w_now, b_now, *layer_node.args[3:], **{
                    k: v for k, v in layer_node.kwargs.items() if k != "bias"})
            info["max_abs_diff"] = self._compare_values(out, values[bn_node.name], pair, bn_node.name,
                                                        type(layer).__name__)
        self._unobserve(ctx, [layer_node], notes)
        w_new = ctx.insert_before(layer_node, folded_weight, (weight, var, gamma, eps, groups), hint="folded_weight")
        b_new = ctx.insert_before(layer_node, folded_bias, (bias, mean, var, gamma, beta, eps, weight),
                                  hint="folded_bias")
        args = (x, w_new, b_new, *layer_node.args[3:])
        kwargs = {k: v for k, v in layer_node.kwargs.items() if k != "bias"}
        new = ctx.insert_before(bn_node, layer_node.target, args, kwargs, hint=f"{layer_node.name}_{bn_node.name}")
        ctx.replace(bn_node, new)
        gm.graph.erase_node(layer_node)
        ctx.record(new, info, stands_for=info["layer"])
        replaced[bn_node.name] = replaced[layer_node.name] = new.name
        diff = f": max |diff| {info['max_abs_diff']:.2e}" if "max_abs_diff" in info else ""
        notes.append(f"fused {pair} into {new.name}, folded in the graph from the live parameters and running "
                     f"statistics at every call{diff}.")

    @staticmethod
    def _unobserve(ctx: PassContext, nodes: list[Node], notes: list[str]) -> None:
        for n in nodes:
            if ctx.unobserve(n):
                notes.append(f"dropped the observation of {n.name}: the fused layer computes it and the batch-norm "
                             "in one, so its value no longer exists (the batch-norm's row now shows the fused output).")

    def _check(self, fused: nn.Module, match: Match, values: dict[str, Any]) -> float:
        return self._compare(fused, values[match.inputs[0].name], values[match.anchor.name], match.describe(),
                             match.anchor.name, type(match.modules()[0]).__name__)

    def _compare(self, fused: nn.Module, x: Any, ref: Any, pair: str, node: str, op: str) -> float:
        with torch.no_grad():
            out = fused(x)
        return self._compare_values(out, ref, pair, node, op)

    def _compare_values(self, out: Any, ref: Any, pair: str, node: str, op: str) -> float:
        diff = (out.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
        atol, rtol = self.atol, self.rtol
        if ref.dtype in (torch.float16, torch.bfloat16):
            atol, rtol = max(atol, 1e-2), max(rtol, 1e-2)
        tol = atol + rtol * (ref.double().abs().max().item() if ref.numel() else 0.0)
        if not diff <= tol:
            raise PassError(
                f"fuse: folding {pair} changes the output by up to {diff:.3g} on the example inputs "
                f"(tolerance {tol:.3g}); the model was not changed. Exclude the pair with where=, or raise "
                "Fuse(atol=..., rtol=...) if that difference is acceptable.",
                node=node, pass_name=self.name, op=op)
        return diff


def _observes_only(user: Node) -> bool:
    """Whether ``user`` is fxdebug's own observation (an observer, not a guard or a shadow that changes
    what runs): a transform may take it off a node it replaces (``PassContext.unobserve``)."""
    return is_instrumentation(user) and node_meta(user).role == INSTRUMENTATION


def _bn_module(gm: GraphModule, bn_node: Node) -> Any:
    """The BatchNorm module whose running statistics an ``aten.batch_norm`` call reads."""
    live = live_batch_norm_reads(bn_node)  # F.batch_norm (Dynamo): running_mean is its second argument
    mean = live["running_mean"] if live is not None else bn_node.args[3] if len(bn_node.args) > 3 else None
    if not isinstance(mean, Node) or mean.op != "get_attr":
        return None
    owner = gm.get_submodule(str(mean.target).rpartition(".")[0])
    return owner if isinstance(owner, nn.modules.batchnorm._BatchNorm) else None


def _aten_pairs(gm: GraphModule, ctx: PassContext) -> list[tuple[Node, Node]]:
    """Export graphs: ``(aten conv/linear, aten.batch_norm)`` pairs (both selected) whose layer weight
    is a module's parameter."""
    selected = set(ctx.nodes(gm, ops=("call_function",)))
    pairs = []
    for bn in selected:
        src = bn.args[0] if bn.args else None
        if not is_batchnorm(bn, gm) or not isinstance(src, Node) or src not in selected:
            continue
        if not (is_conv(src, gm) or is_linear(src, gm)) or len(src.args) < 2:
            continue
        w = src.args[1]
        if isinstance(w, Node) and w.op == "get_attr" and str(w.target).endswith(".weight"):
            pairs.append((src, bn))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(pairs, key=lambda p: order[p[1]])


def _aten_why_not(layer_node: Node, bn_node: Node, layer: nn.Module, bn: Any) -> str | None:
    if not isinstance(layer, (nn.modules.conv._ConvNd, nn.Linear)):
        return f"the weight belongs to a {type(layer).__name__}, not a conv or linear layer."
    if bn is None or bn.running_mean is None:
        return "the batch-norm has no running statistics (track_running_stats=False)."
    if bn.training or (len(bn_node.args) > 5 and bn_node.args[5] is True):
        return "the batch-norm is in training mode (it uses batch statistics); call model.eval() first."
    users = [u for u in layer_node.users if not _observes_only(u)]  # fxdebug's own observers do not count
    if len(users) != 1:
        return f"{layer_node.name} feeds {len(users)} users ({', '.join(u.name for u in users)}); fusion needs exactly one."
    shape = node_meta(layer_node).shape
    if isinstance(layer, nn.Linear) and shape is not None and len(shape) != 2:
        return f"the linear outputs shape {tuple(shape)}; BatchNorm1d then normalises dim 1, not its features."
    return None
