"""``LiveInstrumented``: the model as it is at every call, captured by TorchDynamo (``frontend="dynamo"``).

The module holds the model itself (the same ``_modules``, ``_parameters`` and ``_buffers``
dictionaries, not copies): a replaced submodule, a ``load_state_dict``, ``model.train()``, a
config change or a hook added later is what the next call runs. Each call goes through
``torch.compile(model, backend=fxdebug.capture.dynamo.backend)``; Dynamo's guards decide whether a
graph captured before still holds, and capture again when not. Every graph Dynamo hands over
(one per graph break, one per recompile) becomes one part: a copy named by stable node identity
(``capture.dynamo.prepare``), run through the same passes on the arguments of its first call,
and run eagerly from then on, or compiled by Inductor (``backend="inductor"``, or the user's backend
under an outer ``torch.compile(dbg)``: ``live_call.py``). Code between graphs runs eagerly and is named
in the report, with the reason Dynamo gave.

``report()`` merges every part: rows with the same identity (a recompile of the same code for
``labels=``, another shape, ``model.train()``) become one row whose ``calls`` add up.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, any_torch_dispatch_mode_on_stack

from fxdebug.authoring.context import NAMESPACE
from fxdebug.authoring.pipeline import Pass
from fxdebug.authoring.run_part import run_part
from fxdebug.capture.staleness import global_hook_count
from fxdebug.capture.dynamo_backends import compiled, compiler_for, composite
from fxdebug.capture.dynamo import DynamoGraph, live, prepare
from fxdebug.capture.dynamo_regions import is_region_break, regions_enabled
from fxdebug.capture.dynamo_sites import at_site
from fxdebug.capture.trace_info import TraceInfo
from fxdebug.errors import FxDebugError, TraceError, UsageError
from fxdebug.graph.inputs import Inputs, normalize_inputs, preserved_state
from fxdebug.graph.meta import KEY, GraphRecord, graph_record
from fxdebug.graph.module_sharing import share_root_state
from fxdebug.instrumented.base import Instrumented
from fxdebug.instrumented.module import InstrumentedGraphModule
from fxdebug.instrumented.live_blame import guard_error, replayed_blame
from fxdebug.instrumented.live_export import refuse_tracing
from fxdebug.instrumented.live_errors import _diagnose_part, _diagnosed, _dynamo_failed, _first_call_failed
from fxdebug.instrumented.live_copies import (Template, copied_part, copies_enabled, guard_order, identities,
                                              passes_share, signature, template_for)
from fxdebug.instrumented.live_call import backend_note, live_call, live_forward, modes_on, outer_now
from fxdebug.instrumented.live_merge import merge_captures
from fxdebug.instrumented.live_parts import _compiled_entry, _Part, _part_over, _runner, _user_arguments, record_flow
from fxdebug.instrumented.live_skips import compile_scope, run_watched
from fxdebug.instrumented.live_state import STATE_KEY, LiveState
from fxdebug.instrumented.live_report import (_global_calls, _note_fast_paths, _note_none_arguments, _origin_facts,
                                              joined_parts, merged_pass_results)
from fxdebug.render.draw import render as draw
from fxdebug.report.distributed import channel_maxima
from fxdebug.report.report import Report, merge_reports
from fxdebug.runtime.call_flags import one_read_per_call
from fxdebug.runtime.observer import Observer

__all__ = ["LiveInstrumented"]

_SAVED = "dynamo (before the module was saved and loaded, or copied): "
_WHILE_INSTRUMENTING = "_fxdebug_while_instrumenting"  # marks an error raised while a new graph was instrumented
_MODES_NOTE = ("dynamo: called under a TorchDispatchMode: the captured graphs ran under it, the code Dynamo ran "
               "eagerly between graphs (after a graph break) did not")


class LiveInstrumented(Instrumented):
    """An ``Instrumented`` module whose graphs Dynamo captures, at every call, from the live model.

    Not a ``GraphModule``: it holds the model (``_model``, whose own dictionaries it shares: ``state_dict()`` keys
    are the model's) and, in one ``LiveState``, the parts Dynamo's graphs became, as ``torch.compile``'s
    ``OptimizedModule`` holds ``_orig_mod`` and its compiled entry. ``dbg.graph`` is the one captured graph.
    """

    _model: nn.Module
    _live_state: LiveState  # everything else this module keeps (fxdebug/instrumented/live_state.py)

    __call__ = live_call  # the model through Dynamo; under an outer torch.compile, its backend (live_call.py)
    forward = live_forward

    @classmethod
    def _live(cls, model: nn.Module, passes: Sequence[Pass], prior: Report | None = None,
              notes: Sequence[str] = (), backend: str = "eager", regional: bool | None = None) -> "LiveInstrumented":
        # a class of its own, named as the model's: the face may give it the model's class as a further base
        # (instrumented/face.py, for library code that looks methods up on type(self)), as GraphModule's are
        own = type(type(model).__name__, (LiveInstrumented,), {"__module__": cls.__module__})
        gm: LiveInstrumented = nn.Module.__new__(own)
        nn.Module.__init__(gm)
        object.__setattr__(gm, "_model", model)
        # the model's own dictionaries: what is replaced on the model is replaced here
        gm._modules = model._modules
        share_root_state(gm, model)
        gm.training = model.training
        info = TraceInfo(frontend="dynamo")
        info.notes.extend(notes)
        gm.__dict__["meta"] = {KEY: GraphRecord(trace=info, model_type=type(model).__name__)}
        regional = regions_enabled() if regional is None else regional
        gm.__dict__[STATE_KEY] = LiveState(passes=list(passes), prior=prior, backend=backend,
                                           compiled=_compiled_entry(model, compiler_for(backend), compile_scope,
                                                                    regional),
                                           global_hooks=global_hook_count(), regional=regional)
        return gm

    def _live_call(self, *args: Any, **kwargs: Any) -> Any:
        """One call of the model through Dynamo; failures typed.

        Until a call has run (no example inputs at ``instrument()``: the first call is the capture), an
        exception of the model's own forward is a ``TraceError`` naming it and the user's line, as the
        snapshot frontends give at ``instrument()`` (it is a ``RuntimeError`` too; the original is its
        ``__cause__``); after that, the model's exceptions are its own. Dynamo's own failures are
        ``TraceError``s at any call.
        """
        refuse_tracing(self._model)  # torch.jit.trace / onnx export: a typed error pointing to to_module() (issue 35 B14)
        state = self._live_state
        state.calls += 1
        state.sites.counts.clear()  # each call counts its call sites afresh (capture/dynamo_sites.py)
        if global_hook_count() != state.global_hooks:
            state.calls -= 1
            raise TraceError(
                f"a global module hook (torch.nn.modules.module.register_module_forward_hook and kin) was registered or "
                f"removed after {type(self._model).__name__} was instrumented; TorchDynamo does not guard on global hooks, "
                "so the captured graphs would run as before. Instrument again after registering it.",
                module="", op="global hook")
        captured = len(state.parts)
        try:
            with one_read_per_call():  # the checks' device flags of every graph of the call, read once at its end
                if any_torch_dispatch_mode_on_stack():  # Dynamo would skip the frame: nothing captured or observed
                    out = self._call_under_modes(args, kwargs)
                else:
                    with live(self):  # Dynamo's settings for a live capture, skips and breaks noted: live_skips.py
                        try:
                            out = run_watched(self, self._entry_now(), *args, **kwargs)
                        except torch._dynamo.exc.TorchRuntimeError as exc:  # an op failed on Dynamo's fake tensors
                            self._raise_typed(args, kwargs, exc)
                            raise
        except FxDebugError as exc:
            if exc.__dict__.get(_WHILE_INSTRUMENTING):  # a new graph's ops failed on these arguments while its shapes
                guarded = guard_error(self._guarded(args, kwargs))  # were learnt: a pass's guard from the earlier graphs
                if guarded is not None:  # (ShapeAssert's expected vs produced), as when Dynamo's own capture fails
                    raise guarded from exc
            raise
        except torch._dynamo.exc.TorchRuntimeError as exc:  # an op of the model failed (on fake tensors), untyped
            if state.ran:
                raise
            raise _first_call_failed(self._model, exc, state.capturing_examples) from exc
        except torch._dynamo.exc.TorchDynamoException as exc:
            raise _dynamo_failed(self._model, exc) from exc
        except Exception as exc:
            if state.ran:
                raise
            typed = _diagnosed(self._model, args, kwargs, exc)  # an op's shape/device problem names its node
            if typed is not exc and not isinstance(typed, TraceError):  # (not symbolic tracing's own limits)
                raise typed from exc
            raise _first_call_failed(self._model, exc, state.capturing_examples) from exc
        state.ran = True
        if len(state.parts) > captured:  # this call captured: say which optional arguments were None
            _note_none_arguments(self._model, args, kwargs, self.trace_info.notes)
            _note_fast_paths(self._model, self.trace_info.notes)
        return out

    def _entry_now(self) -> Any:
        """The compiled entry for this call: the module's own, or one whose graphs the outer ``torch.compile``'s
        backend compiles (``live_call`` found it active), one per distinct backend (its composite backend)."""
        outer = outer_now()
        if outer is None:
            return self._live_state.compiled
        backend = composite(outer)
        entries = self._live_state.entries
        for have, entry in entries:
            if have is backend:
                return entry
        entry = _compiled_entry(self._model, outer, compile_scope, self._live_state.regional)
        entries.append((backend, entry))
        return entry

    def _raise_typed(self, args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception) -> None:
        """An op failed on Dynamo's fake tensors while it captured again: the typed error for it, if one is found.

        A pass's guard error (``DeviceCheck``) stands alone (no real op ran; Dynamo's fake-tensor traceback would only
        bury it), or keeps its own cause (the real op's error when an op of a captured graph failed on these
        arguments); a diagnosis by a symbolic capture keeps Dynamo's error as its cause.
        """
        guarded = replayed_blame(self._guarded(args, kwargs), exc, self.parts().values())  # not another op's (B15)
        if guarded is not None:  # its own cause (the real op's error, when a captured graph's op failed) or none
            raise guarded from guarded.__cause__
        diagnosed = _diagnosed(self._model, args, kwargs, exc)
        if diagnosed is not exc:
            raise diagnosed from exc

    def _guarded(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FxDebugError | None:
        """The error a pass's run-time guard (``DeviceCheck``, ``ShapeAssert``) gives for these arguments.

        Dynamo captures again when a guard fails (the model moved to ``meta``, another shape) and
        fails on its fake tensors before any instrumented graph runs; the graphs captured before
        read the model's state live, so running the one that takes these arguments raises what the
        symbolic frontend would: the typed error of the pass, naming the node. Its statistics are
        put back.
        """
        from fxdebug.instrumented.verify import _statistics_kept

        if kwargs:
            return None
        for found in guard_order(self._live_state.parts):
            part = found.part
            call = _user_arguments([n for n in part.graph.nodes if n.op == "placeholder"], args)
            if call is None:
                continue
            try:
                with _statistics_kept(part), torch.no_grad():
                    part(*call)
            except FxDebugError as err:
                return err
            except Exception:
                continue
        return None

    def _call_under_modes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call under the user's ``TorchDispatchMode`` (one that checks for host syncs, counts ops, ...).

        ``torch.compile`` runs a frame eagerly while a non-infra dispatch mode is on the stack, so the
        instrumented graphs would never run (every row 0 calls). The modes are lifted off the stack
        while Dynamo checks its guards (or captures, on fake tensors), and put back around each
        captured graph's run: the user's mode sees every op of the graphs, the observers' included.
        Code Dynamo runs eagerly between graphs (after a graph break) runs without the modes; the
        report says so.
        """
        lifted = self._live_state.lifted
        with _disable_current_modes() as modes:
            lifted.append(list(modes))
            try:
                with live(self):  # as any call: regions and skipped submodules routed, skips and breaks noted
                    return run_watched(self, self._entry_now(), *args, **kwargs)
            except torch._dynamo.exc.TorchRuntimeError as exc:
                self._raise_typed(args, kwargs, exc)
                raise
            finally:
                lifted.pop()

    # -- the session Dynamo's graphs run in ---------------------------------------------------------
    def run_graph(self, graph: DynamoGraph, args: tuple[Any, ...]) -> Any:
        state = self._live_state
        graph = at_site(state.sites, self._model, graph)  # one part per call site (capture/dynamo_sites.py)
        found = state.parts.get(graph)
        if found is None:
            found = self._instrument_graph(graph, args)
        if state.capturing_examples:
            # instrument()'s capture on the example inputs: the graph is instrumented (shapes learnt), but what runs
            # is Dynamo's plain graph, as a snapshot frontend runs the model only to learn shapes: no breakpoint,
            # raise-mode check, NaN callback or gradient hook of the passes fires at instrument time
            return record_flow(state, found, args, graph.gm(*args))  # and which part fed which (render joins them)
        found.calls.append(state.calls - 1)  # this graph's next call index is the module's call
        lifted = state.lifted
        try:
            if lifted:  # the user's dispatch modes, lifted while Dynamo checked its guards: back on for the graph
                if graph.graph_break and _MODES_NOTE not in self.trace_info.notes:
                    self.trace_info.notes.append(_MODES_NOTE)
                with modes_on(lifted[-1]):
                    return found.run(*args)
            return found.run(*args)  # the part's forward over Dynamo's own arguments (model state included)
        except FxDebugError:
            raise
        except Exception as exc:
            _diagnose_part(found.part, found.keep, args, exc)
            raise

    def _instrument_graph(self, graph: DynamoGraph, args: tuple[Any, ...]) -> "_Part":
        state = self._live_state
        with state.lock:
            parts = state.parts
            if graph in parts:
                return parts[graph]
            start = time.perf_counter()
            model = self._model
            prepared = prepare(graph, state.namer, args, model, NAMESPACE)
            shared = template_for(graph) if copies_enabled() and passes_share(state.passes) else None
            if shared is not None:
                copied = copied_part(state, self._model, graph, shared, prepared, args, start)
                if copied is not None:
                    return copied
                names = identities(prepared.graph)  # before the passes: what names this instance
            part = _part_over(model, prepared)
            info = TraceInfo(frontend="dynamo")
            if graph.graph_break:
                info.notes.append(f"dynamo: this graph ends at a graph break ({graph.where or '?'})")
            part.meta[KEY] = GraphRecord(trace=info, model_type=type(model).__name__)
            inputs = Inputs(*[args[i] for i in prepared.keep])
            try:
                part = run_part(part, state.passes, inputs, state.prior, partial=True)
            except FxDebugError as exc:
                exc.__dict__[_WHILE_INSTRUMENTING] = True
                raise
            info.seconds = time.perf_counter() - start
            top = graph_record(self)
            if not top.passes:  # the passes as they ran on the first graph
                top.passes.extend(graph_record(part).passes)
            run = _runner(part, len(args), prepared.keep)
            if graph.compiler is not None:  # the instrumented graph compiled (Inductor), at its first call
                run = compiled(run, graph.compiler)
            found = parts[graph] = _Part(part, prepared.keep, run)
            if shared is not None and shared not in state.templates:
                state.templates[shared] = Template(graph, found, names, signature([args[i] for i in prepared.keep]),
                                                   getattr(graph, "site").module)  # (a sited graph: template_for)
            return found

    # -- what fxdebug knows -----------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The user's model, the one this module captures at every call.

        Where the model has an attribute or submodule of its own named ``model`` (Hugging Face's
        ``LlamaForCausalLM.model``), that is what ``dbg.model`` is, as for every other name of the model's face."""
        own = self._modules.get("model")
        if own is not None:
            return own
        return self.__dict__["_model"].__dict__.get("model", self._model)

    @property
    def pass_results(self) -> list[Any]:
        return merged_pass_results(self)  # each pass over every captured graph

    def graphs(self) -> list[DynamoGraph]:
        """Every graph Dynamo handed over while this module ran, in the order they were captured."""
        return list(self._live_state.parts)

    def parts(self) -> dict[str, InstrumentedGraphModule]:
        """``{"frame/recompile": InstrumentedGraphModule}`` for every graph captured so far, in capture order."""
        return {g.key: p.part for g, p in self._live_state.parts.items()}

    def replace_part(self, path: str, new: InstrumentedGraphModule) -> "LiveInstrumented":
        parts = self._live_state.parts
        for g in parts:
            if g.key == path:
                parts[g] = _Part(new, parts[g].keep)
                return self
        raise KeyError(f"no captured part {path!r}; parts: {list(self.parts())}")

    def observers(self) -> dict[str, Observer]:
        out: dict[str, Observer] = {}
        for part in self.parts().values():
            for name, obs in part._own_observers().items():
                out.setdefault(name, obs)
        return out

    def channel_maxima(self) -> dict[str, list[float]]:
        """``{node: per-channel max}`` over every capture (``report(all_ranks=True)`` merges ranks by them): the
        elementwise max where several captures ran a node (``observers()`` holds one capture's observer per name)."""
        out: dict[str, list[float]] = {}
        for found in self._live_state.parts.values():
            for name, values in channel_maxima(found.part).items():
                have = out.get(name)
                out[name] = values if have is None or len(have) != len(values) else [max(a, b) for a, b in zip(have, values)]
        return out

    def train(self, mode: bool = True) -> "LiveInstrumented":
        self._model.train(mode)
        self.training = mode
        return self

    def _summary_notes(self) -> list[str]:
        # the graphs Dynamo handed over: one per call site counted once (SitedGraph.base), snapshot parts (frame -1) not
        graphs = list(dict.fromkeys(getattr(g, "base", None) or g for g in self.graphs() if g.frame >= 0))
        notes = list(self.trace_info.notes) + self._live_state.saved_notes
        if not graphs:
            return notes
        frames = {g.code or g.frame for g in graphs}
        recompiles = len(graphs) - len(frames)
        notes.append(f"dynamo: {len(graphs)} graph(s) captured over {len(frames)} frame(s); "
                     f"{recompiles} recompile(s) (a guard failed: another mode, shape, keyword signature, "
                     "attribute value or hook)")
        notes.append(backend_note(self._live_state.parts))
        seen: set[tuple[str, str]] = set()
        for g in graphs:
            if g.graph_break and (g.where, g.reason) not in seen and not is_region_break(g.reason):
                seen.add((g.where, g.reason))
                notes.append(f"dynamo: graph break at {g.where or '?'}: the code from there to the next graph ran "
                             f"eagerly, unobserved; Dynamo's reason: {g.reason.split(' Hint:')[0][:300]}")
        return notes

    def report(self, all_ranks: bool = False, **options: Any) -> Report:
        if all_ranks:
            return super().report(all_ranks=True, **options)
        if options:
            raise UsageError(f"report() got unexpected options {sorted(options)} (they go with all_ranks=True)")
        # the captures' reports from before a save/load (their graphs stay behind: Dynamo's cache is per process)
        state = self._live_state
        reports: list[tuple[Report, Any]] = list(state.saved)
        for found in state.parts.values():
            rep = found.part._part_report()
            _global_calls(rep, found.calls)
            reports.append((rep, found.part))
        observed = [r for r in reports if any("calls" in row for row in r[0].rows)]
        if observed:  # a graph no pass observed (outside ``where=``) lists its nodes only in a report of none observed
            reports = observed
        one = merge_captures(reports, state.calls)
        merged = merge_reports({"": one}, frontend="dynamo", notes=self._summary_notes())
        merged.calls = state.calls
        _origin_facts(merged, reports)
        return merged

    def reset(self) -> None:
        state = self._live_state
        for found in state.parts.values():
            found.part.reset()
            found.calls.clear()
        state.calls = 0
        state.saved = []
        state.saved_notes = []

    def learn_shapes(self, example_inputs: Any) -> None:
        """Shapes are learnt from the arguments of each graph's first call."""

    def to_module(self, shrink: bool = False) -> nn.Module:
        """A plain ``GraphModule`` of the model as it is now, with this module's transforms (issue 35 B4): a snapshot
        (symbolic tracing, else ``torch.export`` on the example inputs) that the transform passes run over, carrying
        the live graphs' masks and derived layers (``fxdebug.instrumented.live_export``)."""
        from fxdebug.instrumented.live_export import live_to_module

        state = self._live_state
        return live_to_module(self._model, state.passes, state.prior, self.example_inputs, self.parts().values(),
                              shrink)

    def render(self, path: str, example_inputs: Any = None, **kwargs: Any) -> str:
        """Draw the captured graphs (several joined into one picture), annotated with the report over every capture."""
        if example_inputs is not None and not self.parts():
            inputs = normalize_inputs(example_inputs)
            if inputs is not None:
                with preserved_state(self._model):
                    self(*inputs[0], **inputs[1])
                self.reset()
        parts = list(self.parts().values())
        if not parts:
            raise UsageError("nothing captured yet: call the module once (or instrument it with example_inputs) "
                             "before render().")
        report = kwargs.pop("report", None)
        if report is None and self.observers():
            report = self.report()
        largest = max(parts, key=lambda p: len(p.graph.nodes))  # several graphs: all, joined by what fed which
        return draw(largest, path, report=report, **{"parts": joined_parts(self), **kwargs})

    def retrace(self) -> Instrumented:
        state = self._live_state
        again = LiveInstrumented._live(self._model, state.passes, state.prior, self.trace_info.notes, state.backend,
                                       state.regional)
        graph_record(again).passes.extend(graph_record(self).passes)  # what the passes did: the same passes
        return again

    def __deepcopy__(self, memo: dict[int, Any]) -> "LiveInstrumented":
        import copy

        state = self._live_state
        twin = LiveInstrumented._live(copy.deepcopy(self._model, memo), state.passes, state.prior,
                                      self.trace_info.notes, state.backend, state.regional)
        graph_record(twin).passes.extend(graph_record(self).passes)
        return twin

    def __reduce__(self) -> Any:
        """Saved with what it observed: each capture's report (rows, call counts, per-channel maxima), the
        module's call count and its node names. The graphs themselves are Dynamo's, valid in this process
        only: the loaded module captures again at its first call, and the new rows merge with the saved ones."""
        live = self._live_state
        saved: list[tuple[Report, Any]] = list(live.saved)
        for found in live.parts.values():
            rep = found.part._part_report()
            _global_calls(rep, found.calls)
            saved.append((rep, channel_maxima(found.part)))
        notes = [n if n.startswith(_SAVED) else n.replace("dynamo: ", _SAVED, 1)
                 for n in self._summary_notes() if n not in self.trace_info.notes]
        state = {"saved": saved, "calls": live.calls, "namer": live.namer, "notes": notes, "backend": live.backend,
                 "regional": live.regional,
                 # what each pass did (names and counts; not the graph it did it to, which stays in this process)
                 "pass_results": [dataclasses.replace(r, gm=None) for r in graph_record(self).passes]}
        return (_load_live, (self._model, live.passes, list(self.trace_info.notes), state))


def _load_live(model: nn.Module, passes: list[Any], notes: list[str],
               state: dict[str, Any] | None = None) -> LiveInstrumented:
    gm = LiveInstrumented._live(model, passes, None, notes, (state or {}).get("backend", "eager"),
                                (state or {}).get("regional"))
    if state:  # what the saved module had observed (see ``LiveInstrumented.__reduce__``)
        live = gm._live_state
        live.saved, live.calls, live.namer = list(state["saved"]), int(state["calls"]), state["namer"]
        live.saved_notes = list(state["notes"])
        graph_record(gm).passes.extend(state.get("pass_results", ()))
    return gm
