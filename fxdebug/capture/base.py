"""The ``Frontend`` protocol and the data every frontend returns: a ``Capture`` of ``Part``s.

A frontend turns ``(model, example inputs, options)`` into a ``Capture``: plain data, no module
behaviour. Each ``Part`` is one captured graph: the module path it stands for (``""`` for the whole
model), a ``torch.fx.GraphModule`` over that module's own objects, the inputs the part was called
with when the frontend recorded the model (``None`` when it was captured from the caller's
example inputs), and the path from the model's root that ``where=`` patterns name. ``info`` says
how the model was captured (``TraceInfo``). The ``Instrumented`` module is built from a capture
one floor up (``fxdebug.instrumented.module.Instrumented.from_capture``); ``api.choose_frontend``
chooses the frontend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn
from torch.fx import GraphModule

from fxdebug.graph.inputs import CallInputs

__all__ = ["CallInputs", "Capture", "Frontend", "Part", "TraceOptions"]


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


@dataclass
class Part:
    """One captured graph.

    Attributes:
        path: the module path the graph stands for (``""``: the whole model).
        graph_module: the graph over that module's own parameters, buffers and children; fxdebug's
            own modules the graph refers to (``fxdebug.constants.*``) sit under its ``fxdebug`` child.
        inputs: ``(args, kwargs)`` the part was called with when the frontend recorded the model,
            for the pass pipeline; ``None`` when it runs on the caller's example inputs.
        root_path: the part's path from the model's root, which ``where=`` patterns name.
        info: how this part was captured (``TraceInfo``) when it differs from the capture's own
            (subtrees: each part by its own graph frontend); ``None``: the capture's ``info``.
    """

    path: str
    graph_module: GraphModule
    inputs: CallInputs | None = None
    root_path: str = ""
    info: Any = None


@dataclass
class Capture:
    """What a frontend returns: the captured parts, in execution order, and how they were captured."""

    parts: list[Part]
    info: Any  # TraceInfo (fxdebug.capture.symbolic)
    notes: list[str] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)  # recorded on the module's GraphRecord.extras (part_flow)

    @property
    def part(self) -> Part:
        """The one part of a single-graph capture."""
        if len(self.parts) != 1:
            raise ValueError(f"a capture of {len(self.parts)} parts has no single part")
        return self.parts[0]


class Frontend(Protocol):
    """A way of capturing a model. ``name`` is what ``trace`` / ``instrument(frontend=...)`` accept.

    ``live`` says when the frontend captures. ``False``, a snapshot (symbolic, export, subtrees):
    ``capture`` captures the model as it is now, and the module is built from the ``Capture``.
    ``True``, live (Dynamo, ``capture/dynamo_frontend.py``): the module built for it captures at each
    call, as guards decide; it is built above, in ``instrumented/live_instrument.instrument_live``,
    and its ``capture`` only says so. The registry of frontends is ``instrumented/pipeline.FRONTENDS``;
    ``api.choose_frontend`` picks one and asks it whether it is live.
    """

    name: str
    live: bool

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> Any:
        """Capture ``model`` (a ``Capture``); raise ``TraceError`` (naming the module and the fix) if it cannot."""
        ...
