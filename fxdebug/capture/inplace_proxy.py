"""Augmented assignment on traced values stays in place: ``y += 1`` is ``operator.iadd``.

``torch.fx.Proxy`` defines ``__add__`` but not ``__iadd__``, so plain symbolic tracing records
``y += 1`` as ``y = y + 1``: a new tensor. When ``y`` aliases another tensor (a view, a slice,
an input the model updates in place) the model's write is lost and the traced graph computes
something else, silently; autograd then sees a different graph too. Recording the ``operator.i*``
function keeps the write: at run time ``operator.iadd(tensor, 1)`` is exactly ``tensor += 1``, and
for a Python number it falls back to ``+`` as Python does. Such nodes are impure (their effect is
the write), so they are kept even when nothing reads their result.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

from torch.fx import Node, Proxy

__all__ = ["INPLACE_OPERATORS", "MutatingProxy", "writes_in_place"]

# dunder -> the operator module's in-place function, for every augmented assignment Python has
INPLACE_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "__iadd__": operator.iadd,
    "__isub__": operator.isub,
    "__imul__": operator.imul,
    "__itruediv__": operator.itruediv,
    "__ifloordiv__": operator.ifloordiv,
    "__imod__": operator.imod,
    "__ipow__": operator.ipow,
    "__imatmul__": operator.imatmul,
    "__iand__": operator.iand,
    "__ior__": operator.ior,
    "__ixor__": operator.ixor,
    "__ilshift__": operator.ilshift,
    "__irshift__": operator.irshift,
}


class MutatingProxy(Proxy):
    """A ``Proxy`` whose augmented assignments record the in-place operator (see the module doc)."""


def _recorder(fn: Callable[[Any, Any], Any]) -> Callable[[Proxy, Any], Proxy]:
    def record(self: Proxy, other: Any) -> Proxy:
        return self.tracer.create_proxy("call_function", fn, (self, other), {})

    record.__name__ = f"__{fn.__name__}__"
    return record


for _dunder, _fn in INPLACE_OPERATORS.items():
    setattr(MutatingProxy, _dunder, _recorder(_fn))


def writes_in_place(node: Node) -> bool:
    """True for a node recorded from an augmented assignment (kept although its value is unused)."""
    return node.op == "call_function" and node.target in INPLACE_OPERATORS.values()
