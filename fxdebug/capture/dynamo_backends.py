"""What runs a live capture's instrumented graphs: eagerly (the debugging default) or a compiler (Inductor).

Dynamo hands each graph to fxdebug's backend (``capture.dynamo.backend``), which instruments it for
the live module now calling and, by default, runs it eagerly. With a compiler, the instrumented
graph is compiled by it instead: ``instrument(..., backend="inductor")``, or the user's own backend
when an outer ``torch.compile(dbg, mode=..., options=...)`` runs the live module.

* ``check_backend`` — the ``backend=`` value of ``instrument()``: ``"eager"`` or ``"inductor"``.
* ``composite`` — the Dynamo backend for a compiler: fxdebug's backend, whose graphs carry that
  compiler. Dynamo keeps its cache per code object and tells backends apart by identity, so there
  is one composite per compiler (``==``: two ``torch.compile(dbg)`` with the same mode and options
  share one), not one per call.
* ``outer_compiler`` — the backend of the ``torch.compile`` whose frame is calling now, read from
  the eval-frame callback the caller switched off (``torch._C._dynamo.eval_frame.set_eval_frame``):
  the live module's call is a skipped frame for an outer compile (it is run, not traced, with the
  outer callback still set), so its inner capture can compile with the outer backend.
* ``compiled`` — an instrumented graph's code compiled by a compiler: the graph handed to it directly,
  its state table an input (``direct_graph``), or ``torch.compile`` of it with that backend. Either
  way the observation ops have fake implementations and the state table's in-place update is
  functionalised and written back.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from fxdebug.capture.dynamo import backend
from fxdebug.graph.meta import fx_meta
from fxdebug.errors import UsageError

__all__ = ["BACKENDS", "check_backend", "compiled", "compiler_for", "compiler_label", "composite", "outer_compiler"]

BACKENDS = ("eager", "inductor")
_LOCK = threading.Lock()
_COMPOSITES: list[tuple[Any, "Composite"]] = []  # (compiler, its composite backend), one per distinct compiler


def check_backend(name: Any) -> str:
    """``name`` if it is a backend ``instrument()`` knows, else a ``UsageError`` naming the choices."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise UsageError(f"backend={name!r} is not one of {', '.join(map(repr, BACKENDS))}: 'eager' runs the instrumented "
                         "graphs as captured (the debugging default), 'inductor' compiles them with TorchInductor; an "
                         "outer torch.compile(dbg, mode=..., options=...) compiles them with its own backend.")
    return name


def compiler_for(name: str) -> Any:
    """The compiler for ``instrument(backend=name)``: ``None`` for eager, else Dynamo's registered backend."""
    return None if name == "eager" else torch._dynamo.lookup_backend(name)


class Composite:
    """fxdebug's backend with ``compiler`` for the instrumented graphs (one object per compiler)."""

    def __init__(self, compiler: Any) -> None:
        self.compiler = compiler

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        run = backend(gm, example_inputs)
        run.fxdebug_graph.compiler = self.compiler  # type: ignore[attr-defined]
        return run


def composite(compiler: Any) -> Callable[..., Any]:
    """The Dynamo backend for ``compiler`` (``None``: fxdebug's own, eager). Asked at every call under an outer
    ``torch.compile``: a compiler met before is found by identity, without the lock or an ``==`` per composite."""
    if compiler is None:
        return backend
    hit = _BY_ID.get(id(compiler))
    if hit is not None and hit[0] is compiler:
        return hit[1]
    with _LOCK:
        for have, found in _COMPOSITES:
            if have is compiler or _same(have, compiler):
                _BY_ID[id(compiler)] = (compiler, found)  # (the pair holds the compiler: its id stays its own)
                return found
        made = Composite(compiler)
        _COMPOSITES.append((compiler, made))
        _BY_ID[id(compiler)] = (compiler, made)
        return made


_BY_ID: dict[int, tuple[Any, "Composite"]] = {}


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def _innermost(callback: Any) -> Any:
    while hasattr(callback, "_torchdynamo_orig_backend"):
        callback = callback._torchdynamo_orig_backend
    return callback


