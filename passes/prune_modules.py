"""The modules PruneMasks puts into a graph: a masked layer call, a masked parameter read, a baked copy.

Kept apart from the pass (``prune.py``) so that what a pruned graph *holds* — and what ``to_module()`` and
``torch.save`` carry — is readable on its own; ``fxdebug.passes.prune`` re-exports ``Masked`` and ``MaskedValue``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from .derived import mark_derived

__all__ = ["Masked", "MaskedValue", "bake"]


class Masked(nn.Module):
    """Calls a layer with some of its parameters multiplied by 0/1 masks.

    The layer is referenced, not owned (it stays where it is in the model, so ``state_dict()``
    keys do not change); masks are non-persistent buffers that follow ``.to(device)``.
    """

    def __init__(self, layer: nn.Module, path: str, masks: dict[str, Tensor]) -> None:
        super().__init__()
        object.__setattr__(self, "layer", layer)
        self.path = path
        self.names = sorted(masks)
        for name, mask in masks.items():
            self.register_buffer(f"mask_{name}", mask, persistent=False)

    def mask(self, name: str) -> Tensor:
        return getattr(self, f"mask_{name}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = {n: getattr(self.layer, n) * self.mask(n) for n in self.names}
        return torch.func.functional_call(self.layer, params, args, kwargs)

    def extra_repr(self) -> str:
        return f"layer={self.path!r}, sparsity={1 - self.mask('weight').float().mean().item():.3f}" if "weight" in self.names else f"layer={self.path!r}"


class MaskedValue(nn.Module):
    """Multiplies one parameter as an export (aten-level) graph reads it (a ``get_attr``) by a fixed
    0/1 mask: the aten op then computes with the masked weight, the model keeps its own."""

    def __init__(self, path: str, name: str, mask: Tensor) -> None:
        super().__init__()
        self.path, self.name = path, name
        self.register_buffer("mask_value", mask, persistent=False)

    def forward(self, value: Tensor) -> Tensor:
        return value * self.mask_value

    def extra_repr(self) -> str:
        return f"{self.path}.{self.name}, sparsity={1 - self.mask_value.float().mean().item():.3f}"


def bake(layer: nn.Module, masks: dict[str, Tensor]) -> nn.Module:
    """A copy of ``layer`` with masked entries zeroed and kept at zero by gradient hooks."""
    baked = copy.deepcopy(layer)
    for name, mask in masks.items():
        old = getattr(layer, name)
        new = nn.Parameter(old.detach() * mask, requires_grad=old.requires_grad)
        if new.requires_grad:
            new.register_hook(lambda g, m=mask: g * m)
        setattr(baked, name, new)
    baked._fxdebug_masks = masks  # type: ignore[attr-defined]
    return mark_derived(baked)  # the model keeps its own weights; the copy is not in dbg.state_dict()
