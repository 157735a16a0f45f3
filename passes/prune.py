"""``PruneMasks``: mask the least important weights or output channels of conv and linear layers.

Masks live in the graph, not in the weights: each pruned layer's call goes through a ``Masked``
module that multiplies the layer's own parameters by fixed 0/1 masks on every call. The user's
weights are untouched (``unmask(gm)`` restores the plain calls), gradients of masked entries are
exactly zero (the mask is part of the computation), and ``state_dict()`` keys stay the model's.
With ``bake=True`` the layers are replaced by copies whose masked weights are zero, with gradient
hooks that keep them zero through training; the model keeps its own weights.

Structured pruning (``structured="channels"``) removes whole output channels; channels coupled
through residual adds, concatenations and the batch-norm that follows are pruned as one group
(see ``prune_groups``), so a pruned channel is zero everywhere it lands.

``importance``: ``"magnitude"`` (|w|), ``"grad"`` (|w · ∂L/∂w| on ``batch`` with ``loss_fn``), or
``"activation"`` (statistics collected on ``batch``: |w| times the input's per-feature norm for
single weights, the output channel's mean |activation| for channels). ``batch`` defaults to the
example inputs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxdebug import MissingInputsError, PassError, UsageError
from fxdebug.authoring import (
    Options, Pass, PassContext, PassResult, Where, get_module, is_conv, is_linear, keep_state, node_meta, node_values,
)

from .fuse_live import folded_value, live_fold_of
from .prune_modules import Masked, MaskedValue, bake as _bake
from .prune_aten import before_first_user, ffn_pairs, pair_masks
from .prune_groups import channel_groups

__all__ = ["Masked", "MaskedValue", "PruneMasks", "sparsity", "unmask"]


def _lowest(scores: Tensor, k: int) -> Tensor:
    """Flat indices of the ``k`` lowest scores (ties broken by position, so exactly ``k``)."""
    return torch.argsort(scores.flatten(), stable=True)[:k]


class PruneMasks(Pass):
    """Mask the ``amount`` fraction of least important weights (or output channels).

    Args:
        amount: fraction in [0, 1) of weights / channels to mask.
        structured: ``False`` for single weights, ``"channels"`` for whole output channels.
        scope: ``"global"`` ranks across all selected layers, ``"layer"`` within each layer (for
            channels: within each family of coupled layers).
        importance: ``"magnitude"``, ``"grad"`` or ``"activation"``.
        bake: zero the weights in copies of the layers instead of masking in the graph.
        loss_fn: ``loss_fn(output) -> scalar``, needed for ``importance="grad"``.
        batch: inputs for ``"grad"`` / ``"activation"`` (default: the example inputs).
        norm: 1 or 2, the channel norm for structured magnitude ranking.
        prune_outputs: also prune the output channels of layers whose outputs are the model's
            outputs (a classifier's logits). Off by default: a pruned class would always score 0.
        where: limit the pass to some layers.
    """

    name = "prune-masks"
    # works on the live (Dynamo) capture: the masks multiply the weights as the graph reads them, at every call
    live_capture = True

    def __init__(self, amount: float, structured: bool | str = False, scope: str = "global",
                 importance: str = "magnitude", bake: bool = False, *, loss_fn: Callable[[Any], Tensor] | None = None,
                 batch: Any = None, norm: int = 1, prune_outputs: bool = False, where: Where = None) -> None:
        super().__init__(where=where)
        opts = Options(self)
        amount = opts.number("amount", amount, low=0, high=1, high_open=True, doc="the fraction to prune, a number in [0, 1)")
        structured = opts.choice("structured", structured, (False, None, "channels"),
                                 doc="False (single weights) or 'channels' (whole output channels)")
        scope = opts.choice("scope", scope, ("global", "layer"))
        importance = opts.choice("importance", importance, ("magnitude", "grad", "activation"))
        bake, prune_outputs = opts.flag("bake", bake), opts.flag("prune_outputs", prune_outputs)
        loss_fn = opts.function("loss_fn", loss_fn, "a function of the model's output returning a scalar loss")
        norm = opts.choice("norm", norm, (1, 2))
        if importance == "grad" and loss_fn is None:
            raise UsageError("PruneMasks(importance=\"grad\") needs loss_fn=, a function of the model's output "
                             "returning a scalar loss (e.g. lambda out: F.cross_entropy(out, y)).")
        self.amount, self.structured, self.scope, self.importance, self.bake = float(amount), structured or False, scope, importance, bake
        self.loss_fn, self.batch, self.norm, self.prune_outputs = loss_fn, batch, norm, bool(prune_outputs)
        # what the functional graphs of a live capture cannot do yet (``_refuse_export``; a grad loss sees Dynamo's
        # output tuple; channels there are a feed-forward block's only): instrument()'s auto choice takes a snapshot
        self.live_capture = not (bake or structured or importance != "magnitude")

    # -- what to prune --------------------------------------------------------------------------
    def _aten_layers(self, gm: GraphModule, ctx: PassContext) -> dict[str, tuple[nn.Module, dict[str, Node]]]:
        """Export graphs: ``{layer path: (layer, {"weight": get_attr node, "bias": ...})}`` of the aten
        conv / linear calls whose weight is a parameter of a Conv / Linear module of the model."""
        found: dict[str, tuple[nn.Module, dict[str, Node]]] = {}
        for node in ctx.nodes(gm, self.where, ops=("call_function",)):
            if not (is_conv(node, gm) or is_linear(node, gm)) or len(node.args) < 2:
                continue
            w = node.args[1]  # the weight read, or (Fuse before, on a Dynamo graph) its fold with the batch-norm
            read = (live_fold_of(w) if self.importance == "magnitude" else None) or w
            if not isinstance(read, Node) or read.op != "get_attr" or not str(read.target).endswith(".weight"):
                continue
            path = str(read.target).rpartition(".")[0]
            layer = gm.get_submodule(path)
            if not isinstance(layer, (nn.modules.conv._ConvNd, nn.Linear)):
                continue
            reads = {"weight": w}
            b = node.args[2] if len(node.args) > 2 else None
            if isinstance(b, Node) and b.op == "get_attr" and str(b.target) == f"{path}.bias":
                reads["bias"] = b
            found.setdefault(path, (layer, reads))
        return found

    def _refuse_export(self, gm: GraphModule, found: dict[str, Any]) -> None:
        """What this pass cannot do on an export graph yet, said before anything changes."""
        why = ("bake=True" if self.bake else
               f"importance=\"{self.importance}\" (layer activations are read at module calls)"
               if self.importance == "activation" else
               f"structured=\"channels\" with importance=\"{self.importance}\"" if self.structured and
               self.importance != "magnitude" else None)
        if why is not None:
            works = ("structured=\"channels\" with importance=\"magnitude\" and bake=False (a feed-forward block's "
                     "hidden channels), or structured=False with importance=\"magnitude\" or \"grad\"")
            raise PassError(
                f"PruneMasks: {type(gm).__name__}'s graph calls its layers as functions (an export or Dynamo graph: "
                f"{len(found)} conv/linear call(s), e.g. {next(iter(found))}); here PruneMasks does not do {why}. "
                f"What works on this graph: {works}.", pass_name=self.name)

    def _layers(self, gm: GraphModule, ctx: PassContext) -> dict[str, nn.Module]:
        layers: dict[str, nn.Module] = {}
        for node in ctx.nodes(gm, self.where, ops=("call_module",)):
            mod = get_module(gm, node)
            if (is_conv(node, gm) or is_linear(node, gm)) and isinstance(getattr(mod, "weight", None), Tensor):
                layers.setdefault(str(node.target), mod)
        return layers

    def _weight_scores(self, gm: GraphModule, ctx: PassContext, layers: dict[str, nn.Module]) -> dict[str, Tensor]:
        """One score per weight entry, by the chosen importance."""
        weights = {p: m.weight.detach().abs().float() for p, m in layers.items()}
        if self.importance == "grad":
            grads = self._grads(gm, ctx, layers)
            return {p: (layers[p].weight.detach() * grads[p]).abs().float() for p in layers}
        if self.importance == "activation":
            acts = self._activations(gm, ctx, layers, inputs=True)
            out = {}
            for p, m in layers.items():
                a = acts.get(p)
                groups = getattr(m, "groups", 1)
                if a is None or groups != 1:
                    out[p] = weights[p]
                    continue
                w = weights[p]
                view = [1] * w.dim()
                view[0 if isinstance(m, nn.modules.conv._ConvTransposeNd) else 1] = -1
                out[p] = w * a.to(w.device).reshape(view)
            return out
        return weights

    def _grads(self, gm: GraphModule, ctx: PassContext, layers: dict[str, nn.Module]) -> dict[str, Tensor]:
        params = [m.weight for m in layers.values()]
        if not all(p.requires_grad for p in params):
            raise PassError("PruneMasks(importance=\"grad\") needs weights that require grad; some layers are frozen. "
                            "Exclude them with where= or use importance=\"magnitude\".", pass_name=self.name)
        with keep_state(gm), torch.enable_grad():
            out = node_values(gm, ctx, ["output"], inputs=self.batch, grad=True)["output"]
            loss = self.loss_fn(out)  # type: ignore[misc]
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        return {p: (g if g is not None else torch.zeros_like(w)).detach() for (p, w), g in zip(((k, m.weight) for k, m in layers.items()), grads)}

    def _activations(self, gm: GraphModule, ctx: PassContext, layers: dict[str, nn.Module], inputs: bool) -> dict[str, Tensor]:
        """Per channel: L2 norm of each layer's input (``inputs=True``) or mean |output|."""
        calls = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) in layers]
        names = [n.args[0] if inputs else n for n in calls]
        values = node_values(gm, ctx, [n for n in names if isinstance(n, Node)], inputs=self.batch)
        stats: dict[str, Tensor] = {}
        for call, src in zip(calls, names):
            v = values.get(src.name) if isinstance(src, Node) else None
            if not isinstance(v, Tensor) or v.dim() < 1:
                continue
            layer = layers[str(call.target)]
            axis = v.dim() - 1 if isinstance(layer, nn.Linear) or v.dim() == 1 else 1
            dims = [d for d in range(v.dim()) if d != axis]
            s = torch.linalg.vector_norm(v.float(), 2, dim=dims) if inputs else v.float().abs().mean(dim=dims)
            stats[str(call.target)] = stats[str(call.target)] + s if str(call.target) in stats else s
        return stats

    # -- masks ----------------------------------------------------------------------------------
    def _unstructured(self, gm: GraphModule, ctx: PassContext, layers: dict[str, nn.Module]) -> dict[str, dict[str, Tensor]]:
        scores = self._weight_scores(gm, ctx, layers)
        masks = {p: torch.ones_like(s, dtype=layers[p].weight.dtype) for p, s in scores.items()}
        if self.scope == "layer":
            for p, s in scores.items():
                masks[p].view(-1)[_lowest(s, round(self.amount * s.numel()))] = 0
        else:
            flat = torch.cat([s.flatten().cpu() for s in scores.values()])
            picked = _lowest(flat, round(self.amount * flat.numel()))
            offset = 0
            for p, s in scores.items():
                here = picked[(picked >= offset) & (picked < offset + s.numel())] - offset
                masks[p].view(-1)[here.to(masks[p].device)] = 0
                offset += s.numel()
        return {p: {"weight": m} for p, m in masks.items()}

    def _channel_scores(self, gm: GraphModule, ctx: PassContext, layers: dict[str, nn.Module]) -> dict[str, Tensor]:
        """One score per output channel, divided by the layer's mean so layers compare fairly."""
        if self.importance == "activation":
            raw = self._activations(gm, ctx, layers, inputs=False)
        else:
            w = self._weight_scores(gm, ctx, layers) if self.importance == "grad" else {p: m.weight.detach().float() for p, m in layers.items()}
            raw = {}
            for p, m in layers.items():
                t = w[p].transpose(0, 1) if isinstance(m, nn.modules.conv._ConvTransposeNd) else w[p]
                t = t.flatten(1)
                raw[p] = t.abs().sum(1) if self.importance == "grad" or self.norm == 1 else t.norm(dim=1)
        return {p: s.cpu() / (s.mean().cpu() + 1e-12) for p, s in raw.items()}

    def _structured(self, gm: GraphModule, ctx: PassContext, layers: dict[str, nn.Module],
                    notes: list[str]) -> dict[str, dict[str, Tensor]]:
        if ctx.inputs is None:
            raise MissingInputsError("PruneMasks(structured=\"channels\") needs example inputs to find coupled channels: "
                            "call instrument(model, passes, example_inputs=(x,)).", pass_name=self.name)
        producers = {}
        outputs = set() if self.prune_outputs else output_layers(gm, set(layers))
        for p in sorted(outputs):
            notes.append(f"kept {p}: its output channels are the model's outputs (pruning one fixes that output at 0); "
                         "PruneMasks(prune_outputs=True) prunes them too.")
        for p, m in layers.items():
            if p in outputs:
                continue
            if isinstance(m, nn.modules.conv._ConvTransposeNd) and m.groups != 1:
                notes.append(f"kept {p}: grouped ConvTranspose channels are not pruned.")
                continue
            producers[p] = m.weight.shape[1] if isinstance(m, nn.modules.conv._ConvTransposeNd) else m.weight.shape[0]
        layers = {p: layers[p] for p in producers}
        groups = channel_groups(gm, ctx, producers)
        scores = self._channel_scores(gm, ctx, layers)
        group_score = [sum(float(scores[p][c]) for p, c in g) / len(g) for g in groups.groups]
        pruned: set[int] = set()
        pools = groups.families() if self.scope == "layer" else [list(range(len(groups.groups)))]
        for pool in pools:
            want = round(self.amount * len(pool))
            free = sorted((i for i in pool if groups.pinned[i] is None), key=lambda i: (group_score[i], i))
            pruned.update(free[:want])
            if want > len(free):
                reasons = sorted({groups.pinned[i] for i in pool if groups.pinned[i]})
                notes.append(f"wanted {want} channel groups but only {len(free)} can be pruned: {'; '.join(reasons)}.")
        masks: dict[str, dict[str, Tensor]] = {}
        for i in sorted(pruned):
            for p, c in groups.groups[i]:
                m = layers[p]
                if p not in masks:
                    masks[p] = {"weight": torch.ones_like(m.weight)}
                    if m.bias is not None:
                        masks[p]["bias"] = torch.ones_like(m.bias)
                if isinstance(m, nn.modules.conv._ConvTransposeNd):
                    masks[p]["weight"][:, c] = 0
                else:
                    masks[p]["weight"][c] = 0
                if "bias" in masks[p]:
                    masks[p]["bias"][c] = 0
        for path, owners in groups.followers.items():
            bn = gm.get_submodule(path)
            cut = [c for c, g in enumerate(owners) if g in pruned]
            if cut and bn.affine:
                masks[path] = {"weight": torch.ones_like(bn.weight), "bias": torch.ones_like(bn.bias)}
                masks[path]["weight"][cut] = 0
                masks[path]["bias"][cut] = 0
        return masks

    # -- the pass -------------------------------------------------------------------------------
    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        layers = self._layers(gm, ctx)
        notes: list[str] = []
        if not layers:
            aten = self._aten_layers(gm, ctx)
            if aten:
                self._refuse_export(gm, aten)
                return self._prune_pairs(gm, ctx, aten) if self.structured else self._mask_reads(gm, ctx, aten)
            return PassResult(gm, notes=["no conv or linear layers selected; nothing pruned."])
        masks = self._structured(gm, ctx, layers, notes) if self.structured else self._unstructured(gm, ctx, layers)
        replaced: dict[str, str] = {}
        for path, layer_masks in masks.items():
            layer = gm.get_submodule(path)
            module = _bake(layer, layer_masks) if self.bake else Masked(layer, path, layer_masks)
            target = ctx.add_module(gm, f"{'baked' if self.bake else 'masked'}_{path}", module)
            w = layer_masks["weight"]
            info = {"layer": path, "sparsity": 1.0 - float(w.float().mean()), "masked": int((w == 0).sum()),
                    "weights": w.numel(), "baked": self.bake}
            if self.structured:
                info["channels"] = _zero_channels(layer, w)
            for node in [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) == path]:
                node.target = target
                ctx.copy_meta(node, node)
                node_meta(node).module_type = type(layer).__name__
                ctx.record(node, info, stands_for=path)
                replaced[node.name] = node.name
        stats = sparsity(gm)
        for path, s in stats["layers"].items():
            notes.append(f"{path}: {s:.1%} of weights masked.")
        notes.append(f"global: {stats['global']:.1%} of {stats['weights']} weights in pruned layers masked.")
        return PassResult(gm, replaced=replaced, notes=notes)

    def _prune_pairs(self, gm: GraphModule, ctx: PassContext,
                     aten: dict[str, tuple[nn.Module, dict[str, Node]]]) -> PassResult:
        """Graphs calling ``linear`` as a function: a feed-forward block's hidden channels (``prune_aten``)."""
        layers = {p: layer for p, (layer, _) in aten.items() if isinstance(layer, nn.Linear)}
        pairs, why = ffn_pairs(gm, layers)
        if not pairs:
            example = next(iter(why.items()), ("?", "no Linear layers"))
            raise PassError(
                f"PruneMasks(structured=\"channels\"): {type(gm).__name__}'s graph calls its layers as functions, and "
                "none of its Linear layers feeds its channels, through an activation, into exactly one other Linear "
                f"(a feed-forward block), so no channel can be pruned without changing other paths: {example[0]}: "
                f"{example[1]}. Use structured=False here (single weights; works on this graph).", pass_name=self.name)
        cut = pair_masks(pairs, layers, self.amount, self.scope, self.norm)
        added: list[Node] = []
        notes: list[str] = []
        for pair in pairs:
            c = cut[pair]
            producer, consumer = layers[pair.producer], layers[pair.consumer]
            channels = [int(i) for i in c.nonzero().flatten()]
            masks = {"weight": torch.ones_like(producer.weight), "consumer_weight": torch.ones_like(consumer.weight)}
            masks["weight"][c] = 0
            masks["consumer_weight"][:, c.to(consumer.weight.device)] = 0
            if "bias" in pair.reads:
                masks["bias"] = torch.ones_like(producer.bias)
                masks["bias"][c] = 0
            for key, read in pair.reads.items():
                path = pair.consumer if key == "consumer_weight" else pair.producer
                name = "weight" if key != "bias" else "bias"
                w = masks[key]
                info = {"layer": path, "sparsity": 1.0 - float(w.float().mean()), "masked": int((w == 0).sum()),
                        "weights": w.numel(), "baked": False,
                        ("channels" if key != "consumer_weight" else "input_channels"): channels}
                new = ctx.insert_after(read, MaskedValue(path, name, w), rewire=True, hint=f"masked_{path}_{name}",
                                       after=before_first_user(read))
                ctx.record(new, info, stands_for=path)
                added.append(new)
            notes.append(f"{pair.producer} -> {pair.consumer}: {len(channels)} of {len(c)} hidden channels pruned "
                         f"(rows of {pair.producer}, input columns of {pair.consumer}).")
        kept = [f"{p} ({w})" for p, w in why.items() if p not in {q.consumer for q in pairs}]
        kept += [f"{p} (a conv called as a function: its channels are pruned on module-level graphs only)"
                 for p, (layer, _) in aten.items() if p not in layers]
        if kept:
            notes.append(f"kept {len(kept)} layer(s) whole: " + "; ".join(kept[:6]) + ("; ..." if len(kept) > 6 else "") + ".")
        return PassResult(gm, added=added, notes=notes)

    def _mask_reads(self, gm: GraphModule, ctx: PassContext,
                    aten: dict[str, tuple[nn.Module, dict[str, Node]]]) -> PassResult:
        """Export graphs: every read of a pruned weight goes through a ``MaskedValue``."""
        layers = {p: SimpleNamespace(weight=folded_value(gm, r["weight"])) if live_fold_of(r["weight"]) else layer
                  for p, (layer, r) in aten.items()}  # a folded layer is ranked by the weight it computes with
        masks = self._unstructured(gm, ctx, layers)  # type: ignore[arg-type]
        added: list[Node] = []
        for path, layer_masks in masks.items():
            w = layer_masks["weight"]
            info = {"layer": path, "sparsity": 1.0 - float(w.float().mean()), "masked": int((w == 0).sum()),
                    "weights": w.numel(), "baked": False}
            read = aten[path][1]["weight"]
            new = ctx.insert_after(read, MaskedValue(path, "weight", w), rewire=True, hint=f"masked_{path}",
                                   after=before_first_user(read))
            ctx.record(new, info, stands_for=path)
            added.append(new)
        stats = sparsity(gm)
        notes = [f"{p}: {s:.1%} of weights masked." for p, s in stats["layers"].items()]
        notes.append(f"global: {stats['global']:.1%} of {stats['weights']} weights in pruned layers masked.")
        return PassResult(gm, added=added, notes=notes)


