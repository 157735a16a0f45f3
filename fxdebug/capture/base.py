"""The ``Frontend`` protocol: one way of capturing a model, returning the one capture type.

Every frontend turns ``(model, example inputs, options)`` into an ``Instrumented`` module whose
``parts()`` say what was captured: one graph for the symbolic and export frontends, several for
the subtrees frontend. ``api.trace`` chooses a frontend; the pass pipeline, the report and the
picture only ever see ``Instrumented`` and its parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn

from fxdebug.graph.inputs import CallInputs
from fxdebug.instrumented.module import Instrumented

__all__ = ["CallInputs", "Frontend", "TraceOptions"]


@dataclass(frozen=True)
class TraceOptions:
    """How to capture, whatever the frontend; each frontend reads the fields it understands.

    Attributes:
        leaf_modules: module paths or types to keep as opaque calls (symbolic tracing).
        auto_leaf: turn submodules symbolic tracing cannot see into into leaves, instead of failing.
        dynamic_batch: let dim 0 of every tensor input vary (export).
    """

    leaf_modules: tuple[str | type[nn.Module], ...] = ()
    auto_leaf: bool = True
    dynamic_batch: bool = False


class Frontend(Protocol):
    """A way of capturing a model. ``name`` is what ``trace(frontend=...)`` accepts."""

    name: str

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> Instrumented:
        """Capture ``model``; raise ``TraceError`` (naming the module and the fix) if it cannot."""
        ...
