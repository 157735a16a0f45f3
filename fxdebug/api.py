"""The entry points: ``trace``, ``instrument``, ``render``, and the choice of frontend.

``trace`` picks a frontend (``frontends/``) and returns what every frontend returns, an
``Instrumented`` module; ``instrument`` traces and runs the pass pipeline (``run_pipeline``) over
each of its ``parts()`` (the live Dynamo frontend's module and capture call: ``instrumented/live_instrument``);
``choose_frontend`` is the one choice of frontend for both, with the note why; ``render`` draws any module,
tracing a plain one first. Nothing here
knows which frontend made a module: the parts say it.
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
from fxdebug.capture.dynamo_backends import check_backend
from fxdebug.instrumented.live import LiveInstrumented
from fxdebug.instrumented.live_instrument import instrument_live
from fxdebug.instrumented.module import Instrumented
from fxdebug.instrumented.pipeline import FRONTENDS, capture_module, module_from_capture, recapture, run_pipeline
from fxdebug.graph.meta import graph_record
from fxdebug.instrumented.snapshot_recipe import remember
from fxdebug.authoring.pipeline import Pass, validate_passes
from fxdebug.render.draw import render as draw
from fxdebug.graph.inputs import normalize_inputs
from fxdebug.graph.usage import check_example_inputs, check_options
from fxdebug.instrumented.verify import verify

__all__ = ["FRONTENDS", "instrument", "module_from_capture", "render", "run_pipeline", "trace"]

_CHOICES = ("auto", "dynamo", *FRONTENDS)
# instrument(frontend="auto"): the live Dynamo capture unless a pass does not work on its graphs (live_capture()),
# or a snapshot option is given (then symbolic, export, subtrees, noted). FXDEBUG_AUTO=snapshot keeps "auto" on that snapshot chain
# for every pass list (docs/frontends.md)
AUTO_IS_LIVE = os.environ.get("FXDEBUG_AUTO", "dynamo") != "snapshot"
# Dynamo traces ~5-10 ms per module call on CPU (symbolic tracing ~0.2 ms per node): above this many modules a
# live capture would take tens of seconds to minutes (a 70B-class trunk, a 10k-layer chain), so "auto" takes the
# guarded snapshot instead, noted; frontend="dynamo" still captures any model live
LIVE_MODULE_LIMIT = 1000
# instrument()'s own keywords (popped before the rest go to trace()); trace()'s are read from its signature
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

    Frontends (``frontend=``), tried in this order by ``"auto"``:

    * ``"symbolic"`` — ``torch.fx`` symbolic tracing; submodules that cannot be traced become
      leaves automatically (``auto_leaf=True``), recorded in ``.trace_info`` and in reports.
      Module-level graph, the most readable. Needs no example inputs.
    * ``"export"`` — ``torch.export`` (non-strict) on the example inputs: an aten-level graph whose
      nodes keep their module path. Captures roots that FX cannot (item assignment, loops over
      inputs, ``*args``). ``dynamic_batch=True`` lets dim 0 of every tensor input vary.
    * ``"subtrees"`` — keeps the root's forward eager and instruments the largest submodules
      that one of the above captures; the report gives the fraction of parameters and executed
      ops under instrumentation and which modules stayed eager, and why.

    The chosen frontend is ``.trace_info.frontend``; ``"auto"`` also notes why earlier ones failed.
    """
    _check_model(model, "trace")
    model, unwrapped = unwrap_parallel(model)  # DDP / DataParallel: the model is .module
    if isinstance(model, Instrumented):
        again = model.retrace()
        if not isinstance(again, LiveInstrumented):  # a live module's graphs are Dynamo's: no snapshot recipe
            remember(again, model, (), example_inputs, {}, recapture)
        return again
    frontend, _ = choose_frontend(model, (), {"frontend": frontend}, "trace")
    if frontend == "dynamo":
        return instrument_live(model, [], example_inputs, None, False, time.perf_counter())
    inputs = normalize_inputs(example_inputs)
    check_example_inputs(model, inputs)
    options = TraceOptions(tuple(leaf_modules), auto_leaf, dynamic_batch)
    gm = _capture(frontend, model, inputs, options) if frontend != "auto" else _trace_auto(model, inputs, options)
    if unwrapped:
        gm.trace_info.notes.insert(0, unwrapped)
    remember(gm, model, (), example_inputs,  # so that a switch of training mode captures that mode's graph
             {"leaf_modules": tuple(leaf_modules), "auto_leaf": auto_leaf, "dynamic_batch": dynamic_batch}, recapture)
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
    chosen, why = choose_frontend(model, pass_list, trace_options, "instrument")
    if chosen == "dynamo":
        return instrument_live(model, pass_list, example_inputs, prior, check, start, backend, why)
    if backend not in (None, "eager"):
        raise UsageError(f"backend={backend!r} compiles the graphs of the live (Dynamo) capture, and this model is "
                         f"captured by a snapshot frontend ({why or chosen}): "
                         "torch.compile(dbg) compiles a snapshot module, or use frontend='dynamo'.")
    gm = run_pipeline(trace(model, example_inputs, **trace_options), pass_list, example_inputs, prior)
    if why:
        gm.trace_info.notes.insert(0, why)
    remember(gm, model, pass_list, example_inputs, trace_options, recapture)
    graph_record(gm).instrument_seconds = time.perf_counter() - start
    if check:  # outputs, every gradient and buffers against the model, in train and eval mode
        verify(gm, example_inputs).raise_if_failed()
    return gm


