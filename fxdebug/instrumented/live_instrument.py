"""``instrument()`` with the live (Dynamo) frontend: checks on the model, the live module, the capture call.

The model is refused where capturing it would change it (lazy modules not yet run) or where fxdebug's
namespace would collide with its own attributes; with example inputs, one quiet call captures the first
graphs (buffers, Python state and RNG put back; Dynamo's plain graphs run, so no pass fires at
instrument time), and the example variants a pass asks for are captured too. ``api.instrument`` and
``api.trace`` call this once ``api.choose_frontend`` chose a live frontend of the registry
(``capture/dynamo_frontend.DynamoFrontend``, ``live = True``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from torch import nn
from torch.nn.parameter import UninitializedParameter

from fxdebug.authoring.context import NAMESPACE
from fxdebug.authoring.pipeline import Pass
from fxdebug.capture.torch_logs import summary, torch_errors_caught
from fxdebug.graph.gc_pause import paused_gc
from fxdebug.errors import TraceError, UsageError
from fxdebug.graph.inputs import clone_inputs, normalize_inputs, preserved_state
from fxdebug.graph.meta import graph_record
from fxdebug.graph.usage import check_example_inputs, check_where_matched
from fxdebug.instrumented.live_regions import without_regions
from fxdebug.instrumented.live import LiveInstrumented
from fxdebug.instrumented.base import Instrumented
from fxdebug.instrumented.verify import verify
from fxdebug.report.distributed import unwrap_parallel
from fxdebug.report.report import Report

__all__ = ["instrument_live"]


def instrument_live(model: nn.Module, passes: list[Pass], example_inputs: Any, prior: Report | None,
                     check: bool, start: float, backend: str | None = None, why: str = "",
                     regional: bool | None = None) -> Instrumented:
    """The Dynamo frontend: a live module; with example inputs, one quiet call captures the first graphs.
    ``regional``: capture repeated blocks as regions (``None``: as ``FXDEBUG_REGIONS`` says)."""
    model, unwrapped = unwrap_parallel(model)
    notes = [n for n in (unwrapped, why) if n]
    if isinstance(model, LiveInstrumented):
        passes = [*model._live_state.passes, *passes]
        backend = backend or model._live_state.backend  # more passes on a compiled live module: compiled too
        regional = model._live_state.regional if regional is None else regional
        model = model._model
    elif isinstance(model, Instrumented):
        raise UsageError("frontend='dynamo' captures a plain model; this one was already captured by "
                         f"{model.trace_info.frontend}: instrument the original model instead.")
    clash = NAMESPACE in model._modules or NAMESPACE in model._parameters or NAMESPACE in model._buffers
    if clash or NAMESPACE in model.__dict__:
        raise TraceError(f"{type(model).__name__} has an attribute named '{NAMESPACE}', the name of fxdebug's own namespace "
                         "in instrumented graphs (its observers and constants live there): rename it, or use "
                         "frontend='subtrees' (the root stays eager).", module=NAMESPACE, op=type(model).__name__)
    lazy = [path or type(model).__name__ for path, m in model.named_modules()
            if any(isinstance(p, UninitializedParameter) for p in m._parameters.values())]
    if lazy:  # the capture call would materialize them: instrument() never changes the model
        raise TraceError(f"{type(model).__name__} has lazy module(s) not yet run ({', '.join(lazy[:5])}): capturing would "
                         "materialize their parameters, changing the model. Run the model once first, then instrument it.",
                         module=lazy[0], op="lazy module")
    gm = LiveInstrumented._live(model, passes, prior, notes, backend or "eager", regional)
    gm.example_inputs = example_inputs  # what gradcheck() and friends default to, as for a snapshot
    inputs = normalize_inputs(example_inputs)
    if inputs is not None:
        check_example_inputs(model, inputs)
        try:
            _capture_examples(gm, model, passes, inputs)
        except UsageError:
            # a pass names a module whose output only the inlined capture has (a stage holding repeated blocks):
            if not without_regions(gm):  # captured again with every block inlined
                raise
            _capture_examples(gm, model, passes, inputs)
    graph_record(gm).instrument_seconds = time.perf_counter() - start
    if check:
        verify(gm, example_inputs).raise_if_failed()
    return gm


def _capture_examples(gm: LiveInstrumented, model: nn.Module, passes: list[Pass], inputs: Any) -> None:
    """The quiet call (or calls) on the example inputs that captures the first graphs; the passes' selectors checked."""
    args, kwargs = clone_inputs(inputs)
    gm._live_state.capturing_examples = True  # a failure of the model's forward here names the example inputs
    try:
        # buffers, Python state and RNG as they were: the call only captures; torch's own error logs kept
        # with regional capture, a part per instance: the collector paused across them all (one promotion at the end,
        # not a full collection over the new parts at the first call; graph/gc_pause.py)
        pause = paused_gc() if gm._live_state.regional else contextlib.nullcontext()
        with preserved_state(model), torch_errors_caught() as logged, pause:
            gm(*args, **kwargs)
        note = summary(logged)
        if note:
            gm.trace_info.notes.append(note)
        for variant in _example_variants(passes):  # further examples a pass asks for (other sizes): captured too
            more = normalize_inputs(variant)
            if more is not None:
                check_example_inputs(model, more)
                more_args, more_kwargs = clone_inputs(more)
                with preserved_state(model):
                    gm(*more_args, **more_kwargs)
    finally:
        gm._live_state.capturing_examples = False
        gm._live_state.produced.clear()
    gm.reset()
    parts = gm.parts()
    check_where_matched(passes, parts, prefixed=False)
    for p in passes:
        p.check_capture(parts)


def _example_variants(passes: list[Pass]) -> list[Any]:
    """Example inputs a pass asks a live module to capture besides ``example_inputs`` (its
    ``example_variants``: another batch size or sequence length); a snapshot frontend's pass runs them
    on its one graph itself."""
    return [v for p in passes for v in getattr(p, "example_variants", ()) or ()]
