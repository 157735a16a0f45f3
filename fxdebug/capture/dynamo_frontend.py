"""The Dynamo frontend's entry in the frontend registry (``frontend="dynamo"``): the live capture.

The snapshot frontends (symbolic, export, subtrees) capture the model *now*: ``capture()`` returns
a ``Capture`` of graphs, and the module is built from it. Dynamo captures nothing up front: the
module built for it hands every call to TorchDynamo, whose guards decide when a graph captured
before no longer holds and capture again (one part per frame, graph break and recompile, arriving
as the module runs). So this frontend says ``live = True``, and its module is built above capture/
(``instrumented/live_instrument.instrument_live``, called by ``api.py`` for a live entry of the
registry ``instrumented/pipeline.FRONTENDS``); ``capture()`` has no graphs to return and says where
they come from instead.
The Dynamo machinery itself (backend, graph naming, guards' settings) is ``capture/dynamo*.py``.
"""

from __future__ import annotations

from typing import NoReturn

from torch import nn

from fxdebug.capture.base import CallInputs, TraceOptions
from fxdebug.errors import UsageError

__all__ = ["DynamoFrontend"]


class DynamoFrontend:
    """TorchDynamo, guarded and live: the model as it is at every call (``docs/frontends.md``)."""

    name = "dynamo"
    live = True

    def capture(self, model: nn.Module, inputs: CallInputs | None, options: TraceOptions) -> NoReturn:
        raise UsageError(
            f"the Dynamo frontend captures {type(model).__name__} at each call of its instrumented module, not once "
            "now, so it has no snapshot Capture to return: fxdebug.instrument(model, passes, example_inputs, "
            "frontend='dynamo') (or fxdebug.trace(model, example_inputs, frontend='dynamo')) builds that module, "
            "and its dbg.parts() are the graphs Dynamo captured; a snapshot frontend (symbolic, export, subtrees) "
            "returns a Capture.", module="", op="dynamo")
