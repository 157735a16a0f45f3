"""``ShapeAssert``: every tensor keeps the shape and dtype the example inputs gave it.

At instrumentation time the example inputs fix each tensor-valued node's shape and dtype. Dims
listed in ``dynamic_dims`` (the batch dim by default) and dims that differ between the example
inputs and ``other_inputs`` are symbolic and print as letters (``N`` for the batch size). At run
time the first node whose output differs raises ``ShapeMismatchError``::

    node 'conv1' (module layer2.0.conv1, Conv2d) produced (N, 128, 14, 14); expected
    (N, 128, 28, 28). Inputs: (N, 64, 28, 28). Defined at model.py:41 `out = self.conv1(x)`.

The check reads ``tensor.shape`` and ``tensor.dtype`` — host metadata — and does no reduction:
no device work, no sync. When an op itself fails on a bad shape (a Linear fed the wrong number
of features), the instrumented module already re-raises that as ``ShapeMismatchError`` naming
the node and its inputs' shapes; this pass catches what does *not* fail, just goes wrong.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from torch import Tensor
from torch.fx import GraphModule, Node

import fxdebug
from fxdebug import ShapeMismatchError
from fxdebug.authoring import ObservationContext, PassContext, PassResult, Probe, Reductions, TensorSpec, Where

__all__ = ["ShapeAssert"]

_OPS = ("placeholder", "call_module", "call_function", "call_method")
_LETTERS = "NLMKPQRSTUVW"

Dims = dict[int, str]  # dim index -> symbol


def render(shape: Sequence[int], symbols: Dims) -> str:
    """``(N, 128, 14, 14)``: a shape with its symbolic dims as letters."""
    dims = [symbols.get(i, str(d)) for i, d in enumerate(shape)]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


class ShapeProbe(Probe):
    """Compares the observed tensor's shape and dtype with the expected ones; metadata only."""

    key = "shape-assert"
    wants_inputs = True

    def __init__(self, node: Node, expected: TensorSpec, symbols: Dims, inputs: list[tuple[str, Dims]],
                 check_dtype: bool) -> None:
        self.shape = tuple(expected.shape)
        self.dtype = expected.dtype
        self.symbols = symbols
        self.inputs = inputs
        self.check_dtype = check_dtype
        self.describe = fxdebug.describe(node)
        self.node_name, self.module, self.op = node.name, fxdebug.module_path(node), fxdebug.op_label(node)
        self.where = fxdebug.source_line(node)
        users = [u for u in node.users if not fxdebug.is_instrumentation(u) and u.op != "output"]
        self.feeds = f" It feeds {', '.join(fxdebug.describe(u) for u in users[:3])}." if node.op == "placeholder" and users else ""

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        if ctx.phase != "forward":
            return
        shape = r.x.shape
        ok = len(shape) == len(self.shape) and all(
            i in self.symbols or a == e for i, (a, e) in enumerate(zip(shape, self.shape)))
        if ok and (not self.check_dtype or r.x.dtype == self.dtype):
            return
        raise ShapeMismatchError(self._message(r.x, ctx.inputs), node=self.node_name, module=self.module, op=self.op)

    def _message(self, x: Tensor, inputs: tuple[Any, ...]) -> str:
        same_rank = len(x.shape) == len(self.shape)
        got = render(x.shape, self.symbols if same_rank else {})
        want = render(self.shape, self.symbols)
        if self.check_dtype and x.dtype != self.dtype:
            got, want = f"{_dt(x.dtype)} {got}", f"{_dt(self.dtype)} {want}"
        shown = []
        for (name, symbols), value in zip(self.inputs, inputs):
            if isinstance(value, Tensor):
                shown.append(render(value.shape, symbols if len(symbols) == 0 or max(symbols) < value.dim() else {}))
        ins = f" Inputs: {', '.join(shown)}." if shown else ""
        at = f" Defined at {self.where}." if self.where else ""
        return (f"{self.describe} produced {got}; expected {want}.{ins}{self.feeds}{at} The expected shape comes from the "
                "example inputs given to instrument(); if this dim may legitimately vary, list it in "
                "ShapeAssert(dynamic_dims=...) or pass other_inputs=.")


def _dt(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


class ShapeAssert(fxdebug.Pass):
    """Raise ``ShapeMismatchError`` at the first node whose output shape or dtype differs from
    what the example inputs produced.

    Args:
        dynamic_dims: dims (per tensor, negative allowed) that may vary: the batch dim by default.
        other_inputs: a second set of example inputs (another batch size or sequence length);
            every dim that differs between the two runs is symbolic as well.
        check_dtype: also require the example dtype (turn off under autocast).
        where: limit the checked nodes (globs over module paths / node names, or a predicate).
    """

    name = "shape-assert"
    observe_only = True
    requires = ("shapes",)

    def __init__(self, dynamic_dims: Iterable[int] = (0,), *, other_inputs: Any = None, check_dtype: bool = True,
                 where: Where = None) -> None:
        super().__init__(where=where)
        self.dynamic_dims = tuple(dynamic_dims)
        self.other_inputs = other_inputs
        self.check_dtype = check_dtype

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        specs = ctx.specs(gm)
        other = PassContext(self.other_inputs).specs(gm) if self.other_inputs is not None else {}
        names = _SymbolNames(gm, specs)
        symbolic: dict[str, Dims] = {}
        for name, spec in specs.items():
            if isinstance(spec, TensorSpec):
                symbolic[name] = names.dims(spec, self._dynamic(spec, other.get(name)))
        added: list[Node | None] = []
        for node in ctx.nodes(gm, ops=_OPS, tensor_outputs=True):
            spec = specs[node.name]
            inputs = [(a.name, symbolic.get(a.name, {})) for a in node.all_input_nodes if not fxdebug.is_instrumentation(a)]
            probe = ShapeProbe(node, spec, symbolic[node.name], inputs, self.check_dtype)
            added.append(ctx.observe(node, probe))
        return PassResult(gm, added=added)

    def _dynamic(self, spec: TensorSpec, other: Any) -> set[int]:
        rank = len(spec.shape)
        dims = {d % rank for d in self.dynamic_dims if rank and -rank <= d < rank}
        if isinstance(other, TensorSpec) and len(other.shape) == rank:
            dims |= {i for i, (a, b) in enumerate(zip(spec.shape, other.shape)) if a != b}
        return dims


class _SymbolNames:
    """Letters for symbolic dims, by example size: the batch size is ``N``, others ``L``, ``M``..."""

    def __init__(self, gm: GraphModule, specs: dict[str, Any]) -> None:
        self.by_size: dict[int, str] = {}
        for n in gm.graph.nodes:
            spec = specs.get(n.name)
            if n.op == "placeholder" and isinstance(spec, TensorSpec) and spec.shape:
                self.by_size[spec.shape[0]] = "N"
                break

    def dims(self, spec: TensorSpec, dynamic: set[int]) -> Dims:
        out = {}
        for i in sorted(dynamic):
            size = spec.shape[i]
            if size not in self.by_size:
                used = set(self.by_size.values())
                self.by_size[size] = next((c for c in _LETTERS if c not in used), f"s{size}")
            out[i] = self.by_size[size]
        return out
