"""``ShapeAssert``'s probe: one node's expected shape and dtype, compared with what it produced, and the message
that names the node, its inputs' shapes and the source line when they differ."""

from __future__ import annotations

from typing import Any, Sequence

from torch import Tensor
from torch.fx import Node

from fxdebug import ShapeMismatchError
from fxdebug.authoring import (ObservationContext, Probe, Reductions, TensorSpec, describe, is_instrumentation,
                               module_path, node_identity, op_label, source_line)

from .shape_rules import Meta

__all__ = ["Dims", "ShapeProbe", "render"]

Dims = dict[int, str]  # dim index -> symbol


def render(shape: Sequence[int], symbols: Dims) -> str:
    """``(N, 128, 14, 14)``: a shape with its symbolic dims as letters."""
    dims = [symbols.get(i, str(d)) for i, d in enumerate(shape)]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


class ShapeProbe(Probe):
    """Compares the observed tensor's shape and dtype with the expected ones; metadata only."""

    key = "shape-assert"
    wants_inputs = True

    def __init__(self, node: Node, expected: TensorSpec, symbols: Dims, inputs: list[tuple[str, Dims | None]],
                 check_dtype: bool) -> None:
        self.shape = tuple(expected.shape)
        self.dtype = expected.dtype
        self.symbols = symbols
        self.inputs = inputs
        self.check_dtype = check_dtype
        self.named = node_identity(node)  # identities, worded when shown: a copy for another instance renames them
        self.node_name, self.module, self.op = node.name, module_path(node), op_label(node)
        self.where = source_line(node)
        users = [u for u in node.users if not is_instrumentation(u) and u.op != "output"]
        self.fed = [node_identity(u) for u in users[:3]] if node.op == "placeholder" else []

    @property
    def describe(self) -> str:
        return describe(self.named)

    @property
    def feeds(self) -> str:
        return f" It feeds {', '.join(describe(u) for u in self.fed)}." if self.fed else ""

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        if ctx.phase == "forward":
            self.check(r.x, ctx.inputs)

    def check(self, x: Any, inputs: tuple[Any, ...]) -> None:
        """Raise ``ShapeMismatchError`` if ``x`` (a tensor, real or fake) has another shape or dtype."""
        shape = x.shape
        ok = len(shape) == len(self.shape) and all(
            i in self.symbols or a == e for i, (a, e) in enumerate(zip(shape, self.shape)))
        if ok and (not self.check_dtype or x.dtype == self.dtype):
            return
        raise ShapeMismatchError(self._message(x, inputs), node=self.node_name, module=self.module, op=self.op)

    def _message(self, x: Tensor, inputs: tuple[Any, ...]) -> str:
        same_rank = len(x.shape) == len(self.shape)
        got = render(x.shape, self.symbols if same_rank else {})
        want = render(self.shape, self.symbols)
        if self.check_dtype and x.dtype != self.dtype:
            got, want = f"{_dt(x.dtype)} {got}", f"{_dt(self.dtype)} {want}"
        shown = []
        for (name, symbols), value in zip(self.inputs, inputs):
            if isinstance(value, (Tensor, Meta)) and symbols is not None:  # None: a weight read as an input (not shown)
                shown.append(render(value.shape, symbols if len(symbols) == 0 or max(symbols) < value.dim() else {}))
        ins = f" Inputs: {', '.join(shown)}." if shown else ""
        at = f" Defined at {self.where}." if self.where else ""
        return (f"{self.describe} produced {got}; expected {want}.{ins}{self.feeds}{at} The expected shape comes from the "
                "example inputs given to instrument(); if this dim may legitimately vary, list it in "
                "ShapeAssert(dynamic_dims=...) or pass other_inputs=.")


def _dt(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")
