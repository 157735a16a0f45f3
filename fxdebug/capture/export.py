"""The ``torch.export`` frontend: an aten-level graph for models whose root FX cannot trace.

Symbolic tracing stops at the first Python construct a ``Proxy`` cannot stand in for: item
assignment on a traced tensor, iterating over a list input, ``*args``/``**kwargs`` signatures,
branching on a shape. ``torch.export.export(..., strict=False)`` runs the real Python on fake
tensors instead, so it captures all of these, as aten ops. Each node keeps the module it ran in
(``nn_module_stack``), which fxdebug copies into its own metadata, so reports and pictures still
read as the model's structure.

The exported program is turned into an fxdebug graph that refers to the model's *own* parameters
and buffers by their dotted names (no copies, ``state_dict`` keys unchanged). Tensors the program
created itself (constants built inside ``forward``) and nested graphs of higher-order ops go under
the ``fxdebug`` namespace as non-persistent state. torch's guard module is replaced by a small
picklable shape check that says which input has the wrong shape. Inputs and outputs keep the
user's calling convention: the graph's pytree code generator flattens ``(args, kwargs)`` and
rebuilds the model's own output structure (tuples, dicts, ``ModelOutput``s, dataclasses).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import inspect
import re
import time
from collections import OrderedDict
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.fx import Graph, GraphModule
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from fxdebug.errors import MissingInputsError, ShapeMismatchError, TraceError
from fxdebug.capture.faithful import clean_graph_meta
from fxdebug.capture.faithful_export import export_shell, watched_export
from fxdebug.capture.faithful_reads import config_guards
from fxdebug.capture.torch_logs import summary, torch_errors_caught
from fxdebug.capture.staleness import StalenessGuard
from fxdebug.graph.inputs import untouched_state
from fxdebug.graph.meta import _clean_export_path, fx_meta
from fxdebug.graph.module_state import refuse_namespace_clash, refuse_uninitialized
from fxdebug.capture.trace_info import TraceInfo

__all__ = ["InputGuard", "capture_export"]

# An export graph flattens its inputs against the spec it was captured with. torch knows how to
# flatten a plain dict against a dict spec, but has no rule for OrderedDict, so a part captured on an
# FPN's OrderedDict rejected the same feature maps arriving as a dict (and the reverse needs the dict
# rule only). Keys are read in the captured order either way.
if OrderedDict not in fx_pytree.SUPPORTED_NODES:
    fx_pytree.register_pytree_flatten_spec(
        OrderedDict, lambda d, spec: [d[k] for k in spec.context],
        lambda d, spec: len(d) == spec.num_children)

_UNKNOWN_TYPE = re.compile(r"Found <class '([^']+)'> in output")


class InputGuard(nn.Module):
    """Checks the shapes of the flat inputs against those the graph was captured with.

    An exported graph is specialised to its example shapes (except dimensions marked dynamic).
    Running it on other shapes fails deep inside an aten op, or worse, silently reshapes; this
    check names the input and the dimension instead. Shapes are host metadata: no device sync.
    """

    def __init__(self, names: list[str], shapes: list[tuple[int | None, ...] | None],
                 symbols: list[tuple[str | None, ...] | None] | None = None,
                 ranges: dict[str, tuple[int | None, int | None]] | None = None) -> None:
        super().__init__()
        self.names = names
        self.shapes = shapes
        # torch.export's own guards on the free dimensions: the symbol of each dimension (two dimensions
        # with one symbol must be equal) and the range the model's Python allowed (``if x.shape[1] > 8:``)
        self.symbols = symbols
        self.ranges = ranges or {}

    def forward(self, *flat: Any) -> None:
        for name, want, value in zip(self.names, self.shapes, flat):
            if want is None or not isinstance(value, Tensor):
                continue
            got = tuple(value.shape)
            if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
                shown = tuple("*" if w is None else w for w in want)
                raise ShapeMismatchError(
                    f"input '{name}' has shape {got}, but the graph was captured by torch.export for shape "
                    f"{shown} (the model fixes the dimensions shown as numbers; '*' ones vary). Trace again with inputs "
                    "of this shape, or pass dynamic_batch=True to fxdebug.trace "
                    "/ instrument to let the batch dimension vary.",
                    node=name,
                )
        symbols = getattr(self, "symbols", None)  # absent on a guard pickled before ranges were kept
        if symbols:
            self._check_symbols(flat, symbols)
        return None

    def _check_symbols(self, flat: tuple[Any, ...], symbols: list[tuple[str | None, ...] | None]) -> None:
        seen: dict[str, tuple[int, str, int]] = {}
        for name, dims, value in zip(self.names, symbols, flat):
            if dims is None or not isinstance(value, Tensor):
                continue
            for d, (sym, size) in enumerate(zip(dims, value.shape)):
                if sym is None:
                    continue
                lo, hi = self.ranges.get(sym, (None, None))
                if (lo is not None and size < lo) or (hi is not None and size > hi):
                    allowed = (f"at most {hi}" if lo is None else f"at least {lo}" if hi is None else f"{lo}..{hi}")
                    raise ShapeMismatchError(
                        f"input '{name}' has size {size} in dimension {d}, but torch.export captured this graph for sizes "
                        f"{allowed} there"
                        ": the model's Python branches on this size (a guard such as "
                        "`if x.shape[1] > 8:`), so at this size it would take another path than the captured one. "
                        "Instrument again with inputs of this size, or use frontend='auto' (Dynamo captures again "
                        "when a guard fails).", node=name)
                first = seen.setdefault(sym, (size, name, d))
                if first[0] != size:
                    raise ShapeMismatchError(
                        f"input '{name}' has size {size} in dimension {d}, but '{first[1]}' has {first[0]} in dimension "
                        f"{first[2]}, and torch.export captured the graph for these two sizes being equal. Instrument "
                        "again with inputs like these, or use frontend='auto'.", node=name)


def _dynamic_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], every_dim: bool = False) -> Any:
    """Dimension 0 of every tensor input dynamic, or (``every_dim``) every dimension ``Dim.AUTO``.

    ``Dim.AUTO`` lets torch keep a dimension symbolic where the model allows it (batch, sequence,
    image size) and specialise it where the model fixes it (channels, a weight's width), without
    failing: the captured graph then takes every shape the model takes along the free dimensions.
    """
    batch = torch.export.Dim.DYNAMIC

    def spec(v: Any) -> Any:
        if isinstance(v, Tensor):
            if every_dim:
                return {d: torch.export.Dim.AUTO for d in range(v.dim())} or None
            return {0: batch} if v.dim() > 0 else None
        if isinstance(v, (list, tuple)):
            return type(v)(spec(x) for x in v)
        if isinstance(v, dict):
            return {k: spec(x) for k, x in v.items()}
        return None

    if every_dim:  # keyed by tensor, so registered containers (a KV Cache) get their tensors' specs too
        shapes = torch.export.ShapesCollection()
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, Tensor) and leaf.dim() > 0:
                shapes[leaf] = {d: torch.export.Dim.AUTO for d in range(leaf.dim())}
        return shapes.dynamic_shapes(model, args, kwargs)
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: spec(value) for name, value in bound.arguments.items()}


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic_batch: bool,
            notes: list[str]) -> Any:
    """Export with every input dimension free where the model allows it; else for the example shapes.

    ``dynamic_batch=True`` asks for exactly dim 0 dynamic (and fails if the model fixes it).
    """
    if dynamic_batch:
        return _export_with(model, args, kwargs, _dynamic_shapes(model, args, kwargs), notes)
    try:
        dynamic = _dynamic_shapes(model, args, kwargs, every_dim=True)
    except TypeError:  # the inputs do not bind to forward's signature; export says why below
        dynamic = None
    if dynamic is not None:
        try:
            return _export_with(model, args, kwargs, dynamic, notes)
        except Exception as exc:  # noqa: BLE001 - any failure of the dynamic capture: try the static one
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            notes.append(f"export: dynamic shapes could not be captured ({type(exc).__name__}: {first}); "
                         "the graph is specialised to the example shapes")
    return _export_with(model, args, kwargs, None, notes)


def _export_with(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: Any,
                 notes: list[str]) -> Any:
    """``torch.export.export`` (non-strict); dataclass outputs are registered with pytree once."""
    registered: set[str] = set()
    while True:
        try:
            with contextlib.redirect_stderr(io.StringIO()), _quiet("torch.fx.experimental.symbolic_shapes"):
                # on failure torch prints the partial graph and logs guard warnings; our error says it
                return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic)
        except Exception as exc:
            match = _UNKNOWN_TYPE.search(str(exc))
            found = match.group(1) if match else ""
            cls = _find_class(found) if match else None
            if cls is not None and found not in registered and _register_cache(cls):
                registered.add(found)
                notes.append(f"registered transformers' {cls.__qualname__} with torch's pytree: the KV cache goes "
                             "in and out of the graph as the model's own Cache object")
                continue
            if cls is None or not dataclasses.is_dataclass(cls) or found in registered:
                raise
            torch.export.register_dataclass(cls)
            registered.add(found)
            notes.append(f"registered the output dataclass {cls.__qualname__} with torch's pytree so "
                         "the graph can rebuild it")


def _register_cache(cls: type) -> bool:
    """Register a transformers ``DynamicCache`` with pytree (transformers' own export support)."""
    if not cls.__module__.startswith("transformers.") or cls.__name__ != "DynamicCache":
        return False
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except ImportError:
        return False
    register_dynamic_cache_export_support()
    return True


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _find_class(qualname: str) -> type | None:
    import sys

    module, _, name = qualname.rpartition(".")
    obj: Any = sys.modules.get(module)
    for part in name.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def _owner(model: nn.Module, target: str) -> tuple[nn.Module, str] | None:
    """``(module, attribute name)`` for a dotted ``target`` of ``model``; ``None`` if its module is not there."""
    owner, _, name = target.rpartition(".")
    try:
        return model.get_submodule(owner), name
    except AttributeError:
        return None


def _owned_tensor(model: nn.Module, target: str) -> bool:
    """True if ``target`` names a parameter or buffer registered in ``model``'s hierarchy."""
    found = _owner(model, target)
    return found is not None and (found[1] in found[0]._parameters or found[1] in found[0]._buffers)


def _model_attr(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _plain_tensor(model: nn.Module, target: str) -> bool:
    """True if ``target`` names a tensor held as a plain attribute (not a buffer) of a module of ``model``."""
    found = _owner(model, target)
    return found is not None and isinstance(found[0].__dict__.get(found[1]), Tensor)


def _safe(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _rehome_state(model: nn.Module, exported: GraphModule, graph: Graph, space: nn.Module,
                  links: list[tuple[nn.Module, str, nn.Module, str]]) -> list[str]:
    """Point get_attr nodes at the model's own tensors; move everything else under ``space``. A tensor held
    as a plain attribute is linked (``links``) to its module, for the staleness guard to follow per call."""
    params = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    params.update({id(b): n for n, b in model.named_buffers(remove_duplicate=False)})
    consts = nn.Module()
    subgraphs = nn.Module()
    moved = []
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        if _owned_tensor(model, target):
            continue
        value = _model_attr(exported, target)
        own_name = params.get(id(value)) if isinstance(value, Tensor) else None
        if own_name is not None:  # the same tensor, reached under another (tied) name
            node.target = own_name
            continue
        safe = _safe(target)
        if isinstance(value, nn.Module):
            subgraphs.add_module(safe, value)
            node.target = f"fxdebug.subgraphs.{safe}"
        else:
            mine = _model_attr(model, target)
            tensor = mine if isinstance(mine, Tensor) else value
            consts.register_buffer(safe, tensor, persistent=False)
            node.target = f"fxdebug.constants.{safe}"
            if _plain_tensor(model, target):  # the model's own tensor attribute (self.mask): followed per call
                owner, _, name = target.rpartition(".")
                links.append((model.get_submodule(owner), name, consts, safe))
        moved.append(target)
    if len(consts._buffers):
        space.add_module("constants", consts)
    if len(subgraphs._modules):
        space.add_module("subgraphs", subgraphs)
    return moved


def _range_constraints(program: Any) -> dict[str, tuple[int | None, int | None]]:
    """``{symbol: (low, high)}`` for each free dimension torch.export bounded beyond its defaults."""
    out: dict[str, tuple[int | None, int | None]] = {}
    for sym, vr in (getattr(program, "range_constraints", None) or {}).items():
        lo, hi = _finite(vr.lower), _finite(vr.upper)
        lo = lo if lo is not None and lo > 2 else None  # 2: torch's own assumption for every free size
        if lo is not None or hi is not None:
            out[str(sym)] = (lo, hi)
    return out


def _finite(value: Any) -> int | None:
    if "oo" in str(value):  # sympy's oo / torch's int_oo: no bound
        return None
    try:
        return int(value)
    except Exception:  # noqa: BLE001 - any other symbolic bound: not checked
        return None


def _symbol(d: Any) -> str | None:
    expr = getattr(getattr(d, "node", None), "expr", None)
    return str(expr) if expr is not None and getattr(expr, "is_Symbol", False) else None


def _replace_guards(graph: Graph, space: nn.Module, ranges: dict[str, tuple[int | None, int | None]] | None = None) -> None:
    """Swap torch's guard call (not picklable) for an ``InputGuard`` over the flat inputs."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn":
            graph.erase_node(node)
    names: list[str] = []
    shapes: list[tuple[int | None, ...] | None] = []
    symbols: list[tuple[str | None, ...] | None] = []
    for ph in placeholders:
        val = ph.meta.get("val")
        names.append(ph.name)
        if isinstance(val, Tensor):
            shapes.append(tuple(_static_size(d) for d in val.shape))
            symbols.append(tuple(_symbol(d) for d in val.shape))
        else:
            shapes.append(None)
            symbols.append(None)
    if not any(s is not None for s in shapes):
        return
    named = [s for dims in symbols if dims for s in dims if s is not None]
    checked = ranges or len(named) != len(set(named))  # a range, or one symbol shared by two dimensions
    space.add_module("input_guard", InputGuard(names, shapes, symbols if checked else None, ranges))
    anchor = placeholders[-1]
    with graph.inserting_after(anchor):
        guard = graph.create_node("call_module", "fxdebug.input_guard", tuple(placeholders), {})
    meta = fx_meta(guard)
    meta["role"], meta["module"], meta["module_type"], meta["keep_unused"] = "guard", "", "InputGuard", True


def _static_size(d: Any) -> int | None:
    """A dimension's fixed size, or ``None`` if it stayed symbolic (a SymInt ``Dim.AUTO`` pinned is fixed)."""
    if isinstance(d, int):
        return d
    expr = getattr(getattr(d, "node", None), "expr", None)
    return int(expr) if expr is not None and getattr(expr, "is_number", False) else None


def _dynamic_dims(graph: Graph) -> list[str]:
    """``input_ids[0, 1]`` for every placeholder whose captured shape has symbolic dimensions."""
    out = []
    for ph in graph.nodes:
        val = ph.meta.get("val") if ph.op == "placeholder" else None
        if isinstance(val, Tensor):
            dims = [str(i) for i, d in enumerate(val.shape) if _static_size(d) is None]
            if dims:
                out.append(f"{ph.name}[{', '.join(dims)}]")
    return out


def annotate_export(graph: Graph, model: nn.Module) -> None:
    """Module path and type of every node, from ``nn_module_stack`` (get_attr: the owner)."""
    modules = dict(model.named_modules())
    for node in graph.nodes:
        meta = fx_meta(node)
        if "module" in meta:
            continue
        if node.op == "get_attr":
            path = str(node.target).rpartition(".")[0]
            path = "" if path.startswith("fxdebug") else path
        else:
            stack = node.meta.get("nn_module_stack") or {}
            path = _clean_export_path(list(stack.values())[-1][0]) if stack else ""
        meta["module"] = path
        mod = modules.get(path)
        if mod is not None:
            meta["module_type"] = type(mod).__name__


def capture_export(
    model: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | None,
    *,
    dynamic_batch: bool = False,
) -> tuple[Graph, TraceInfo, nn.Module]:
    """Export ``model`` on ``inputs``; returns the graph, how it was captured, and fxdebug's modules.

    The graph's ``get_attr`` targets resolve on ``model`` (its own parameters and buffers) or
    under the returned namespace module, to be registered as the ``fxdebug`` attribute.
    """
    if inputs is None:
        raise MissingInputsError(
            f"the export frontend runs {type(model).__name__} on example inputs, and none were given: "
            "pass example_inputs=(x,) (or a dict of keyword inputs) to fxdebug.trace / instrument.",
            op=type(model).__name__,
        )
    start = time.perf_counter()
    args, kwargs = inputs
    info = TraceInfo(frontend="export")
    refuse_uninitialized(model, "export")
    refuse_namespace_clash(model, "export")
    shell = export_shell(model)  # the root's own hooks run at call time, not inside the graph
    try:
        with untouched_state(model), watched_export(shell) as watch, torch_errors_caught() as logged:
            program = _export(shell, args, kwargs, dynamic_batch, info.notes)
    except TraceError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TraceError(
            f"torch.export could not capture {type(model).__name__}: {type(exc).__name__}: {first}. "
            "Data-dependent output sizes and Python that reads tensor values stop it; "
            "frontend='subtrees' keeps the root eager and instruments the submodules that can be captured.",
            op=type(model).__name__,
        ) from exc
    note = summary(logged)  # torch's own tracebacks, kept off the terminal
    if note:
        info.notes.append(note)
    if watch.problems:  # what export would get wrong (autograd.Functions, Python state): see faithful_export
        raise watch.problems[0]
    info.guards = watch.guards + config_guards(list(model.named_modules()))  # a config object's values too
    exported = program.module()
    graph = exported.graph
    space = nn.Module()
    links: list[tuple[nn.Module, str, nn.Module, str]] = []
    moved = _rehome_state(model, exported, graph, space, links)
    watch.check_buffer_updates(graph)  # every buffer the forward reassigned is updated by the graph
    clean_graph_meta(graph)  # module stacks name the user's classes, not fxdebug's read-recording ones
    _replace_guards(graph, space, _range_constraints(program))
    annotate_export(graph, model)
    if moved:
        info.notes.append(f"export: {len(moved)} tensors created by forward are kept as constants under 'fxdebug'")
    if dynamic_batch:
        info.notes.append("export: the batch dimension (dim 0 of every tensor input) is dynamic")
    free = _dynamic_dims(graph)
    if free:
        info.notes.append(f"export: dynamic dimensions (any size the model accepts): {', '.join(free)}")
    info.staleness = StalenessGuard(model, "export", [m for p, m in model.named_modules() if p])  # every module is inlined
    paths = {id(m): p for p, m in model.named_modules()}
    paths[id(shell)] = ""
    info.staleness.fast_paths = [(paths[id(m)], model if m is shell else m) for m in watch.fast_paths if id(m) in paths]
    info.staleness.tensor_attrs = links
    info.seconds = time.perf_counter() - start
    return graph, info, space

