"""The model keeps its face: its own methods and attributes, reached through the instrumented module.

A Hugging Face model must still ``generate`` with instrumentation on and be read as
``dbg.config`` by a Trainer-style loop; a detector's ``dbg.transform``-style helpers and plain
attributes (``num_classes``) must still be there. ``Instrumented`` holds the model's children,
parameters and buffers, but its class is not the model's class. When normal lookup fails, the
name is looked up on the model: an instance attribute is returned as is (the same object), a
method or property of the model's class is bound to the *instrumented* module, so that
``self(...)`` inside ``generate`` runs the instrumented forward and ``self.device`` reads the
shared parameters.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from fxdebug.instrumented.snapshot_recipe import recipe

__all__ = ["model_attribute", "model_of"]

_MISSING = object()


def model_of(gm: nn.Module) -> nn.Module | None:
    """The user's model behind ``gm`` (or the subtrees frontend's eager copy of it), if known."""
    rec = recipe(gm)
    if rec is not None:
        return rec.model
    live = gm.__dict__.get("_model")  # a live (Dynamo) capture holds the model itself
    return live if live is not None else gm.__dict__.get("_shell")


def model_attribute(gm: nn.Module, name: str) -> Any:
    """``name`` as the model answers it, bound to ``gm``; ``AttributeError`` if the model has none."""
    model = None if name.startswith("__") else model_of(gm)
    if model is None or model is gm:
        raise AttributeError(f"'{type(gm).__name__}' object has no attribute '{name}'")
    if name in model.__dict__:
        return model.__dict__[name]
    static = inspect.getattr_static(model, name, _MISSING)
    if static is _MISSING:
        raise AttributeError(f"'{type(gm).__name__}' object (instrumented {type(model).__name__}) has no attribute "
                             f"'{name}', and neither has the model.")
    if isinstance(static, nn.Module) or not hasattr(static, "__get__"):
        return static  # a class attribute (main_input_name, _supports_cache_class)
    _take_class(gm, type(model))
    return getattr(gm, name)  # now found on the class: bound to the instrumented module


def _take_class(gm: nn.Module, cls: type) -> None:
    """Give ``gm``'s per-instance class the model's class as a further base.

    Binding a model method to ``gm`` by hand is not enough: library code looks methods up on
    ``type(self)`` (``getattr(type(self), "_sample")`` in transformers' ``generate``). The
    instrumented module's own class stays first in the method order, so its forward, call,
    state handling and copying are unchanged; the model's class answers only what they do not.
    """
    current = type(gm)
    if isinstance(gm, cls):
        return
    mixed = type(current.__name__, (current, cls), {"__module__": current.__module__})
    gm.__class__ = mixed
    _take_signature(gm, cls)


def _take_signature(gm: nn.Module, cls: Any) -> None:
    """``inspect.signature(dbg.forward)`` reads as the model's: ``generate`` decides by it what to pass.

    An export graph's forward lists only the example inputs; the call itself still goes to the
    instrumented forward (and a call of another signature to its own capture, see ``snapshot_cache``).
    """
    try:
        sig = inspect.signature(cls.forward.__get__(gm, cls))
    except (TypeError, ValueError, AttributeError):
        return

    def forward(*args: Any, **kwargs: Any) -> Any:
        return type(gm).forward(gm, *args, **kwargs)

    forward.__signature__ = sig  # type: ignore[attr-defined]
    gm.__dict__["forward"] = forward
