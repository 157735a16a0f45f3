"""Capture a model and run passes over its parts: what ``instrument`` does, one floor below ``api.py``.

``capture_module`` turns a frontend's ``Capture`` into the ``Instrumented`` module (one graph of
the whole model, or an eager root routing to captured submodules); ``run_pipeline`` runs the
passes over every part, each on the inputs that part is called with, through the one pass runner
(``authoring.run_part``, which the live capture's graphs go through too). ``recapture`` is both
together, for a module that must be captured again by the frontend it was made with (another
training mode, attribute value or call signature: ``snapshot_cache``). The ``Recipe`` it keeps
(``snapshot_recipe``) is data (model, frontend, inputs, options, passes) and this function, on their
own floor, so no lower module calls up into ``api.py``.

Import order inside ``instrumented/``: ``snapshot_recipe`` → ``module`` → ``snapshot_cache`` →
``subtree_module`` → ``pipeline``; ``snapshot_recipe`` never imports this module (it is given
``recapture`` by whoever records a recipe).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from fxdebug.authoring.pipeline import Pass
from fxdebug.authoring.run_part import paused_gc, run_part
from fxdebug.capture.base import Capture, Frontend, TraceOptions
from fxdebug.capture.dynamo_frontend import DynamoFrontend
from fxdebug.capture.graphs import ExportFrontend, SymbolicFrontend
from fxdebug.capture.subtrees import SubtreesFrontend
from fxdebug.errors import MissingInputsError
from fxdebug.graph.inputs import Inputs, normalize_inputs
from fxdebug.graph.usage import check_example_inputs, check_where_matched
from fxdebug.instrumented.snapshot_recipe import remember
from fxdebug.instrumented.module import InstrumentedGraphModule
from fxdebug.instrumented.subtree_module import subtrees_module
from fxdebug.report.report import Report

__all__ = ["FRONTENDS", "capture_module", "module_from_capture", "recapture", "run_pipeline"]

# The frontend registry: every name ``frontend=`` accepts besides "auto". A snapshot frontend (``live`` False) is
# captured here (``capture_module``); the live one (Dynamo) builds its module at instrument time and captures at
# each call (``instrumented/live_instrument.instrument_live``, which api.py calls for a live entry: importing it
# here would close a cycle, live.py -> live_export -> this module)
FRONTENDS: dict[str, Frontend] = {f.name: f for f in (DynamoFrontend(), SymbolicFrontend(), ExportFrontend(),
                                                      SubtreesFrontend())}


def module_from_capture(model: nn.Module, capture: Capture) -> InstrumentedGraphModule:
    """The ``Instrumented`` module for what a frontend returned: one graph of the whole model, or an
    eager root routing to the captured submodules (``Capture.parts`` with module paths)."""
    if [part.path for part in capture.parts] == [""]:
        return InstrumentedGraphModule.from_capture(model, capture)
    return subtrees_module(model, capture)


def capture_module(frontend: str, model: nn.Module, inputs: Any, options: TraceOptions) -> InstrumentedGraphModule:
    """Capture ``model`` with the snapshot ``frontend`` (a name in ``FRONTENDS``); the module is built from the
    ``Capture``. The live frontend has no snapshot to capture (its ``capture`` says so)."""
    with paused_gc():
        return module_from_capture(model, FRONTENDS[frontend].capture(model, inputs, options))


def run_pipeline(gm: InstrumentedGraphModule, passes: Sequence[Pass], example_inputs: Any = None,
                 prior: Report | None = None) -> InstrumentedGraphModule:
    """Run ``passes`` over every part of ``gm``, each on the inputs that part is called with.

    A single-graph capture is one part, run on ``example_inputs``; a part a frontend recorded
    its own inputs for (subtrees) runs on those. Shapes are learnt before the passes (which also
    validates the inputs against the model, naming the failing node) and again after a transform.
    """
    with paused_gc():
        return _run_pipeline(gm, list(passes), example_inputs, prior)


def _run_pipeline(gm: InstrumentedGraphModule, pass_list: list[Pass], example_inputs: Any, prior: Report | None) -> InstrumentedGraphModule:
    observe_only = all(p.observe_only for p in pass_list)
    check_where_matched(pass_list, gm.parts())
    for path, part in gm.parts().items():
        recorded = part.recorded_inputs()
        if recorded is not None:
            inputs: Any = Inputs(*recorded[0], **recorded[1])
        elif path:
            raise MissingInputsError(f"no recorded inputs for captured module '{path}'; trace the model again "
                             "with example_inputs before instrumenting it.", module=path)
        else:
            inputs = example_inputs
        new = run_part(part, pass_list, inputs, prior, relearn=not observe_only or recorded is not None)
        gm = gm.replace_part(path, new)
    return gm


def recapture(model: nn.Module, frontend: str, passes: Sequence[Pass], example_inputs: Any,
              options: dict[str, Any]) -> InstrumentedGraphModule:
    """``model`` captured again by ``frontend`` with ``options``, ``passes`` run on ``example_inputs``.

    ``model`` may be an ``Instrumented`` module (then its graph is copied and the passes are added to
    those it ran; ``frontend`` is unused). The result records its own recipe, as ``instrument``'s does.
    """
    if isinstance(model, InstrumentedGraphModule):
        gm = model.retrace()
    else:
        inputs = normalize_inputs(example_inputs)
        check_example_inputs(model, inputs)
        trace_options = TraceOptions(tuple(options.get("leaf_modules", ())), options.get("auto_leaf", True),
                                     options.get("dynamic_batch", False))
        gm = capture_module(frontend, model, inputs, trace_options)
    remember(gm, model, (), example_inputs, options, recapture)  # trace()'s record: the graph before the passes
    gm = run_pipeline(gm, passes, example_inputs)
    remember(gm, model, list(passes), example_inputs, options, recapture)
    return gm
