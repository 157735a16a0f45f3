"""Lowering: observers whose probes all read fused statistics become direct op calls.

Passes attach probes to one ``Observer`` per node (``PassContext.observe``). Once every pass
ran, ``lower_observers`` gives each observer with fused probes its rows in the graph's state
table and, where all its probes are fused, replaces the ``call_module`` to it with

    observe = torch.ops.fxdebug.observe.default(node, clock, row, chan_off, channels, channel_dim)

— a ``call_function`` straight into the dispatcher (the C++ kernel on CPU), no Python per node
and call. The clock node (the graph's first instrumentation node) returns the state table.
Watching gradients adds a ``fxdebug::observe_grad`` tap (kernel.py), which registers one C++ hook whose body is the same
op on the gradient. The observer module stays registered (it holds the probes and builds the
report rows); ``meta["fxdebug"]["observer"]`` names it on the lowered nodes. ``unlower`` undoes
it for a node (re-instrumenting attaches more probes to the same observer).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from fxdebug.graph.edits import NAMESPACE as _NAMESPACE
from fxdebug.graph.meta import KEY as _KEY, fx_meta
from fxdebug.runtime.observer import Clock, GradHookable, Observer
from fxdebug.runtime.kernel import load, observe_grad_many_op, observe_grad_op, observe_many_op, observe_op

__all__ = ["GradTap", "batch_observations", "find_lowered", "is_lowered", "lower_observers", "observe_grad",
           "observer_of", "observers_in", "unbatch", "unlower"]


class GradTap:
    """The hook ``observe_grad`` registers: the fused op on the gradient, nothing else."""

    __slots__ = ("table", "args")

    def __init__(self, table: Tensor, args: tuple[int, int, int, int]) -> None:
        self.table, self.args = table, args

    def __call__(self, grad: Tensor) -> None:
        torch.ops.fxdebug.observe.default(grad, self.table, *self.args)
        return None


@torch.fx.node.has_side_effect
def observe_grad(x: Any, table: Tensor | None, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    """Observe the gradient flowing into ``x`` when the backward runs (no-op without autograd).

    The hook is the op itself with its state bound by keyword (``functools.partial``), so the
    backward calls straight into the dispatcher with no Python frame of ours (the op returns
    ``None``, which leaves the gradient as it is)."""
    if isinstance(x, Tensor) and table is not None and x.requires_grad and torch.is_grad_enabled():
        hooked: GradHookable = x
        if torch.compiler.is_compiling():
            hooked.register_hook(GradTap(table, (row, chan_off, channels, channel_dim)))
        else:
            hooked.register_hook(functools.partial(torch.ops.fxdebug.observe.default, table=table, row=row, chan_off=chan_off,
                                                   channels=channels, channel_dim=channel_dim))


def is_lowered(node: Node) -> bool:
    return node.op == "call_function" and ("observer" in fx_meta(node) or "batch" in fx_meta(node))


def observer_of(gm: GraphModule, node: Node) -> Observer | None:
    """The ``Observer`` behind an instrumentation node, lowered or not."""
    meta = fx_meta(node)
    if meta.get("role") != "instrumentation" or "observes" not in meta or "batch" in meta:
        return None
    target = meta.get("observer") if node.op == "call_function" else (node.target if node.op == "call_module" else None)
    if target is None:
        return None
    try:
        mod = gm.get_submodule(str(target))
    except AttributeError:
        return None
    return mod if isinstance(mod, Observer) else None


def _clock_node(gm: GraphModule) -> Node | None:
    return next((n for n in gm.graph.nodes if n.op == "call_module" and fx_meta(n).get("role") == "clock"), None)


def _channels(node: Node, cdim: int | None) -> int:
    shape = fx_meta(node).get("shape")
    if cdim is None or not shape or len(shape) < 2:
        return 0
    c = shape[cdim % len(shape)]
    return int(c) if isinstance(c, int) else 0


def lower_observers(gm: GraphModule) -> int:
    """Lower every fully fused observer of ``gm``; returns how many nodes now call the op.

    One sweep over the graph: each fully fused observer's ``call_module`` node becomes its op call
    in place, and runs of small forward observations become one ``observe_many`` call each (the
    last observer node of the run turns into the batched call, the others are erased), with the
    rules of ``batch_observations``. No node is created for a forward observation, and none is
    rewritten twice: on a 10k-node graph this was most of ``instrument()``'s lowering time.
    """
    clock_node = _clock_node(gm)
    if clock_node is None:
        return 0
    clock = gm.get_submodule(str(clock_node.target))
    if not isinstance(clock, Clock):
        return 0
    graph = gm.graph
    space = gm._modules.get(_NAMESPACE)
    children = space._modules if space is not None else {}
    lowered = 0
    device: str | None = None
    pending: list[tuple[Node, Node, tuple[int, int, int, int], str, Node | None]] = []  # (observer node, x, rows, target, tap)
    barriers: dict[str, bool] = {}  # call_module target -> is a barrier (one lookup per module)
    ops: tuple[Any, Any] | None = None
    held = [0]  # elements the pending run keeps alive
    if any(is_lowered(n) for n in graph.nodes if n.op == "call_function"):  # lowered before: the ops exist
        load()
        ops = (observe_op(), observe_many_op())

    def flush() -> None:
        assert ops is not None
        if len(pending) == 1:
            node, x, rows, target, _ = pending[0]
            _to_op_call(node, ops[0], x, clock_node, rows, target)
        elif pending:
            last = pending[-1][0]
            members = [(fx_meta(p[0])["observes"], p[3]) for p in pending]
            added_by = fx_meta(pending[0][0]).get("added_by")
            xs = [p[1] for p in pending]
            args = [a for p in pending for a in p[2]]
            for p in pending[:-1]:
                _erase(graph, p[0])
            last.op, last.target = "call_function", ops[1]
            last.args, last.kwargs = (xs, clock_node, args), {}
            last.meta = {_KEY: {"role": "instrumentation", "observes": members[0][0], "batch": members,
                                "added_by": added_by}}
            taps = [p[4] for p in pending if p[4] is not None]
            if len(taps) >= 2:
                _batch_taps(graph, taps, clock_node)
        pending.clear()
        held[0] = 0

    # not a copy of the node list: an observer node erased behind the sweep is freed at once
    for node in graph.nodes:
        obs = None
        if node.op == "call_module":
            meta = node.meta.get(_KEY)
            if meta is not None and meta.get("role") == "instrumentation":
                target = str(node.target)
                name = target[len(_NAMESPACE) + 1:] if target.startswith(_NAMESPACE + ".") else ""
                found = children.get(name) if name and "." not in name else None
                obs = found if isinstance(found, Observer) else observer_of(gm, node)
        elif node.op == "call_function" and ops is not None and node.target is ops[0] and isinstance(node.args[0], Node) \
                and fx_meta(node).get("phase") == "forward" and "observer" in fx_meta(node) and _small(node.args[0]):
            # lowered before (instrumenting an instrumented module): joins the run as it is
            numel = _numel(node.args[0]) or 0
            if pending and held[0] + numel > BATCH_TOTAL:
                flush()
            pending.append((node, node.args[0], node.args[2:6], fx_meta(node)["observer"], None))
            held[0] += numel
            if len(pending) == BATCH_MAX:
                flush()
            continue
        fused = obs.fused_probes if obs is not None else None  # once per observer (each read builds a list)
        if obs is None or not fused or not node.args or not isinstance(node.args[0], Node):
            if pending and _barrier_cached(node, gm, barriers):
                flush()
            continue
        x = node.args[0]
        obs.assign_rows(_channels(x, next((p.channel_dim for p in fused if p.channel_dim is not None), None)))
        if device is None:
            dev = fx_meta(x).get("device")
            device = str(dev) if dev is not None else None
        # Observer.fully_fused, with the fused probes in hand
        if len(fused) != len(obs.probes) or any(p.wants_inputs for p in fused):
            # Python probes too: the observer module calls the op itself (a barrier)
            if pending:
                flush()
            continue
        if ops is None:
            load()
            ops = (observe_op(), observe_many_op())
        target = str(node.target)
        rows = obs.fused_rows["forward"]
        tap = None
        if "grad" in obs.fused_rows:  # a gradient tap right after the observer's node (batched with the run's)
            with graph.inserting_after(node):
                tap = graph.call_function(observe_grad_op(), (x, clock_node, *obs.fused_rows["grad"]))
            tap.meta.update({k: v for k, v in node.meta.items() if k != _KEY})
            fx_meta(tap).update(fx_meta(node), observer=target, phase="grad")
        size = _numel(x)
        if size is not None:
            if pending and held[0] + size > BATCH_TOTAL:
                flush()
            pending.append((node, x, rows, target, tap))
            held[0] += size
            if len(pending) == BATCH_MAX:
                flush()
        else:
            _to_op_call(node, ops[0], x, clock_node, rows, target)
        lowered += 1
    if pending:
        flush()
    if clock.rows:
        anchors = [n for n in graph.nodes if n.op == "placeholder"]
        clock_node.args = tuple(anchors)
        clock.materialize(device if device is not None else "cpu")
    gm.recompile()
    return lowered


def _to_op_call(node: Node, op: Any, x: Node, clock_node: Node, rows: tuple[int, int, int, int], target: str) -> None:
    """The observer's node becomes the forward op call in place (no erase/insert)."""
    node.op, node.target = "call_function", op
    node.args, node.kwargs = (x, clock_node, *rows), {}
    meta = fx_meta(node)
    meta["observer"], meta["phase"] = target, "forward"


