"""Conditions for ``Breakpoint(where, when=...)``: "stop here only if this holds".

A condition is a function of a node's output (a tensor, or a tuple/list/dict of them) that returns
a 0-d bool tensor computed on the output's device (a Python bool is accepted too). The breakpoint
reads it back with one ``bool()`` — a host sync — only at the nodes where it is installed; every
other node runs as before. A condition that also wants the node's inputs sets
``needs_inputs = True`` and is called as ``when(outputs, inputs)`` (``new_nonfinite`` does).

    fxdebug.when.nonfinite                 # any NaN or Inf in the output
    fxdebug.when.new_nonfinite             # NaN/Inf in the output while every input was finite
    fxdebug.when.abs_above(1e4)            # max |output| above a threshold
    lambda y: y.abs().max() > 1e4          # any function returning a bool tensor
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

__all__ = ["abs_above", "all_of", "always", "any_of", "inf", "nan", "new_nonfinite", "nonfinite"]

Condition = Callable[..., Any]


def _floats(value: Any) -> list[Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
            and t.numel() > 0]


def _any(flags: list[Tensor]) -> Tensor | bool:
    if not flags:
        return False
    if len(flags) == 1:
        return flags[0]
    return torch.stack([f.to(flags[0].device) for f in flags]).any()


def nonfinite(outputs: Any) -> Tensor | bool:
    """True when any output element is NaN or +/-Inf."""
    return _any([~torch.isfinite(t).all() for t in _floats(outputs)])


def nan(outputs: Any) -> Tensor | bool:
    """True when any output element is NaN."""
    return _any([torch.isnan(t).any() for t in _floats(outputs)])


def inf(outputs: Any) -> Tensor | bool:
    """True when any output element is +/-Inf."""
    return _any([torch.isinf(t).any() for t in _floats(outputs)])


def always(outputs: Any) -> bool:
    """Every call (an unconditional breakpoint)."""
    return True


def abs_above(threshold: float) -> Condition:
    """A condition: max |output| above ``threshold`` (NaN counts as above)."""

    def cond(outputs: Any) -> Tensor | bool:
        return _any([~(t.abs().amax() <= threshold) for t in _floats(outputs)])

    cond.__name__ = f"abs_above({threshold:g})"
    return cond


def new_nonfinite(outputs: Any, inputs: Any) -> Tensor | bool:
    """NaN/Inf in the output while every floating-point input was finite: the node that made it."""
    out = nonfinite(outputs)
    if isinstance(out, bool) and not out:
        return False
    before = nonfinite(inputs)
    if isinstance(before, bool):
        return out
    return out & ~before.to(out.device) if isinstance(out, Tensor) else out


new_nonfinite.needs_inputs = True  # type: ignore[attr-defined]


def _call(cond: Condition, outputs: Any, inputs: Any) -> Any:
    return cond(outputs, inputs) if getattr(cond, "needs_inputs", False) else cond(outputs)


def any_of(*conds: Condition) -> Condition:
    """True when one of ``conds`` holds."""

    def cond(outputs: Any, inputs: Any) -> Any:
        flags = [_call(c, outputs, inputs) for c in conds]
        tensors = [torch.as_tensor(f) for f in flags]
        return torch.stack([t.to(tensors[0].device) for t in tensors]).any() if tensors else False

    cond.needs_inputs = True  # type: ignore[attr-defined]
    return cond


def all_of(*conds: Condition) -> Condition:
    """True when every one of ``conds`` holds."""

    def cond(outputs: Any, inputs: Any) -> Any:
        flags = [_call(c, outputs, inputs) for c in conds]
        tensors = [torch.as_tensor(f) for f in flags]
        return torch.stack([t.to(tensors[0].device) for t in tensors]).all() if tensors else True

    cond.needs_inputs = True  # type: ignore[attr-defined]
    return cond


def evaluate(cond: Condition, outputs: Any, inputs: Any) -> bool:
    """Run ``cond`` and read its verdict on the host (the one sync a breakpoint costs)."""
    flag = _call(cond, outputs, inputs)
    return bool(flag)