_LIVE_WHY = ("auto: the live Dynamo capture (passes that work on it, no snapshot option, at most "
             f"{LIVE_MODULE_LIMIT} modules); a pass whose live_capture is False, leaf_modules / auto_leaf / "
             "dynamic_batch or a larger model would take a snapshot frontend")


def choose_frontend(model: nn.Module, passes: Sequence[Pass], options: dict[str, Any], entry: str) -> tuple[str, str]:
    """The one place a frontend is chosen, for ``trace`` (``entry="trace"``) and ``instrument``: ``(name, why)``.

    ``name`` is ``"dynamo"`` (the live capture), a snapshot frontend's name, or ``"auto"``: the snapshot chain
    (symbolic, then export, then subtrees; its own notes say why an earlier one failed). ``why`` is the note for
    ``trace_info.notes`` ("" when the caller named the frontend). ``frontend="auto"`` is the live capture for
    ``instrument()`` unless ``_static_reason`` gives a reason for a snapshot (or ``FXDEBUG_AUTO=snapshot``); for
    ``trace()``, which runs no passes and returns a graph to look at, it is the snapshot chain.
    """
    asked = options.get("frontend", "auto")
    if asked not in _CHOICES:
        raise UsageError(f"frontend={asked!r} is not one of {', '.join(_CHOICES)}.")
    if asked != "auto" or entry == "trace" or not AUTO_IS_LIVE:
        return asked, ""
    why = _static_reason(model, passes, options)
    if why is None:  # an instrumented snapshot: its passes are added to that capture
        return "auto", ""
    return ("dynamo", _LIVE_WHY) if why == "" else ("auto", why)


def _static_reason(model: nn.Module, passes: Sequence[Pass], options: dict[str, Any]) -> str | None:
    """For ``frontend="auto"``: ``""`` to capture live (Dynamo), else why a snapshot frontend is used.

    ``None``: the model was captured before by a snapshot frontend (its passes are added to that capture).
    """
    inner, _ = unwrap_parallel(model)
    if isinstance(inner, LiveInstrumented):
        return ""
    if isinstance(inner, Instrumented):
        return None
    snapshot_only = [getattr(p, "name", type(p).__name__) for p in passes if not live_capture(p)]
    if snapshot_only:
        return (f"auto: {', '.join(snapshot_only)} transform(s) the graph into a new module and does not work on the "
                "live capture's graphs (its live_capture is False), so it needs one whole graph: captured by symbolic "
                "tracing (then export, then subtrees), a snapshot of the model as it is now, not the live Dynamo capture")
    given = [k for k, default in (("leaf_modules", ()), ("auto_leaf", True), ("dynamic_batch", False))
             if k in options and options[k] != default]
    if given:
        return (f"auto: {', '.join(given)} given, an option of the snapshot frontends: captured by symbolic tracing "
                "(then export, then subtrees), not the live Dynamo capture")
    count = sum(1 for _ in itertools.islice(inner.modules(), LIVE_MODULE_LIMIT + 1))
    if count > LIVE_MODULE_LIMIT:
        return (f"auto: more than {LIVE_MODULE_LIMIT} modules, where Dynamo's tracing (~5-10 ms a module) would make "
                "instrument() take minutes: captured by symbolic tracing (then export, then subtrees), a snapshot whose "
                "guards refuse later changes to the model; frontend='dynamo' captures it live anyway")
    return ""


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
    if isinstance(model_or_gm, nn.Module) and not isinstance(model_or_gm, GraphModule):
        model_or_gm = trace(model_or_gm, example_inputs)
    if isinstance(model_or_gm, Instrumented):
        return model_or_gm.render(path, example_inputs, **options)
    return draw(model_or_gm, path, example_inputs, **options)
