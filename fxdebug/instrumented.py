"""``Instrumented`` — the GraphModule users get back — and ``trace`` / ``instrument``.

An ``Instrumented`` module holds the user's model's own submodules, parameters and buffers (the
same objects, not copies), so training it trains the model, ``state_dict()`` keys are the
model's, and a checkpoint loads either way. Everything fxdebug adds (observers, the clock, new
modules from transform passes) lives under one root attribute, ``fxdebug``, with no persistent
state. The model itself is never modified.

When an op fails inside the instrumented forward, the error is re-raised as a typed fxdebug
error naming the node (see ``diagnose``); on the success path nothing is added to the call.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections import OrderedDict
from typing import Any, Sequence

from torch import nn
from torch.fx import Graph, GraphModule

from .context import NAMESPACE, PassContext
from .diagnose import locate_failure, op_failure
from .errors import FxDebugError, TraceError, UsageError
from .meta import fx_meta
from .observe import Clock, Observer
from .passes_api import Pass, PassManager, validate_passes
from .report import Report, build_report
from .serialize import deserialize_graph, encode_pytree_info, serialize_graph
from .tracing import TraceInfo, capture_symbolic, normalize_inputs

__all__ = ["Instrumented", "instrument", "trace"]

_FRONTENDS = ("auto", "symbolic", "export", "subtrees")


class Instrumented(GraphModule):
    """A traced, possibly instrumented model: a ``torch.fx.GraphModule`` with a report.

    Build one with ``fxdebug.trace`` or ``fxdebug.instrument``, not directly.
    """

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def _build(cls, model: nn.Module, graph: Graph, info: TraceInfo, namespace: nn.Module | None = None) -> "Instrumented":
        """``namespace``: fxdebug's own modules the graph already refers to (``fxdebug.*`` targets)."""
        root: nn.Module = model
        if namespace is not None:
            root = _Holder({**model._modules, NAMESPACE: namespace}, model._parameters, model._buffers,
                           model._non_persistent_buffers_set, model.training)
        gm = cls(root, graph, class_name=type(model).__name__)
        _adopt_hierarchy(gm, model)
        if namespace is not None:
            gm._modules[NAMESPACE] = namespace  # GraphModule copied it with persistent buffers; keep ours
        gm.meta["fxdebug"] = {"trace": info, "passes": [], "model_type": type(model).__name__}
        return gm

    def recompile(self) -> Any:
        code = super().recompile()
        type(self).__call__ = Instrumented._call_with_diagnosis  # type: ignore[method-assign]
        return code

    def _call_with_diagnosis(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return nn.Module.__call__(self, *args, **kwargs)
        except FxDebugError:
            raise
        except Exception as exc:
            located = locate_failure(self, exc)
            if located is None:
                raise
            node, inputs = located
            err = op_failure(node, exc, inputs)
            if type(err) is FxDebugError:  # not a shape/device problem: keep the user's exception type
                exc.add_note(f"fxdebug: {err.message}")
                raise
            raise err from exc

    # -- what fxdebug knows -----------------------------------------------------------------------
    @property
    def trace_info(self) -> TraceInfo:
        return self.meta.get("fxdebug", {}).get("trace") or TraceInfo()

    @property
    def pass_results(self) -> list[Any]:
        return self.meta.get("fxdebug", {}).get("passes", [])

    def observers(self) -> dict[str, Observer]:
        """``{observed node name: Observer}`` for every observed node, in graph order."""
        out = {}
        for n in self.graph.nodes:
            if n.op == "call_module" and fx_meta(n).get("role") == "instrumentation":
                out[fx_meta(n)["observes"]] = self.get_submodule(str(n.target))
        return out

    def _clock(self) -> Clock | None:
        space = getattr(self, NAMESPACE, None)
        if space is None:
            return None
        return next((m for m in space.children() if isinstance(m, Clock)), None)

    def report(self) -> Report:
        """What the observe passes saw since the last ``reset()`` (reading it syncs the device)."""
        info = self.trace_info
        clock = self._clock()
        notes = list(info.notes)
        for res in self.pass_results:
            notes.extend(f"{res.pass_name}: {n}" for n in res.notes)
        return build_report(
            self,
            auto_leaves={k: str(v) for k, v in info.auto_leaves.items()},
            frontend=info.frontend,
            notes=notes,
            calls=clock.calls if clock is not None else 0,
        )

    def reset(self) -> None:
        """Forget every statistic collected so far."""
        for obs in self.observers().values():
            obs.reset()
        clock = self._clock()
        if clock is not None:
            clock.reset()

    def render(self, path: str, **kwargs: Any) -> str:
        """Draw the annotated graph to ``path`` (SVG); see ``fxdebug.render``."""
        from .render import render

        return render(self, path, **kwargs)

    # -- copying and saving ---------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> "Instrumented":
        with warnings.catch_warnings():  # copying an export graph's TreeSpecs trips torch's LeafSpec deprecation
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            res = super().__deepcopy__(memo)
        _adopt_hierarchy(res, _Holder(
            OrderedDict((k, copy.deepcopy(v, memo)) for k, v in self._modules.items()),
            OrderedDict((k, copy.deepcopy(v, memo)) for k, v in self._parameters.items()),
            OrderedDict((k, copy.deepcopy(v, memo)) for k, v in self._buffers.items()),
            set(self._non_persistent_buffers_set), self.training))
        return res

    def __reduce__(self) -> Any:
        holder = (dict(self._modules), dict(self._parameters), dict(self._buffers),
                  set(self._non_persistent_buffers_set), self.training)
        extras = {k: v for k, v in self.__dict__.items()
                  if not k.startswith("_") and k not in ("training", "meta") and not callable(v)}
        return (_load_instrumented, (serialize_graph(self.graph), holder, self.meta, extras,
                                     encode_pytree_info(self.graph)))


class _Holder(nn.Module):
    """A bare module carrying a hierarchy, used to rebuild an ``Instrumented``."""

    def __init__(self, modules: Any, params: Any, buffers: Any, non_persistent: set[str], training: bool) -> None:
        super().__init__()
        self._modules = OrderedDict(modules)
        self._parameters = OrderedDict(params)
        self._buffers = OrderedDict(buffers)
        self._non_persistent_buffers_set = set(non_persistent)
        self.training = training


def _adopt_hierarchy(gm: GraphModule, model: nn.Module) -> None:
    """Make ``gm``'s children, parameters and buffers exactly ``model``'s (same objects).

    ``GraphModule`` keeps only what the graph references, under fresh containers; adopting the
    whole hierarchy keeps ``state_dict()`` keys identical to the model's (unused layers included)
    and keeps fxdebug's own modules under the ``fxdebug`` attribute.
    """
    ours = gm._modules.get(NAMESPACE)
    gm._modules = OrderedDict(model._modules)
    if ours is not None and NAMESPACE not in gm._modules:
        gm._modules[NAMESPACE] = ours
    # The root's own parameter and buffer dicts are shared, not copied: model.to(device) replaces
    # Parameter objects in place in that dict, and the instrumented module must see the new ones.
    # fxdebug registers nothing at the root (its state lives under the namespace), so sharing is safe.
    gm._parameters = model._parameters
    gm._buffers = model._buffers
    gm._non_persistent_buffers_set = model._non_persistent_buffers_set
    gm.training = model.training


def _load_instrumented(rows: Any, holder: Any, meta: dict[str, Any], extras: dict[str, Any],
                       pytree_info: Any = None) -> Instrumented:
    root = _Holder(*holder)
    for k, v in extras.items():
        setattr(root, k, v)
    graph = deserialize_graph(rows, pytree_info)
    gm = Instrumented(root, graph, class_name=meta.get("fxdebug", {}).get("model_type", "GraphModule"))
    _adopt_hierarchy(gm, root)
    gm.meta = meta
    return gm


# -- public entry points ----------------------------------------------------------------------------
def _check_model(model: Any, fn: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        hint = " (it is a class: instantiate it first)" if isinstance(model, type) else ""
        raise UsageError(f"{fn}() needs a torch.nn.Module instance; got {type(model).__name__}{hint}.")
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
    if isinstance(model, Instrumented):
        if hasattr(model, "instrument_parts"):
            raise UsageError("a model captured per subtree cannot be traced again; call fxdebug.instrument on the "
                             "original model with all the passes you want.")
        return _copy_instrumented(model)
    if frontend not in _FRONTENDS:
        raise UsageError(f"frontend={frontend!r} is not one of {', '.join(_FRONTENDS)}.")
    inputs = normalize_inputs(example_inputs)
    if frontend == "symbolic":
        return _trace_symbolic(model, inputs, leaf_modules, auto_leaf)
    if frontend == "export":
        return _trace_export(model, inputs, dynamic_batch)
    if frontend == "subtrees":
        return _trace_subtrees(model, inputs, leaf_modules, auto_leaf, dynamic_batch)
    start = time.perf_counter()
    try:
        return _trace_symbolic(model, inputs, leaf_modules, auto_leaf)
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
        gm = _trace_export(model, inputs, dynamic_batch)
    except TraceError as exc:
        why.append(f"auto: torch.export failed: {exc.message}")
        try:
            gm = _trace_subtrees(model, inputs, leaf_modules, auto_leaf, dynamic_batch)
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


def _trace_export(model: nn.Module, inputs: Any, dynamic_batch: bool) -> Instrumented:
    from .frontends.export import capture_export

    graph, info, space = capture_export(model, inputs, dynamic_batch=dynamic_batch)
    return Instrumented._build(model, graph, info, namespace=space)


def _trace_subtrees(model: nn.Module, inputs: Any, leaf_modules: Sequence[str | type[nn.Module]],
                    auto_leaf: bool, dynamic_batch: bool) -> Instrumented:
    from .frontends.subtrees import capture_subtrees

    return capture_subtrees(model, inputs, leaf_modules=leaf_modules, auto_leaf=auto_leaf,
                            dynamic_batch=dynamic_batch)


def _trace_symbolic(model: nn.Module, inputs: Any, leaf_modules: Any, auto_leaf: bool) -> Instrumented:
    graph, info = capture_symbolic(model, inputs, leaf_modules=leaf_modules, auto_leaf=auto_leaf)
    if not info.constants:
        return Instrumented._build(model, graph, info)
    # Tensors created in forward live under fxdebug.constants (non-persistent), not on the model.
    space, consts = nn.Module(), nn.Module()
    for name, value in info.constants.items():
        consts.register_buffer(name, value, persistent=False)
    space.add_module("constants", consts)
    for node in graph.nodes:
        if node.op == "get_attr" and str(node.target) in info.constants:
            node.target = f"{NAMESPACE}.constants.{node.target}"
    info.constants = {}
    return Instrumented._build(model, graph, info, namespace=space)


def _copy_instrumented(gm: Instrumented) -> Instrumented:
    """A new Instrumented over the same model objects, with its own copy of fxdebug's modules."""
    with warnings.catch_warnings():  # torch's own deepcopy of an export graph's pytree spec warns
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:  # Graph.__deepcopy__ copies node.meta shallowly: own fxdebug's dicts
        if "fxdebug" in node.meta:
            node.meta["fxdebug"] = copy.deepcopy(node.meta["fxdebug"])
    res = Instrumented(gm, graph, class_name=gm.meta.get("fxdebug", {}).get("model_type", "GraphModule"))
    _adopt_hierarchy(res, gm)
    if NAMESPACE in gm._modules:
        res._modules[NAMESPACE] = copy.deepcopy(gm._modules[NAMESPACE])
        res.recompile()
    info = gm.meta.get("fxdebug", {})
    res.meta["fxdebug"] = {"trace": info.get("trace"), "passes": list(info.get("passes", [])),
                           "model_type": info.get("model_type")}
    return res


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
    """
    _check_model(model, "instrument")
    pass_list = validate_passes(passes)
    prior = trace_options.pop("prior_report", None)
    if prior is None and isinstance(model, Instrumented) and model.observers():
        prior = model.report()
    start = time.perf_counter()
    gm = trace(model, example_inputs, **trace_options)
    instrument_parts = getattr(gm, "instrument_parts", None)
    if instrument_parts is not None:  # frontend "subtrees": the passes run on each captured part
        gm = instrument_parts(pass_list, prior)
        gm.meta.setdefault("fxdebug", {})["instrument_seconds"] = time.perf_counter() - start
        return gm
    ctx = PassContext(example_inputs, prior_report=prior)
    if ctx.inputs is not None:
        ctx.specs(gm)  # validates the example inputs against the model, naming the failing node
    manager = PassManager(pass_list)
    gm = manager.run(gm, ctx)
    if ctx.inputs is not None and not all(p.observe_only for p in pass_list):
        ctx.specs(gm)  # a transform made new nodes: learn their shapes for the report and picture
    meta = gm.meta.setdefault("fxdebug", {})
    meta.setdefault("passes", []).extend(manager.results)
    meta["instrument_seconds"] = time.perf_counter() - start
    return gm