def _batch_taps(graph: torch.fx.Graph, taps: list[Node], clock_node: Node) -> None:
    """The gradient taps of one run of small observations as one ``observe_grad_many`` call where
    the last tap was (after the run's forward call, before the barrier that ended the run): the
    hooks are registered before anything can write into the tensors, as each tap did."""
    members = [(fx_meta(t)["observes"], fx_meta(t)["observer"]) for t in taps]
    with graph.inserting_after(taps[-1]):
        many = graph.call_function(observe_grad_many_op(), ([t.args[0] for t in taps], clock_node,
                                                            [a for t in taps for a in t.args[2:6]]))
    fx_meta(many).update(role="instrumentation", observes=members[0][0], batch=members, phase="grad",
                         added_by=fx_meta(taps[0]).get("added_by"))
    for t in taps:
        _erase(graph, t)


def _erase(graph: torch.fx.Graph, node: Node) -> None:
    """``graph.erase_node``, and the node dropped from FX's name table: ``Graph.erase_node`` leaves it
    there, so an erased observer node (its metadata, its probe list) lived as long as the graph
    (~0.7 KB per observed node; the name itself stays taken)."""
    graph.erase_node(node)
    names = getattr(getattr(graph, "_graph_namespace", None), "_obj_to_name", None)
    if isinstance(names, dict):
        names.pop(node, None)