def output_layers(gm: GraphModule, layers: set[str]) -> set[str]:
    """Layers whose output channels reach the graph's output without passing another conv/linear."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_module" or str(node.target) not in layers:
            continue
        todo, seen = list(node.users), set()
        while todo:
            user = todo.pop()
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                found.add(str(node.target))
                break
            if user.op == "call_module" and str(user.target) in layers:
                continue  # a layer mixes the channels: what comes after is its own
            todo.extend(user.users)
    return found


def _zero_channels(layer: nn.Module, w: Tensor) -> list[int]:
    """Output channels whose mask is zero throughout."""
    if isinstance(layer, nn.modules.conv._ConvTransposeNd):
        w = w.transpose(0, 1)
    rows = (w == 0).reshape(w.shape[0], -1).all(1)
    return [int(i) for i in rows.nonzero().flatten()]


def _masks_of(module: nn.Module) -> dict[str, Tensor] | None:
    if isinstance(module, MaskedValue):
        return {module.name: module.mask_value}
    if isinstance(module, Masked):
        return {n: module.mask(n) for n in module.names}
    return getattr(module, "_fxdebug_masks", None)


def sparsity(gm: GraphModule) -> dict[str, Any]:
    """``{"layers": {layer path: fraction of weights masked}, "global": fraction, "weights": count}``.

    Read from the masks in the graph(s) (``gm`` a GraphModule or an instrumented module, live or not: each of its
    ``parts()``), so it is what the model really computes with. Batch-norm
    parameters zeroed along with pruned channels are not counted.
    """
    layers: dict[str, float] = {}
    masked = total = 0
    graphs = list(gm.parts().values()) if callable(getattr(gm, "parts", None)) else [gm]  # an Instrumented: each part
    for part, node in ((p, n) for p in graphs for n in p.graph.nodes):
        mod = get_module(part, node)
        masks = _masks_of(mod) if mod is not None else None
        if not masks or "weight" not in masks or masks["weight"].dim() < 2:
            continue  # batch-norm followers of pruned channels are not counted as weights
        path = node_meta(node).stands_for or str(node.target)
        if path in layers:
            continue
        w = masks["weight"]
        zeros = int((w == 0).sum())
        layers[path] = zeros / w.numel()
        masked, total = masked + zeros, total + w.numel()
    return {"layers": layers, "global": masked / total if total else 0.0, "weights": total}


def unmask(gm: GraphModule) -> GraphModule:
    """Undo graph masks: every masked call calls its original layer again (in place on ``gm``, or on each of a
    snapshot instrumented module's ``parts()``). A live capture's graphs are Dynamo's, compiled as they were
    captured: an edit to them would not be what runs, so that is refused."""
    if getattr(getattr(gm, "trace_info", None), "frontend", None) == "dynamo":
        raise UsageError("unmask(): this module is the live (Dynamo) capture, whose graphs run as Dynamo compiled "
                         "them; an edit here would not be what runs. Instrument the model again without PruneMasks "
                         "(or with frontend='symbolic' to edit one graph).", pass_name=PruneMasks.name)
    for part in list(gm.parts().values()) if callable(getattr(gm, "parts", None)) else [gm]:
        for node in list(part.graph.nodes):
            mod = get_module(part, node)
            if isinstance(mod, MaskedValue):  # an export or Dynamo graph's masked weight read
                node.replace_all_uses_with(node.args[0])
                part.graph.erase_node(node)
                continue
            if isinstance(mod, Masked):
                node.target = mod.path
                meta = node_meta(node)
                meta.transforms = {k: v for k, v in meta.transforms.items() if k != PruneMasks.name}
                meta.raw.pop("stands_for", None)
        part.recompile()
    return gm
