"""The entry points: ``trace``, ``instrument``, ``render``, and the choice of frontend.

``choose_frontend`` is the one choice of frontend for ``trace`` and ``instrument``, with the note why; the
frontends are the registry ``instrumented/pipeline.FRONTENDS`` (Dynamo, symbolic, export, subtrees), and the
chosen entry says whether it is live. A live one (Dynamo) builds a module that captures at each call
(``instrumented/live_instrument``); a snapshot one is captured now (``_snapshot``), and ``instrument`` runs
the pass pipeline (``run_pipeline``) over each of its ``parts()``. ``render`` draws any module, tracing a
plain one first. Nothing here knows which frontend made a module: the parts say it.
"""

from __future__ import annotations

import inspect
import itertools
import os
import time
from typing import Any, Sequence

from torch import nn
from torch.fx import GraphModule

from fxdebug.report.distributed import unwrap_parallel
from fxdebug.errors import ArgumentTypeError, FxDebugError, TraceError, UsageError
from fxdebug.capture.base import TraceOptions
from fxdebug.capture.dynamo_frontend import DynamoFrontend
from fxdebug.capture.dynamo_backends import check_backend
from fxdebug.instrumented.live import LiveInstrumented
from fxdebug.instrumented.live_instrument import instrument_live
from fxdebug.instrumented.base import Instrumented
from fxdebug.instrumented.module import InstrumentedGraphModule
from fxdebug.instrumented.pipeline import FRONTENDS, capture_module, module_from_capture, recapture, run_pipeline
from fxdebug.graph.meta import graph_record
from fxdebug.instrumented.snapshot_recipe import remember
from fxdebug.authoring.pipeline import Pass, validate_passes
from fxdebug.render.draw import render as draw
from fxdebug.graph.inputs import normalize_inputs
from fxdebug.graph.usage import check_example_inputs, check_options
from fxdebug.instrumented.verify import verify

__all__ = ["FRONTENDS", "instrument", "module_from_capture", "render", "run_pipeline", "trace"]

# frontend="auto" (trace and instrument alike): the live Dynamo capture unless choose_frontend finds a reason for a
# snapshot (then symbolic, export, subtrees, noted). FXDEBUG_AUTO=snapshot keeps "auto" on that snapshot chain
# for every call (docs/frontends.md)
AUTO_IS_LIVE = os.environ.get("FXDEBUG_AUTO") != "snapshot"
# Dynamo traces ~5-10 ms per module call on CPU (symbolic tracing ~0.2 ms per node): above this many modules a
# live capture would take tens of seconds to minutes (a 70B-class trunk, a 10k-layer chain), so "auto" takes the
# guarded snapshot instead, noted; frontend="dynamo" still captures any model live
LIVE_MODULE_LIMIT = 1000
# instrument()'s own keywords (popped; the rest are trace()'s, read from its signature)
_INSTRUMENT_OWN = ("prior_report", "verify", "backend")