def _barrier_cached(node: Node, gm: GraphModule, cache: dict[str, bool]) -> bool:
    """``_barrier``; a called module found through the ``_modules`` dicts (``get_submodule`` costs
    ~10 µs a call through the instrumented module's attribute fallbacks), its answer kept per target."""
    if node.op != "call_module":
        return _barrier(node, gm)
    key = str(node.target)
    found = cache.get(key)
    if found is None:
        mod: Any = gm
        for part in key.split("."):
            mod = mod._modules.get(part) if isinstance(mod, torch.nn.Module) else None
        if mod is None:
            found = _barrier(node, gm)
        else:
            found = isinstance(mod, Observer) or not type(mod).__module__.startswith("torch.nn") \
                or bool(getattr(mod, "inplace", False))  # what graph.classify.is_inplace asks of a module
        cache[key] = found
    return found


# What a batch may keep alive: each extern call costs ~1.5 µs of dispatch (and, compiled, a call out of
# Inductor's code), so debugging-size tensors wait for one call per run; the lifetime this adds is bounded
# by element counts (measured: docs/performance.md, "Batched observations").
BATCH_NUMEL = 65536  # tensors up to this size (256 KiB in float32) may wait for a batched call
BATCH_TOTAL = 262144  # the elements a batch keeps alive at most (1 MiB in float32)
BATCH_MAX = 16  # and at most this many tensors per call


def _numel(node: Node) -> int | None:
    """Elements of ``node``'s tensor when its shape is static and it may wait for a batch, else ``None``."""
    shape = fx_meta(node).get("shape")
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d
    return n if n <= BATCH_NUMEL else None


def _small(node: Node) -> bool:
    return _numel(node) is not None



def _barrier(node: Node, gm: GraphModule) -> bool:
    """A node before which pending observations must be made: it may write into a tensor
    (in-place op, a module of unknown behaviour), may raise (a Python observer), or ends the graph."""
    from fxdebug.graph.classify import is_inplace

    if node.op == "output":
        return True
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return isinstance(mod, Observer) or not type(mod).__module__.startswith("torch.nn") or is_inplace(node, gm)
    if node.op in ("call_function", "call_method"):
        return not is_lowered(node) and is_inplace(node, gm)
    return False


