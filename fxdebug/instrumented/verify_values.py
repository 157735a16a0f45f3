"""What ``verify`` compares in an output: every tensor and plain value it holds, by path.

A model's output is not always a pytree of tensors. A Hugging Face causal LM returns its key/value
cache as a ``DynamicCache`` (an object with a list of layers, each holding ``keys`` and ``values``);
other models return dataclasses or small result objects. Two such objects from two runs are never
``==`` (they compare by identity), so comparing them as leaves reports every faithful run as
diverging. Here an output is walked down to its tensors and plain values, through containers,
dataclasses, ``__dict__`` and ``__slots__``, each named by its path (``past_key_values.layers.0.keys``),
so two runs are equal exactly when everything they hold is.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["flat_values", "snapshot"]

_ATOMS = (bool, int, float, complex, str, bytes, type(None), type, enum.Enum, torch.device, torch.dtype)
_DEPTH = 12


def _children(v: Any) -> list[tuple[str, Any]] | None:
    """The named parts of ``v``, or ``None`` when ``v`` is compared whole."""
    if isinstance(v, dict):
        return [(str(k), x) for k, x in v.items()]
    if isinstance(v, (list, tuple)):
        return [(str(i), x) for i, x in enumerate(v)]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return [(f.name, getattr(v, f.name, None)) for f in dataclasses.fields(v)]
    if callable(v):  # functions, bound methods, modules: compared as they are
        return None
    state = getattr(v, "__dict__", None)
    if isinstance(state, dict):
        return sorted((str(k), x) for k, x in state.items())
    slots = [s for c in type(v).__mro__ for s in getattr(c, "__slots__", ()) if isinstance(s, str)]
    if slots:
        return [(s, getattr(v, s, None)) for s in slots if s not in ("__dict__", "__weakref__")]
    return None


def flat_values(out: Any) -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` of every tensor and compared-whole value in ``out``, in a stable order.

    The path also names each walked object's type, so two outputs of different structure differ.
    """
    found: list[tuple[str, Any]] = []
    on_path: set[int] = set()

    def walk(path: str, v: Any, depth: int) -> None:
        if isinstance(v, (Tensor, *_ATOMS)) or depth > _DEPTH or id(v) in on_path:
            found.append((path, v))
            return
        parts = _children(v)
        if parts is None:
            found.append((path, v))
            return
        if not isinstance(v, (dict, list, tuple)) or type(v) not in (dict, list, tuple):
            found.append((f"{path}<type>" if path else "<type>", type(v)))
        on_path.add(id(v))
        for name, x in parts:
            walk(f"{path}.{name}" if path else name, x, depth + 1)
        on_path.discard(id(v))

    for i, leaf in enumerate(pytree.tree_leaves(out)):  # a pytree output keeps its leaf numbers
        walk(str(i), leaf, 0)
    return found


def snapshot(out: Any) -> list[tuple[str, Any]]:
    """``flat_values`` with every tensor detached and copied: the next run cannot change it."""
    return [(p, v.detach().clone() if isinstance(v, Tensor) else v) for p, v in flat_values(out)]