def _check_model(model: Any, fn: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        hint = " (it is a class: instantiate it first)" if isinstance(model, type) else ""
        raise ArgumentTypeError(f"{fn}() needs a torch.nn.Module instance; got {type(model).__name__}{hint}.")
    return model


def trace(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    leaf_modules: Sequence[str | type[nn.Module]] = (),
    auto_leaf: bool = True,
    frontend: str = "auto",
    dynamic_batch: bool = False,
) -> Instrumented:
    """Capture ``model`` as an ``Instrumented`` graph module, without passes.

    ``"auto"`` (``choose_frontend``) is the snapshot chain here, with a note saying why: ``trace`` returns one
    graph to look at and edit now. ``frontend="dynamo"`` returns the live module instead (Dynamo captures at
    each call; ``dbg.graph`` is the captured graph when there is one). The snapshot frontends, tried in this
    order by ``"auto"``:

    * ``"symbolic"`` — ``torch.fx`` symbolic tracing; submodules that cannot be traced become
      leaves automatically (``auto_leaf=True``), recorded in ``.trace_info`` and in reports.
      Module-level graph, the most readable. Needs no example inputs.
    * ``"export"`` — ``torch.export`` (non-strict) on the example inputs: an aten-level graph whose
      nodes keep their module path. Captures roots that FX cannot (item assignment, loops over
      inputs, ``*args``). ``dynamic_batch=True`` lets dim 0 of every tensor input vary.
    * ``"subtrees"`` — keeps the root's forward eager and instruments the largest submodules
      that one of the above captures; the report gives the fraction of parameters and executed
      ops under instrumentation and which modules stayed eager, and why.

    The chosen frontend is ``.trace_info.frontend``; ``"auto"`` also notes why it chose the chain and why
    earlier ones failed.
    """
    _check_model(model, "trace")
    options = {"frontend": frontend, "leaf_modules": tuple(leaf_modules), "auto_leaf": auto_leaf,
               "dynamic_batch": dynamic_batch}
    if isinstance(unwrap_parallel(model)[0], Instrumented):  # captured before: the same frontend captures again
        return _snapshot(model, "auto", "", example_inputs, options)
    chosen, why = choose_frontend(model, (), options, "trace", example_inputs)
    if _is_live(chosen):
        return instrument_live(model, [], example_inputs, None, False, time.perf_counter(), None, why)
    return _snapshot(model, chosen, why, example_inputs, options)


def _is_live(chosen: str) -> bool:
    """Whether ``choose_frontend``'s choice is a live frontend (its module captures at each call): the registry says."""
    return chosen != "auto" and FRONTENDS[chosen].live


def _snapshot(model: nn.Module, chosen: str, why: str, example_inputs: Any, options: dict[str, Any]) -> Instrumented:
    """``model`` captured now by the snapshot frontend ``chosen`` (``"auto"``: the chain), ``why`` noted first.

    An ``Instrumented`` model is captured again as it was made (``retrace``)."""
    model, unwrapped = unwrap_parallel(model)  # DDP / DataParallel: the model is .module
    if isinstance(model, Instrumented):
        again = model.retrace()
        if not isinstance(again, LiveInstrumented):  # a live module's graphs are Dynamo's: no snapshot recipe
            remember(again, model, (), example_inputs, {}, recapture)
        return again
    inputs = normalize_inputs(example_inputs)
    check_example_inputs(model, inputs)
    kept = {"leaf_modules": tuple(options.get("leaf_modules", ())), "auto_leaf": options.get("auto_leaf", True),
            "dynamic_batch": options.get("dynamic_batch", False)}
    trace_options = TraceOptions(kept["leaf_modules"], kept["auto_leaf"], kept["dynamic_batch"])
    gm = (_capture(chosen, model, inputs, trace_options) if chosen != "auto"
          else _trace_auto(model, inputs, trace_options))
    gm.trace_info.notes[:0] = [n for n in (unwrapped, why) if n]
    remember(gm, model, (), example_inputs, kept, recapture)  # so that a switch of training mode captures that mode's graph
    return gm


def _capture(frontend: str, model: nn.Module, inputs: Any, options: TraceOptions) -> Instrumented:
    """Capture with ``frontend``; the module is built from the ``Capture`` it returns."""
    return capture_module(frontend, model, inputs, options)


def _trace_auto(model: nn.Module, inputs: Any, options: TraceOptions) -> Instrumented:
    """Symbolic, then export, then subtrees; the result notes why the earlier ones failed."""
    start = time.perf_counter()
    try:
        return _capture("symbolic", model, inputs, options)
    except TraceError as exc:
        symbolic_error = exc
    why = [f"auto: symbolic tracing failed: {symbolic_error.message}"]
    if inputs is None:
        raise TraceError(
            f"{symbolic_error.message} The other frontends (export, subtrees) run the model on example inputs, "
            "and none were given: pass example_inputs=(x,) (or a dict of keyword inputs).",
            module=symbolic_error.module, op=symbolic_error.op,
        ) from symbolic_error
    try:
        gm = _capture("export", model, inputs, options)
    except TraceError as exc:
        why.append(f"auto: torch.export failed: {exc.message}")
        try:
            gm = _capture("subtrees", model, inputs, options)
        except FxDebugError:
            raise
        except Exception as run_exc:  # the model itself does not run on the example inputs
            raise TraceError(
                f"{type(model).__name__}'s own forward raised {type(run_exc).__name__} on the example inputs: "
                f"{str(run_exc).strip() or type(run_exc).__name__}. fxdebug can only capture a model that runs: fix "
                "the forward or the example inputs.", module="", op=type(model).__name__) from run_exc
    info = gm.trace_info
    info.notes[:0] = why
    info.seconds = time.perf_counter() - start
    return gm


def instrument(
    model: nn.Module,
    passes: Sequence[Pass] = (),
    example_inputs: Any = None,
    **trace_options: Any,
) -> Instrumented:
    """Trace ``model`` and run ``passes`` over it; returns an ``Instrumented`` module.

    With observe-only passes the result computes exactly what ``model`` computes (bitwise), on
    the model's device, with the model's own parameters. ``example_inputs`` (a tensor, a tuple, or
    a dict of keyword inputs) are run once to learn every node's shape, dtype and device; the
    model's buffers and the RNG state are restored afterwards. Extra keyword arguments go to
    ``trace`` (``leaf_modules``, ``auto_leaf``, ``frontend``).

    ``backend="eager"`` (the debugging default) runs the instrumented graphs as captured;
    ``backend="inductor"`` compiles each graph of the live (Dynamo) capture with TorchInductor after
    the passes instrumented it. ``torch.compile(dbg, mode=..., options=...)`` compiles them with the
    user's own backend. ``Report.notes`` says which backend ran.
    """
    _check_model(model, "instrument")
    check_options("instrument", trace_options, (*_INSTRUMENT_OWN, *inspect.signature(trace).parameters))
    pass_list = validate_passes(passes)
    prior = trace_options.pop("prior_report", None)
    check = trace_options.pop("verify", False)
    backend = trace_options.pop("backend", None)  # None: eager, or what a live module given here was made with
    if backend is not None:
        check_backend(backend)
    if prior is None and isinstance(model, Instrumented) and model.observers():
        prior = model.report()
    start = time.perf_counter()
    chosen, why = choose_frontend(model, pass_list, trace_options, "instrument", example_inputs)
    if _is_live(chosen):
        if not isinstance(why, Regional) and not isinstance(model, Instrumented) and "FXDEBUG_REGIONS" not in os.environ:
            why = _deep_dynamo(model, why)  # frontend="dynamo" on a deep block model: no size cliff either
        return instrument_live(model, pass_list, example_inputs, prior, check, start, backend, why,
                               regional=True if isinstance(why, Regional) else None)
    if backend not in (None, "eager"):
        raise UsageError(f"backend={backend!r} compiles the graphs of the live (Dynamo) capture, and this model is "
                         f"captured by a snapshot frontend ({why or chosen}): "
                         "torch.compile(dbg) compiles a snapshot module, or use frontend='dynamo'.")
    snap = _snapshot(model, chosen, why, example_inputs, trace_options)
    if not isinstance(snap, InstrumentedGraphModule):  # a live module asked for a snapshot frontend
        raise UsageError(f"frontend={trace_options.get('frontend')!r} captures a snapshot, and this module is a live (Dynamo) "
                         "capture: instrument the original model (dbg.model) with that frontend, or add passes to the "
                         "live module with frontend='auto'.")
    gm = run_pipeline(snap, pass_list, example_inputs, prior)
    remember(gm, model, pass_list, example_inputs, trace_options, recapture)
    graph_record(gm).instrument_seconds = time.perf_counter() - start
    if check:  # outputs, every gradient and buffers against the model, in train and eval mode
        verify(gm, example_inputs).raise_if_failed()
    return gm


_LIVE_WHY = ("auto: the live Dynamo capture (no pass that needs a snapshot, no snapshot option, at most "
             f"{LIVE_MODULE_LIMIT} modules); frontend='symbolic' / 'export' / 'subtrees' takes a snapshot instead")
_SNAPSHOT_CHAIN = "captured by symbolic tracing (then export, then subtrees), a snapshot of the model as it is now"


def choices() -> tuple[str, ...]:
    """What ``frontend=`` accepts: ``"auto"`` and every frontend in the registry (``instrumented/pipeline.FRONTENDS``)."""
    return ("auto", *FRONTENDS)


def choose_frontend(model: nn.Module, passes: Sequence[Pass], options: dict[str, Any], entry: str,
                    example_inputs: Any = None) -> tuple[str, str]:
    """The one place a frontend is chosen, for ``trace`` (``entry="trace"``) and ``instrument``: ``(name, why)``.

    ``name`` is a frontend of the registry (``FRONTENDS``; ``FRONTENDS[name].live`` says whether its module
    captures at each call) or ``"auto"``: the snapshot chain (symbolic, then export, then subtrees; its own notes
    say why an earlier one failed). ``why`` is the note for ``trace_info.notes`` (``""`` when the caller named the
    frontend, or the model was captured before and is captured again as it was made).

    The rule for ``frontend="auto"``, the same for both entry points: **the live Dynamo capture, unless a reason
    for a snapshot holds**, and the note says which (``_snapshot_reason``, in this order):

    1. ``FXDEBUG_AUTO=snapshot`` in the environment (the second release's default);
    2. a pass does not work on the live capture's graphs (``live_capture`` False: a transform written for one
       whole graph);
    3. a snapshot frontend's option is given (``leaf_modules``, ``auto_leaf=False``, ``dynamic_batch``);
    4. the model has more than ``LIVE_MODULE_LIMIT`` modules (Dynamo's tracing would take minutes);
    5. the entry is ``trace()``: it runs no passes and returns one graph to look at and edit now (rewrites,
       ``outputs_of``, ``gradcheck`` and ``repro`` of a live module, ``render`` of a plain one all read that
       graph), while Dynamo captures at each call and captures again when a guard fails, so an edit to its
       graphs would not be what runs. ``trace(model, x, frontend="dynamo")`` gives the live module.

    Reasons 1-4 hold for both entry points with the same note. Measured (2026-12-02) before taking reason 5:
    ``trace(model, x)`` live broke 23 of the 444 tests of the 29 files that call ``trace`` (rewrite patterns
    found no match in Dynamo's ``call_function`` graphs, ``outputs_of`` names changed, ``gradcheck`` of a live
    module checked Dynamo's higher-order op, ``auto`` no longer fell through to export), and
    ``trace(model)`` / ``trace(model, x)`` would have returned different kinds of module.
    """
    asked = options.get("frontend", "auto")
    if asked not in FRONTENDS and asked != "auto":
        raise UsageError(f"frontend={asked!r} is not one of {', '.join(choices())}.")
    if asked != "auto":
        return asked, ""
    why = _snapshot_reason(model, passes, options, entry, example_inputs)
    if why is None:  # an instrumented snapshot: its passes are added to that capture
        return "auto", ""
    if isinstance(why, Regional):
        return DynamoFrontend.name, why
    return (DynamoFrontend.name, _LIVE_WHY) if why == "" else ("auto", why)


def _snapshot_reason(model: nn.Module, passes: Sequence[Pass], options: dict[str, Any], entry: str,
                     example_inputs: Any) -> str | None:
    """For ``frontend="auto"``: ``""`` to capture live (Dynamo), else why a snapshot frontend is used.

    ``None``: the model was captured before by a snapshot frontend (its passes are added to that capture).
    """
    inner, _ = unwrap_parallel(model)
    if isinstance(inner, LiveInstrumented):
        return ""
    if isinstance(inner, Instrumented):
        return None
    if not AUTO_IS_LIVE:
        return f"auto: FXDEBUG_AUTO=snapshot in the environment: {_SNAPSHOT_CHAIN}, not the live Dynamo capture"
    snapshot_only = [getattr(p, "name", type(p).__name__) for p in passes if not live_capture(p)]
    if snapshot_only:
        return (f"auto: {', '.join(snapshot_only)} transform(s) the graph into a new module and does not work on the "
                "live capture's graphs (its live_capture is False), so it needs one whole graph: "
                f"{_SNAPSHOT_CHAIN}, not the live Dynamo capture")
    given = [k for k, default in (("leaf_modules", ()), ("auto_leaf", True), ("dynamic_batch", False))
             if k in options and (tuple(options[k]) if k == "leaf_modules" else options[k]) != default]
    if given:
        return f"auto: {', '.join(given)} given, an option of the snapshot frontends: {_SNAPSHOT_CHAIN}, not the live Dynamo capture"
    count = sum(1 for _ in itertools.islice(inner.modules(), LIVE_MODULE_LIMIT + 1))
    if count > LIVE_MODULE_LIMIT:
        if entry == "instrument":
            regional = _regional_note(inner)
            if regional is not None:
                return regional
        return (f"auto: more than {LIVE_MODULE_LIMIT} modules and no repeated block that holds most of them, where "
                f"Dynamo's tracing (~5-10 ms a module) would make the capture take minutes: {_SNAPSHOT_CHAIN} whose "
                "guards refuse later changes to the model; frontend='dynamo' captures it live anyway")
    if entry == "trace":
        return ("auto: trace() runs no passes and returns one graph to look at and edit now; Dynamo captures at each "
                "call (a graph per frame, graph break and recompile, captured again when a guard fails), so an edit to "
                f"its graphs would not be what runs: {_SNAPSHOT_CHAIN}; frontend='dynamo' or instrument() captures live")
    return ""


class Regional(str):
    """The note of an ``"auto"`` choice of the live capture with regional capture on (``LiveState.regional``)."""


def _regional_note(model: nn.Module, by_name: bool = False) -> Regional | None:
    """Above ``LIVE_MODULE_LIMIT`` modules, the live capture when the model's repeated blocks hold at least half of
    its modules: each block is a region traced once and its instances are copies (``live_regions``,
    ``live_copies``), so the capture costs about one block per structure, not Dynamo's trace of every module."""
    from fxdebug.capture.dynamo_regions import covered, find_regions

    regions = find_regions(model)
    if not regions.blocks:
        return None
    inside, total = covered(model, regions)
    if 2 * inside < total:
        return None
    lead = "dynamo: the live capture" if by_name else "auto: the live Dynamo capture"  # (frontend="dynamo" asked)
    inlined = "FXDEBUG_REGIONS=0 captures every block inlined; " if by_name else ""
    return Regional(f"{lead} with regional capture: more than {LIVE_MODULE_LIMIT} modules, "
                    f"{inside} of {total} of them inside {regions.blocks} repeated block(s), each block's structure "
                    "traced once and its instances instrumented as copies of the first (each keeps its own rows); "
                    f"{inlined}frontend='symbolic' / 'export' takes a snapshot instead")


def _deep_dynamo(model: nn.Module, why: str) -> str:
    """The live capture of a model above ``LIVE_MODULE_LIMIT`` modules whose repeated blocks hold most of them, asked
    for by name (``frontend="dynamo"``): with regional capture, as ``"auto"`` takes it (inlined, Dynamo traced every
    module: 57 s for the README's passes at 10,000 nodes against 3 s); ``FXDEBUG_REGIONS=0`` keeps it inlined."""
    inner, _ = unwrap_parallel(model)
    if sum(1 for _ in itertools.islice(inner.modules(), LIVE_MODULE_LIMIT + 1)) <= LIVE_MODULE_LIMIT:
        return why
    note = _regional_note(inner, by_name=True)
    return why if note is None else note


def live_capture(p: Pass) -> bool:
    """Whether pass ``p`` works on the live Dynamo capture's graphs (one per frame, graph break and recompile).

    A pass says so with a ``live_capture`` attribute (docs/writing-passes.md); without one, an observe-only
    pass does and a transform does not (a transform was written for one whole graph of the model)."""
    return bool(getattr(p, "live_capture", p.observe_only))


def render(model_or_gm: nn.Module, path: str, example_inputs: Any = None, **options: Any) -> str:
    """Draw the annotated graph of ``model_or_gm`` to ``path`` (SVG; ``.png``/``.pdf`` also work).

    ``model_or_gm`` is an ``Instrumented`` module (its report is drawn), any ``GraphModule``, or a
    plain ``nn.Module`` (traced here, on ``example_inputs`` when given). The options (``depth``,
    ``show_instrumentation``, ``failed``, ``report``, ``fold``, ``diff``) are ``fxdebug.RenderOptions``
    fields, given as keywords or as ``options=RenderOptions(...)``.
    """
    if isinstance(model_or_gm, nn.Module) and not isinstance(model_or_gm, (GraphModule, Instrumented)):
        model_or_gm = trace(model_or_gm, example_inputs)
    if isinstance(model_or_gm, Instrumented):
        return model_or_gm.render(path, example_inputs, **options)
    return draw(model_or_gm, path, example_inputs, **options)
