"""How the parts of a per-subtree capture connect: which part's output a later part's input is.

The subtrees frontend keeps the root's ``forward`` eager, so no graph records the data between
its captured parts. From each part's first recorded call, ``part_flow`` matches every input tensor
to the latest earlier part output equal to it (same shape, dtype, device and values); the picture
draws those matches as edges (``fxdebug.render.parts``). An input no earlier output equals came
from the eager code between the parts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["part_flow"]


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def part_flow(calls: dict[str, tuple[Any, Any, Any]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """``[(src part, dst part, shape), ...]`` from ``{part: (args, kwargs, output)}`` in execution order."""
    edges: list[tuple[str, str, tuple[int, ...]]] = []
    outputs: list[tuple[str, torch.Tensor]] = []
    for dst, (args, kwargs, out) in calls.items():
        for x in _tensors((args, kwargs)):
            for src, y in reversed(outputs):
                if y.shape == x.shape and y.dtype == x.dtype and y.device == x.device and torch.equal(x, y):
                    edge = (src, dst, tuple(x.shape))
                    if edge not in edges:
                        edges.append(edge)
                    break
        outputs.extend((dst, y) for y in _tensors(out))
    return edges