def batch_observations(gm: GraphModule, clock_node: Node) -> int:
    """Merge runs of forward observations of small tensors into one ``observe_many`` call each.

    An observation waits at most until the next barrier (an in-place op or a module that might
    write into what is pending, a Python observer that might raise, the output) and at most
    ``BATCH_MAX`` observations of ``BATCH_TOTAL`` elements, so values are read before anything can change
    them and little is kept alive. Returns the number of batched calls made."""
    graph, made = gm.graph, 0
    pending: list[Node] = []
    held = [0]

    def flush(before: Node) -> None:
        nonlocal made
        if len(pending) >= 2:
            args: list[Any] = []
            for p in pending:
                args.extend(p.args[2:])
            with graph.inserting_before(before):
                batch = graph.call_function(observe_many_op(), ([p.args[0] for p in pending], clock_node, args))
            members = [(fx_meta(p)["observes"], fx_meta(p)["observer"]) for p in pending]
            fx_meta(batch).update(role="instrumentation", observes=members[0][0], batch=members,
                                  added_by=fx_meta(pending[0]).get("added_by"))
            for p in pending:
                graph.erase_node(p)
            made += 1
        pending.clear()
        held[0] = 0

    for node in list(graph.nodes):
        if is_lowered(node) and fx_meta(node).get("phase") == "forward" and node.target is observe_op() \
                and isinstance(node.args[0], Node) and _small(node.args[0]):
            numel = _numel(node.args[0]) or 0
            if pending and held[0] + numel > BATCH_TOTAL:
                flush(node)
            pending.append(node)
            held[0] += numel
            if len(pending) == BATCH_MAX:
                flush(node.next)
        elif pending and _barrier(node, gm):
            flush(node)
    return made


def unbatch(gm: GraphModule, batch: Node) -> None:
    """Split a batched call (forward observations or gradient taps) back into one lowered op call per observed node."""
    members = fx_meta(batch)["batch"]
    xs, clock_node, args = batch.args
    phase = "grad" if fx_meta(batch).get("phase") == "grad" else "forward"
    op = observe_grad_op() if phase == "grad" else observe_op()
    for i, ((observed, target), x) in enumerate(zip(members, xs)):  # type: ignore[arg-type]
        with gm.graph.inserting_before(batch):
            new = gm.graph.call_function(op, (x, clock_node, *args[4 * i: 4 * i + 4]))  # type: ignore[index, misc]
        fx_meta(new).update(role="instrumentation", observes=observed, observer=target, phase=phase)
    gm.graph.erase_node(batch)


def find_lowered(node: Node) -> Node | None:
    """The lowered op call observing ``node`` (splitting a batch that holds it), or ``None``."""
    if not any(u.op == "call_function" for u in node.users):  # lowered calls and batches are call_function
        return None
    gm = node.graph.owning_module
    for u in list(node.users):
        meta = fx_meta(u)
        if "batch" in meta and any(o == node.name for o, _ in meta["batch"]) and gm is not None:
            unbatch(gm, u)  # the forward batch and the gradient taps' batch, where both hold it
    return next((u for u in node.users if fx_meta(u).get("observes") == node.name and is_lowered(u)), None)


def observers_in(gm: GraphModule) -> dict[str, Observer]:
    """``{observed node name: Observer}`` over every form an observer takes in ``gm``'s graph:
    a ``call_module``, a lowered op call, or a member of a batched call."""
    out: dict[str, Observer] = {}
    for n in gm.graph.nodes:
        meta = fx_meta(n)
        if meta.get("role") != "instrumentation":
            continue
        for observed, target in meta.get("batch", ()):
            mod = _module(gm, target)
            if mod is not None:
                out[observed] = mod
        obs = observer_of(gm, n)
        if obs is not None and "batch" not in meta:
            out[meta["observes"]] = obs
    return out


def _module(gm: GraphModule, target: str) -> Observer | None:
    try:
        mod = gm.get_submodule(target)
    except AttributeError:
        return None
    return mod if isinstance(mod, Observer) else None


def unlower(gm: GraphModule, node: Node) -> Node:
    """Turn the lowered nodes of ``node``'s observer back into one ``call_module`` (returned)."""
    meta = dict(fx_meta(node))
    target = meta.pop("observer")
    meta.pop("phase", None)
    x = node.args[0]
    siblings = [u for u in x.users if is_lowered(u) and fx_meta(u).get("observer") == target]  # type: ignore[union-attr]
    with gm.graph.inserting_before(siblings[0]):
        new = gm.graph.call_module(target, (x,))
    new.meta.update({k: v for k, v in node.meta.items() if k != "fxdebug"})
    fx_meta(new).update(meta)
    for s in siblings:
        gm.graph.erase_node(s)
    return new
