"""``to_module(shrink=True)``: remove pruned channels physically, across coupled layers.

Structured pruning masks whole output channels to zero; the layers keep their size, so the model
is no smaller and no faster. Here the plain module from ``to_module`` is rewritten so that
channels known to be exactly zero are not computed at all:

* a conv / linear output channel whose weights and bias are all zero is dead; so is a batch-norm
  channel whose weight and bias are zero (pruning groups mask the follower with the layer);
* each value in the graph is tracked as *full* or *sliced* (which channel indices along which
  dimension are physically present; the others are zero). Dead channels are removed where they
  are produced, and every consumer is rewritten for the slice: a conv or linear drops the
  matching input columns, a batch-norm its statistics, zero-preserving ops (ReLU, GELU, SiLU,
  pooling, dropout, scaling, ``flatten``) pass the slice on, residual adds and products align
  their operands' slices, concatenations offset them;
* any other consumer (a reshape into attention heads, a layer-norm, the graph output) gets the
  full tensor back, zeros re-inserted by one gather (``reindex``): correct everywhere, smaller where
  the graph allows.

In-place writes into a re-laid-out value (ResNet's ``out += identity``) are rewritten to write into
the new copy when nothing else reads the old value; stateless modules called twice (torchvision's
one ``relu`` per block) pass slices on. Where a case cannot be rewritten safely, the module is left
whole with a ``UserWarning`` saying why (also in ``graph_record(module)["shrink"]``).

Parameter count and FLOPs drop; outputs equal the masked model's up to float summation order,
which is checked on inputs built from the recorded shapes before the result is returned.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxdebug.errors import FxDebugError
from fxdebug.graph.meta import fx_meta, graph_record

__all__ = ["reindex", "shrink"]


def reindex(x: Tensor, dim: int, rank: int, index: Tensor) -> Tensor:
    """Channel ``index[j]`` of ``x`` along ``dim`` at position ``j``; an index one past the end reads 0.

    One zero channel is padded at the end and gathered wherever a channel is absent. Written with
    ``F.pad`` and ``index_select`` only, so it traces (``torch.load`` of a GraphModule re-traces
    it), exports and scripts.
    """
    return F.pad(x, [0, 0] * (rank - 1 - dim) + [0, 1]).index_select(dim, index)


@dataclass(frozen=True)
class Keep:
    """The channels physically present along ``dim`` (of ``size`` logical ones); the rest are zero."""

    dim: int
    idx: tuple[int, ...]
    size: int


_UNARY_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Mish,
                  nn.Dropout, nn.Identity)
_POOL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
                 nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool2d)
_UNARY_FUNCTIONS: set[Any] = {F.relu, torch.relu, F.relu6, F.leaky_relu, F.gelu, F.silu, torch.tanh, F.tanh,
                              F.hardtanh, F.hardswish, F.mish, F.dropout, torch.nn.functional.relu_,
                              torch.relu_}
_POOL_FUNCTIONS: set[Any] = {F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
                             F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d}
_UNARY_METHODS = {"relu", "relu_", "tanh", "contiguous", "clone"}


_FRESH_MODULES = (nn.modules.conv._ConvNd, nn.Linear, nn.modules.batchnorm._BatchNorm)
_FRESH_FUNCTIONS: set[Any] = {operator.add, torch.add, operator.sub, torch.sub, operator.mul, torch.mul, torch.cat}  # + reindex, below


class _Abort(Exception):
    """A case shrinking cannot rewrite safely (an in-place op on a sliced value): leave the model whole."""


class _Shrinker:
    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.keep: dict[Node, Keep | None] = {}
        self.calls = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
        self.buffers = 0

    # -- helpers --------------------------------------------------------------------------------
    def rank(self, node: Node) -> int | None:
        shape = fx_meta(node).get("shape")
        return len(shape) if shape is not None else None

    def size(self, node: Node, dim: int) -> int | None:
        shape = fx_meta(node).get("shape")
        return int(shape[dim]) if shape is not None and -len(shape) <= dim < len(shape) else None

    def const(self, values: list[int]) -> Node:
        name = f"_shrink_index_{self.buffers}"
        self.buffers += 1
        self.gm.register_buffer(name, torch.tensor(values, dtype=torch.long), persistent=False)
        return self.graph.get_attr(name)

    def convert(self, user: Node, value: Node, want: Keep | None) -> Node:
        """``value`` in the layout ``want`` (``None``: full), via one ``reindex`` before ``user``."""
        have = self.keep.get(value)
        if have == want or (have is None and want is None):
            return value
        if have is None:
            assert want is not None
            have = Keep(want.dim, tuple(range(want.size)), want.size)
        target = want if want is not None else Keep(have.dim, tuple(range(have.size)), have.size)
        pos = {c: i for i, c in enumerate(have.idx)}
        rank = self.rank(value)
        if rank is None:
            raise _Abort(f"the shape of {value.name} is not known")
        with self.graph.inserting_before(user):
            index = self.const([pos.get(c, len(have.idx)) for c in target.idx])
            new = self.graph.call_function(reindex, (value, have.dim, rank, index))
        self.keep[new] = want
        fx_meta(new).update(module=fx_meta(user).get("module", ""), role_shrink=True)
        return new

    def full_inputs(self, node: Node) -> None:
        """``node`` reads its inputs whole: re-insert zeros into every sliced input."""
        for inp in list(node.all_input_nodes):
            if self.keep.get(inp) is not None:
                self.check_write(node, inp)
                node.replace_input_with(inp, self.convert(node, inp, None))
        self.keep[node] = None

    def check_write(self, node: Node, inp: Node) -> None:
        """``node`` is about to read a re-laid-out copy of ``inp``: if it writes into ``inp`` in place
        (``out += identity``), writing into the copy instead is the same only when nothing else
        reads ``inp`` and ``inp`` is a tensor of its own (not a view of, or the same object as, another)."""
        if not (_in_place(node) and inp is (node.args[0] if node.args else None)):
            return
        if set(inp.users) != {node} or not self.fresh(inp):
            raise _Abort(f"{node.name} writes in place into a sliced value that is also read elsewhere")

    def fresh(self, node: Node) -> bool:
        """Whether ``node``'s value is a new tensor (a conv's, a batch-norm's, a sum's), not an alias."""
        if node.op == "call_module":
            return isinstance(self.gm.get_submodule(str(node.target)), _FRESH_MODULES)
        return node.op == "call_function" and node.target in _FRESH_FUNCTIONS

    def norm_dim(self, node: Node, dim: int) -> int | None:
        r = self.rank(node)
        return None if r is None else dim % r if -r <= dim < r else None

    # -- rules ----------------------------------------------------------------------------------
    def visit(self, node: Node) -> None:
        if node.op in ("placeholder", "get_attr"):
            self.keep[node] = None
            return
        if node.op == "output" or not any(self.keep.get(i) is not None for i in node.all_input_nodes):
            if node.op == "call_module" and self.calls[str(node.target)] == 1:
                self.keep[node] = self.module(node, None)
                return
            if node.op == "output":
                self.full_inputs(node)
            else:
                self.keep[node] = None
            return
        rule = self.rule(node)
        if rule is None:
            self.full_inputs(node)
        else:
            self.keep[node] = rule(node)

    def rule(self, node: Node) -> Callable[[Node], Keep | None] | None:
        if node.op == "call_module":
            stateless = isinstance(self.gm.get_submodule(str(node.target)), _UNARY_MODULES + _POOL_MODULES)
            if self.calls[str(node.target)] != 1 and not stateless:
                return None  # a layer called twice cannot be sliced for one of its calls
            return lambda n: self.module(n, self.keep.get(n.args[0]) if n.args and isinstance(n.args[0], Node) else None)
        target = node.target
        if node.op == "call_method":
            if target in _UNARY_METHODS:
                return self.passthrough
            if target == "flatten":
                return self.flatten
            if target in ("add", "sub", "add_"):
                return self.add
            if target in ("mul", "mul_"):
                return self.mul
            return None
        if target in _UNARY_FUNCTIONS:
            return self.passthrough
        if target in _POOL_FUNCTIONS:
            return self.channel_passthrough
        if target in (operator.add, operator.iadd, torch.add, operator.sub, torch.sub):
            return self.add
        if target in (operator.mul, operator.imul, torch.mul):
            return self.mul
        if target in (operator.truediv, torch.div) and not isinstance(node.args[1], Node):
            return self.passthrough
        if target is torch.cat:
            return self.cat
        if target is torch.flatten:
            return self.flatten
        return None

    def passthrough(self, node: Node) -> Keep | None:
        return self.keep.get(node.args[0]) if isinstance(node.args[0], Node) else None

    def channel_passthrough(self, node: Node) -> Keep | None:
        first = node.args[0]
        have = self.keep.get(first) if isinstance(first, Node) else None
        if have is None or have.dim != 1:
            self.full_inputs(node)
            return None
        return have

    def add(self, node: Node) -> Keep | None:
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else None
        if not (isinstance(a, Node) and isinstance(b, Node)) or node.kwargs or self.rank(a) != self.rank(b) \
                or fx_meta(a).get("shape") != fx_meta(b).get("shape"):
            self.full_inputs(node)
            return None
        ka, kb = self.keep.get(a), self.keep.get(b)
        if ka is not None and kb is not None and ka.dim != kb.dim:
            self.full_inputs(node)
            return None
        if ka is None or kb is None:
            self.full_inputs(node)
            return None
        want = Keep(ka.dim, tuple(sorted(set(ka.idx) | set(kb.idx))), ka.size)
        if want != ka:
            self.check_write(node, a)
        node.replace_input_with(a, self.convert(node, a, want)) if want != ka else None
        node.replace_input_with(b, self.convert(node, b, want)) if want != kb else None
        return want

    def mul(self, node: Node) -> Keep | None:
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else None
        if isinstance(a, Node) and not isinstance(b, Node):
            return self.keep.get(a)
        if isinstance(b, Node) and not isinstance(a, Node):
            return self.keep.get(b)
        if not (isinstance(a, Node) and isinstance(b, Node)) or fx_meta(a).get("shape") != fx_meta(b).get("shape"):
            self.full_inputs(node)
            return None
        ka, kb = self.keep.get(a), self.keep.get(b)
        base = ka or kb
        assert base is not None
        if (ka is not None and kb is not None and ka.dim != kb.dim) or _in_place(node):
            self.full_inputs(node)
            return None
        idx = set(base.idx)
        for k in (ka, kb):
            if k is not None:
                idx &= set(k.idx)
        want = Keep(base.dim, tuple(sorted(idx)) or base.idx[:1], base.size)
        for v, k in ((a, ka), (b, kb)):
            if k != want:
                node.replace_input_with(v, self.convert(node, v, want))
        return want

    def cat(self, node: Node) -> Keep | None:
        parts = node.args[0]
        given: Any = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        dim = self.norm_dim(node, given)
        if not isinstance(parts, (list, tuple)) or dim is None or not all(isinstance(p, Node) for p in parts):
            self.full_inputs(node)
            return None
        idx: list[int] = []
        offset = 0
        for p in (q for q in parts if isinstance(q, Node)):
            k = self.keep.get(p)
            n = self.size(p, dim)
            if n is None or (k is not None and k.dim != dim):
                self.full_inputs(node)
                return None
            idx.extend(offset + c for c in (k.idx if k is not None else range(n)))
            offset += n
        return Keep(dim, tuple(idx), offset)

    def flatten(self, node: Node) -> Keep | None:
        x = node.args[0]
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        if not isinstance(x, Node):
            self.full_inputs(node)
            return None
        have = self.keep.get(x)
        shape = fx_meta(x).get("shape")
        if have is None or shape is None or start != 1 or end not in (-1, len(shape) - 1) or have.dim != 1:
            self.full_inputs(node)
            return None
        inner = 1
        for s in shape[2:]:
            inner *= int(s)
        return Keep(1, tuple(c * inner + j for c in have.idx for j in range(inner)), have.size * inner)

    def module(self, node: Node, have: Keep | None) -> Keep | None:
        mod = self.gm.get_submodule(str(node.target))
        if isinstance(mod, nn.modules.conv._ConvNd) and not isinstance(mod, nn.modules.conv._ConvTransposeNd):
            return self.conv(node, mod, have)
        if isinstance(mod, nn.Linear):
            return self.linear(node, mod, have)
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and have is not None and have.dim == 1 \
                and mod.running_mean is not None:
            _slice(mod, ("weight", "bias", "running_mean", "running_var"), have.idx, 0)
            mod.num_features = len(have.idx)
            return have
        if isinstance(mod, _UNARY_MODULES) and have is not None:
            return have
        if isinstance(mod, _POOL_MODULES) and have is not None and have.dim == 1:
            return have
        if have is not None:
            self.full_inputs(node)
        return None

    def conv(self, node: Node, mod: Any, have: Keep | None) -> Keep | None:
        out_dim = 1
        if have is not None and have.dim != 1:
            self.full_inputs(node)
            have = None
        if mod.groups != 1:
            if have is None or mod.groups != mod.in_channels or mod.out_channels != mod.in_channels:
                if have is not None:
                    self.full_inputs(node)
                return None
            _slice(mod, ("weight", "bias"), have.idx, 0)  # depthwise: channel c in, channel c out
            mod.in_channels = mod.out_channels = mod.groups = len(have.idx)
            return have
        if have is not None:
            _slice(mod, ("weight",), have.idx, 1)
            mod.in_channels = len(have.idx)
        alive = _alive_rows(mod)
        if alive is None:
            return None
        _slice(mod, ("weight", "bias"), alive, 0)
        full = mod.out_channels
        mod.out_channels = len(alive)
        return Keep(out_dim, alive, full)

    def linear(self, node: Node, mod: nn.Linear, have: Keep | None) -> Keep | None:
        rank = self.rank(node.args[0]) if isinstance(node.args[0], Node) else None
        if have is not None and (rank is None or have.dim != rank - 1):
            self.full_inputs(node)
            have = None
        if have is not None:
            _slice(mod, ("weight",), have.idx, 1)
            mod.in_features = len(have.idx)
        alive = _alive_rows(mod)
        out_rank = self.rank(node)
        if alive is None or out_rank is None:
            return None
        _slice(mod, ("weight", "bias"), alive, 0)
        full = mod.out_features
        mod.out_features = len(alive)
        return Keep(out_rank - 1, alive, full)


_FRESH_FUNCTIONS.add(reindex)


def _in_place(node: Node) -> bool:
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name.endswith("_") or node.target in (operator.iadd, operator.imul)


def _alive_rows(mod: Any) -> tuple[int, ...] | None:
    """Output channels with any non-zero weight or bias; ``None`` when none is dead."""
    w = mod.weight.detach().reshape(mod.weight.shape[0], -1)
    dead = (w == 0).all(1)
    if getattr(mod, "bias", None) is not None:
        dead &= mod.bias.detach() == 0
    if not bool(dead.any()):
        return None
    alive = tuple(int(i) for i in (~dead).nonzero().flatten())
    return alive or (0,)  # keep one channel: a layer with no outputs is not a layer


def _slice(mod: nn.Module, names: tuple[str, ...], idx: tuple[int, ...], dim: int) -> None:
    index = torch.tensor(idx, dtype=torch.long)
    for name in names:
        t = getattr(mod, name, None)
        if t is None:
            continue
        new = t.detach().index_select(dim, index.to(t.device)).clone()
        if isinstance(t, nn.Parameter):
            setattr(mod, name, nn.Parameter(new, requires_grad=t.requires_grad))
        else:
            setattr(mod, name, new)


def _example(gm: GraphModule) -> list[Any] | None:
    values = []
    gen = torch.Generator().manual_seed(0)
    for ph in (n for n in gm.graph.nodes if n.op == "placeholder"):
        meta = fx_meta(ph)
        shape, dtype = meta.get("shape"), meta.get("dtype")
        if shape is None:
            if ph.args:  # a default (mask=None)
                values.append(ph.args[0])
                continue
            return None
        dt = getattr(torch, str(dtype)) if dtype else torch.float32
        values.append(torch.randn(shape, generator=gen).to(dt) if dt.is_floating_point else torch.zeros(shape, dtype=dt))
    return values


def shrink(gm: GraphModule) -> GraphModule:
    """Remove dead channels from ``gm`` (a plain module from ``to_module``, rewritten in place).

    Returns ``gm``; raises ``FxDebugError`` if the rewritten module does not reproduce the original
    on inputs of the recorded shapes (it is then left unchanged).
    """
    import copy
    import warnings

    with warnings.catch_warnings():  # an export graph's TreeSpecs trip torch's LeafSpec deprecation on copy
        warnings.simplefilter("ignore", FutureWarning)
        original = copy.deepcopy(gm)
    shrinker = _Shrinker(gm)
    try:
        for node in list(gm.graph.nodes):
            shrinker.visit(node)
    except _Abort as why:
        graph_record(original)["shrink"] = f"not shrunk: {why}"
        warnings.warn(f"to_module(shrink=True) left the module whole: {why}. Its outputs are the masked model's; "
                      "graph_record(module)['shrink'] keeps this reason.", UserWarning, stacklevel=3)
        return original
    gm.graph.lint()
    gm.recompile()
    example = _example(original)
    if example is not None:
        with torch.no_grad():
            want, got = original(*example), gm(*example)
        for a, b in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)):
            if isinstance(a, Tensor) and not torch.allclose(a, b, atol=1e-5, rtol=1e-4, equal_nan=True):
                raise FxDebugError(
                    "to_module(shrink=True): the shrunk module does not reproduce the masked one on inputs of the "
                    f"recorded shapes (max |diff| {(a - b).abs().max().item():.3g}); please report it, and use "
                    "to_module(shrink=False) meanwhile.")
    graph_record(gm)["shrink"] = "shrunk"
    return gm