def outer_compiler(callback: Any) -> Any:
    """The user's backend of the eval-frame ``callback`` that was active (``None``: no outer compile, a
    run-only or disabled frame, fxdebug's own capture, or an eager backend). Read at every call of a live module
    under an outer ``torch.compile``: the last callback's answer is kept."""
    global _LAST
    if callback is None or callback is False:
        return None
    last = _LAST
    if last[0] is callback:
        return last[1]
    found = _outer_compiler(callback)
    _LAST = (callback, found)
    return found


_LAST: tuple[Any, Any] = (None, None)  # (the last callback outer_compiler was asked about, its answer)


def _outer_compiler(callback: Any) -> Any:
    found = _innermost(callback)
    if found is backend or isinstance(found, Composite):  # a live module called from fxdebug's own capture
        return None
    if getattr(found, "__name__", None) == "eager" or getattr(found, "compiler_name", None) == "eager":
        return None  # torch.compile(dbg, backend="eager"): the graphs run as captured, as without a compile
    return found


def compiler_label(compiler: Any) -> str:
    """How the notes name a compiler: ``inductor``, with the options an outer ``torch.compile`` gave it."""
    name = getattr(compiler, "compiler_name", None) or getattr(compiler, "__name__", None) or type(compiler).__name__
    config = getattr(compiler, "config", None)
    if isinstance(config, dict) and config:
        return f"{name} ({', '.join(f'{k}={v!r}' for k, v in sorted(config.items()))})"
    return str(name)


def compiled(fn: Callable[..., Any], compiler: Any) -> Callable[..., Any]:
    """``fn`` (an instrumented graph's forward) compiled by ``compiler`` at its first call.

    Where the graph allows it (``direct_graph``), the compiler gets the graph itself, as Dynamo hands a
    backend one, instead of a second Dynamo frame around it: that frame's guards re-checked on every call
    what the model's own frame, just above, had checked (each parameter's shape, dtype, device, grad mode),
    ~0.1 ms a call on a 2-layer GPT-2. Otherwise (a Python observer, a clock whose device ticks Python probes
    read, dynamic shapes), ``torch.compile`` of ``fn`` as before."""
    whole = torch.compile(fn, backend=compiler, dynamic=getattr(compiler, "dynamic", None))
    gm = getattr(fn, "__self__", None)
    if not isinstance(gm, torch.fx.GraphModule) or getattr(compiler, "dynamic", None):
        return whole
    made = direct_graph(gm)
    if made is None:
        return whole
    graph_module, clock = made
    ready: list[Any] = []

    def run(*args: Any) -> Any:
        table = clock.table
        if table is None or clock._ticks or not ready and not _static(args, table):
            return whole(*args)  # no table yet (the clock makes it), Python probes' ticks, or sizes as inputs
        if not ready:
            ready.append(compiler(graph_module, [*args, table]))
        return ready[0](*args, table)

    return run


def direct_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, Any] | None:
    """``gm`` with its clock as the state table, an extra last input, ticked by ``fxdebug::tick`` (a graph a
    compiler takes as it is: no module call inside), and the clock; ``None`` when ``gm`` calls another module
    (a Python observer) or the tick op is not built."""
    try:
        tick = torch.ops.fxdebug.tick.default  # the C++ build's (runtime.kernel loaded it with the graph's ops)
    except (AttributeError, RuntimeError):
        return None
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    if len(calls) != 1 or fx_meta(calls[0]).get("role") != "clock":
        return None
    clock = gm.get_submodule(str(calls[0].target))
    if not all(hasattr(clock, name) for name in ("table", "_ticks")):  # runtime.clock.Clock (not imported: a sibling floor)
        return None
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = graph.node_copy(n, lambda a: env[a])
    table = graph.placeholder("fxdebug_state_table")
    for n in nodes:
        if n.op == "placeholder":
            continue
        if n is calls[0]:
            graph.call_function(tick, (table,))
            env[n] = table
            continue
        env[n] = graph.node_copy(n, lambda a: env[a])
    return torch.fx.GraphModule(gm, graph), clock


def _static(args: tuple[Any, ...], table: Any) -> bool:
    """Every argument a tensor on the table's device: no size comes in as an input (Dynamo's dynamic shapes)."""
    return all(isinstance(a, torch.Tensor) and a.device == table.device for a in args)
