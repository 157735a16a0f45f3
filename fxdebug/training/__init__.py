"""Training aids above the instrumented model: ``guard`` (a step that a NaN cannot poison)."""

from fxdebug.training.guard import Guard, guard

__all__ = ["Guard", "guard"]
