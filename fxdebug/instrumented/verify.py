"""``fxdebug.verify``: does the instrumented module compute what the model computes?

Observe-only instrumentation promises bitwise transparency: the same outputs, the same gradient
for every parameter, the same buffers after a call, in training and in eval mode. ``verify``
checks exactly that on the user's inputs, one forward and backward of each, from the same RNG
seed, and puts everything back afterwards (the RNG streams, every buffer, with its identity,
every ``.grad``, plain Python attributes, the training flags), so it can be called on a model in
the middle of training.

When the two runs part, it says where: for the forward, the first module (in graph order) whose
output differs between the graph (run node by node) and the model (read with forward hooks);
for the backward, the last module whose output gradient differs, i.e. the node whose backward
first computed something else, named with the node consuming it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.fx import Interpreter
from torch.utils import _pytree as pytree

from fxdebug.errors import ArgumentTypeError, MissingInputsError, VerificationError
from fxdebug.graph.inputs import bind_inputs, clone_inputs, normalize_inputs
from fxdebug.instrumented.face import model_of
from fxdebug.instrumented.live_state import live_state
from fxdebug.instrumented.base import Instrumented
from fxdebug.graph.meta import fx_meta
from fxdebug.graph.module_state import restore_containers, restore_random_state, saved_containers, saved_random_state
from fxdebug.authoring.context import NAMESPACE
from fxdebug.instrumented.snapshot_recipe import recipe
from fxdebug.instrumented.verify_values import snapshot

__all__ = ["Verification", "verify"]

_PLAIN = (bool, int, float, str, type(None))


@dataclass
class Verification:
    """What ``verify`` found. ``ok`` is true when every compared value was equal."""

    ok: bool
    mismatches: list[str] = field(default_factory=list)
    first_node: str | None = None
    where: str | None = None
    modes: tuple[str, ...] = ()
    compared: int = 0

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"verify: {self.compared} values equal in {', '.join(self.modes)} mode"
        where = f"; {self.where}" if self.where else ""
        return f"verify: {len(self.mismatches)} mismatches ({'; '.join(self.mismatches[:3])}){where}"

    def raise_if_failed(self) -> "Verification":
        if not self.ok:
            raise VerificationError(
                f"the instrumented module computes differently from the model: {'; '.join(self.mismatches[:3])}"
                + (f". They part at node '{self.first_node}' ({self.where})" if self.first_node else "")
                + ". Report this with the model; meanwhile keep that module eager with leaf_modules=[...].",
                node=self.first_node, result=self)
        return self


# -- saving and restoring everything a run touches -------------------------------------------------
@contextlib.contextmanager
def _restored(*roots: nn.Module) -> Iterator[None]:
    modules = list({id(m): m for r in roots for m in r.modules()}.values())
    flags = [(m, m.training) for m in modules]
    buffers: list[tuple[nn.Module, dict[str, Any], dict[str, Tensor]]] = [
        (m, dict(m._buffers), {k: v.detach().clone() for k, v in m._buffers.items() if v is not None})
        for m in modules]
    grads: list[tuple[Any, Any, Any]] = [(p, p.grad, None if p.grad is None else p.grad.detach().clone())
             for p in {id(p): p for r in roots for p in r.parameters()}.values()]
    plain: list[tuple[nn.Module, dict[str, Any]]] = [
        (m, {k: v for k, v in vars(m).items() if isinstance(v, _PLAIN) and k != "training"}) for m in modules]
    devices = sorted({p.device.index or 0 for p, _, _ in grads if p.device.type == "cuda"})
    streams = [state for r in roots for state in saved_random_state(r)]  # Python, numpy, model-held generators
    containers = [c for r in roots for c in saved_containers(r)]
    with torch.random.fork_rng(devices=devices, enabled=True):
        try:
            yield
        finally:
            restore_random_state(streams)
            restore_containers(containers)
            with torch.no_grad():
                for m, entries, values in buffers:
                    m._buffers.clear()
                    m._buffers.update(entries)
                    for k, v in values.items():
                        _copy_into(entries[k], v)
                for p, g, value in grads:
                    if g is not None:
                        g.copy_(value)
                    p.grad = g
            for m, attrs in plain:
                for k, v in attrs.items():
                    m.__dict__[k] = v
            for m, training in flags:
                m.training = training


def _copy_into(buffer: Tensor, value: Tensor) -> None:
    """``buffer.copy_(value)``, resized first where the forward resized it (a QAT observer's ``min_val``)."""
    if buffer.shape != value.shape:
        buffer.resize_(value.shape)
    buffer.copy_(value)


def _namespaces(dbg: Any) -> list[nn.Module]:
    """fxdebug's own modules of every part, in every mode captured so far."""
    found: dict[int, nn.Module] = {}
    parts = dbg.parts() if isinstance(dbg, Instrumented) else {"": dbg}
    for part in {id(dbg): dbg, **{id(p): p for p in parts.values()}}.values():
        space = part._modules.get(NAMESPACE) or part.__dict__.get(NAMESPACE)  # a live part keeps it in __dict__
        if space is not None:
            found[id(space)] = space
        rec = recipe(part)
        for snap in (rec.snapshots if rec is not None else ()):
            if snap.space is not None:
                found[id(snap.space)] = snap.space
    return list(found.values())


def _copy_value(v: Any) -> Any:
    if isinstance(v, Tensor):
        return v.detach().clone()
    if isinstance(v, dict):
        return {k: _copy_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_copy_value(x) for x in v]
    return v


def _put_back(current: Any, saved: Any) -> Any:
    """``saved`` written into ``current`` in place where both are tensors of one shape (graphs may hold them)."""
    if isinstance(current, Tensor) and isinstance(saved, Tensor) and current.shape == saved.shape \
            and current.dtype == saved.dtype:
        with torch.no_grad():
            current.copy_(saved)
        return current
    return saved


@contextlib.contextmanager
def _statistics_kept(dbg: Any) -> Iterator[None]:
    """What the observers and the clock hold is put back: verify's calls are not the user's statistics."""
    before = _namespaces(dbg)
    saved = [(m, {k: _copy_value(v) for k, v in vars(m).items() if k not in _SKIP})
             for space in before for m in space.modules()]
    try:
        yield
    finally:
        for m, values in saved:
            for k, v in values.items():
                cur = m.__dict__.get(k)
                if isinstance(v, dict) and isinstance(cur, dict):
                    kept = {key: _put_back(cur.get(key), x) for key, x in v.items()}
                    cur.clear()
                    cur.update(kept)
                else:
                    m.__dict__[k] = _put_back(cur, v)
        known = {id(s) for s in before}
        for space in _namespaces(dbg):  # captured for another mode during verify: start it empty
            if id(space) not in known:
                for m in space.modules():
                    reset = getattr(m, "reset", None)
                    if callable(reset) and m is not space:
                        reset()


@contextlib.contextmanager
def _live_kept(dbg: Any) -> Iterator[None]:
    """A live (Dynamo) module's own bookkeeping is put back: its call count, each graph's calls.

    A graph captured during verify (the other mode) is dropped again: it is instrumented anew,
    with empty statistics, when a user's call first runs it.
    """
    state = live_state(dbg)
    if state is None:
        yield
        return
    calls, parts = state.calls, dict(state.parts)
    lengths = {graph: len(found.calls) for graph, found in parts.items()}
    try:
        yield
    finally:
        state.calls = calls
        for graph in [g for g in state.parts if g not in parts]:
            del state.parts[graph]
        for graph, n in lengths.items():
            del parts[graph].calls[n:]


_SKIP = frozenset(nn.Module().__dict__) - {"_buffers"}


def _reset(model: nn.Module, buffers: dict[int, tuple[nn.Module, dict[str, Any], dict[str, Tensor]]],
           params: list[nn.Parameter], seed: int, streams: list[tuple[Any, Any]] | None = None) -> None:
    """Back to the starting point between the two runs of one mode: buffers, gradients, every random
    stream (torch's from ``seed``; Python's, numpy's and the model's generators as they were at the start)."""
    if streams is not None:
        restore_random_state(streams)
    with torch.no_grad():
        for m, entries, values in buffers.values():
            m._buffers.clear()
            m._buffers.update(entries)
            for k, v in values.items():
                _copy_into(entries[k], v)
    for p in params:
        p.grad = None
    torch.manual_seed(seed)


def _loss(out: Any) -> Tensor | None:
    """A fixed, non-uniform weighting of every float output, so each element's gradient counts."""
    terms = []
    for t in pytree.tree_leaves(out):
        if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad:
            w = torch.linspace(-1, 1, t.numel(), dtype=t.dtype, device=t.device).view(t.shape)
            terms.append((t * w).sum())
    return sum(terms) if terms else None  # type: ignore[return-value]


def _run(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
         grad_inputs: bool = True) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """One forward and backward; the output and the gradient of every floating-point input."""
    leaves: list[Tensor] = []

    def fed(v: Any) -> Any:
        if not isinstance(v, Tensor):
            return v
        if not grad_inputs or not v.is_floating_point() or not torch.is_grad_enabled():
            return v.clone()
        leaf = v.detach().clone().requires_grad_(True)
        leaves.append(leaf)
        return leaf.clone()  # not the leaf itself: a forward may write into its input in place

    out = module(*pytree.tree_map(fed, args), **pytree.tree_map(fed, kwargs))
    loss = _loss(out)
    if loss is not None:
        loss.backward()
    snap = snapshot(out)  # every tensor the output holds, a key/value cache object's too
    input_grads = {f"input {i}": None if t.grad is None else t.grad.clone() for i, t in enumerate(leaves)}
    return snap, input_grads, {}


def _equal(a: Any, b: Any, rtol: float, atol: float) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if rtol == 0 and atol == 0:
            return bool(torch.equal(a, b))
        return bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
    if type(a) is not type(b):
        return False
    if a is b:
        return True
    try:
        same = a == b
        return bool(same) if isinstance(same, bool) else bool(same.all())  # numpy arrays compare elementwise
    except Exception:  # not comparable as values: only the same object counts as equal
        return False


def verify(dbg: Any, example_inputs: Any, *, modes: tuple[str, ...] = ("train", "eval"), seed: int = 0,
           rtol: float = 0.0, atol: float = 0.0) -> Verification:
    """Compare ``dbg`` with the model it was made from, in each of ``modes``; restore everything.

    Returns a ``Verification`` (falsy when something differs; ``.raise_if_failed()`` raises a
    ``VerificationError`` naming the first node where the runs part). Bitwise by default;
    ``rtol``/``atol`` for transform passes meant to be close, not exact.
    """
    rec = recipe(dbg)
    model = rec.model if rec is not None else model_of(dbg) if isinstance(dbg, Instrumented) else None
    if model is None or model is dbg:
        raise ArgumentTypeError("verify() needs a module made by fxdebug.trace / fxdebug.instrument in this process "
                                "(it compares against the model it was made from); got "
                                f"{type(dbg).__name__}.")
    inputs = normalize_inputs(example_inputs)
    if inputs is None:
        raise MissingInputsError("verify() runs the model: pass example_inputs=(x,) (or a dict of keyword inputs).")
    args, kwargs = inputs
    result = Verification(ok=True, modes=tuple(modes))
    with _restored(model, dbg), _statistics_kept(dbg), _live_kept(dbg):
        modules = list({id(m): m for r in (model, dbg) for m in r.modules()}.values())
        start = {id(m): (m, dict(m._buffers), {k: v.detach().clone() for k, v in m._buffers.items() if v is not None})
                 for m in modules}
        params = list({id(p): p for r in (model, dbg) for p in r.parameters()}.values())
        streams = saved_random_state(model)
        with_input_grads = True
        for mode in modes:
            training = mode == "train"
            model.train(training)  # on the model, as a training loop does: the instrumented module must follow
            runs = []
            for module in (model, dbg):
                _reset(model, start, params, seed, streams)
                try:
                    out, input_grads, _ = _run(module, args, kwargs, grad_inputs=with_input_grads)
                except Exception:
                    if module is not model or not with_input_grads:
                        raise
                    # The model's own forward refuses inputs that need a gradient (wav2vec2's feature
                    # encoder sets ``requires_grad`` on its input in training): compare without them.
                    with_input_grads = False
                    _reset(model, start, params, seed, streams)
                    out, input_grads, _ = _run(module, args, kwargs, grad_inputs=False)
                grads = {k: None if p.grad is None else p.grad.detach().clone() for k, p in model.named_parameters()}
                grads.update(input_grads)
                bufs = {k: b.detach().clone() for k, b in model.named_buffers()}
                runs.append((out, grads, bufs))
            before = len(result.mismatches)
            _compare(runs[0], runs[1], mode, result, rtol, atol)
            if len(result.mismatches) > before and result.first_node is None:
                _reset(model, start, params, seed, streams)
                forward_differs = any(m.startswith(f"{mode}: output") for m in result.mismatches[before:])
                _locate(dbg, model, args, kwargs, seed, forward_differs, result, start, params, streams)
    result.ok = not result.mismatches
    return result


def _compare(ref: tuple[Any, ...], got: tuple[Any, ...], mode: str, result: Verification, rtol: float,
             atol: float) -> None:
    out_ref, grads_ref, bufs_ref = ref
    out, grads, bufs = got
    paths_ref, paths = [p for p, _ in out_ref], [p for p, _ in out]
    if paths_ref != paths:
        only = sorted(set(paths_ref) ^ set(paths))[:3]
        result.mismatches.append(f"{mode}: output structure differs (only in one run: {', '.join(only) or 'order'})")
    for (i, a), (_, b) in zip(out_ref, out):
        result.compared += 1
        if not _equal(a, b, rtol, atol):
            result.mismatches.append(f"{mode}: output {i} differs{_by(a, b)}")
    for k, g in grads_ref.items():
        result.compared += 1
        h = grads.get(k)
        if (g is None) != (h is None):
            result.mismatches.append(f"{mode}: gradient of '{k}' is {'None' if h is None else 'set'} "
                                     f"(the model's is {'None' if g is None else 'set'})")
        elif g is not None and not _equal(g, h, rtol, atol):
            result.mismatches.append(f"{mode}: gradient of '{k}' differs{_by(g, h)}")
    for k, b in bufs_ref.items():
        result.compared += 1
        if not _equal(b, bufs.get(k), rtol, atol):
            result.mismatches.append(f"{mode}: buffer '{k}' after the call differs{_by(b, bufs.get(k))}")


def _by(a: Any, b: Any) -> str:
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and a.is_floating_point():
        return f" (max |diff| {float((a.double() - b.double()).abs().max()):.3g})"
    return ""


# -- where the runs part -----------------------------------------------------------------------------
def _locate(dbg: Any, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int,
            forward: bool, result: Verification, start: Any, params: list[nn.Parameter],
            streams: list[tuple[Any, Any]]) -> None:
    """Name the first node where graph and model part (best effort: module outputs are compared)."""
    part: Any = dbg.parts().get("") if isinstance(dbg, Instrumented) else dbg
    if part is None or not hasattr(part, "graph"):
        return
    eager = _module_outputs(model, args, kwargs, seed)
    _reset(model, start, params, seed, streams)  # the graph draws what the model drew (numpy, Python too)
    values = _node_values(part, args, kwargs, seed)
    if values is None:
        return
    order = [n for n in part.graph.nodes]
    boundary: dict[str, Any] = {}
    for n in order:  # the last node of each module's first contiguous run of nodes
        path = fx_meta(n).get("module")
        if not path or n.op in ("placeholder", "output", "get_attr"):
            continue
        for p in _prefixes(path):
            if p in boundary and boundary[p][1]:
                continue
            boundary[p] = (n, False)
        for p in list(boundary):
            if not path.startswith(p) and p != path:
                boundary[p] = (boundary[p][0], True)
    candidates = []
    for p, (n, _) in boundary.items():
        if p in eager and n.name in values:
            candidates.append((order.index(n), p, n))
    candidates.sort(key=lambda c: c[0])
    grads_differ = []
    for _, p, n in candidates:
        want, got = eager[p], values[n.name]
        if not (isinstance(want[0], Tensor) and isinstance(got[0], Tensor)) or want[0].shape != got[0].shape:
            continue
        if forward and not torch.equal(want[0], got[0]):
            result.first_node, result.where = n.name, f"module '{p}' outputs differ from the model's"
            return
        if not forward and want[1] is not None and got[1] is not None and not torch.equal(want[1], got[1]):
            grads_differ.append((n, p))
    if grads_differ:
        n, p = grads_differ[-1]
        users = ", ".join(u.name for u in n.users if not fx_meta(u).get("role"))
        result.first_node = n.name
        result.where = (f"the gradient reaching module '{p}' differs from the model's: the backward of "
                        f"{users or 'the nodes after it'} computes something else")


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _retain(t: Any) -> Any:
    if isinstance(t, Tensor) and t.requires_grad:
        t.retain_grad()
    return t


def _module_outputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    """``{module path: (first output, its gradient)}`` of one eager forward and backward."""
    seen: dict[str, Any] = {}
    handles = []
    for path, m in model.named_modules():
        if not path:
            continue

        def hook(mod: nn.Module, inp: Any, out: Any, path: str = path) -> None:
            if path not in seen:
                first = pytree.tree_leaves(out)[0] if pytree.tree_leaves(out) else None
                seen[path] = _retain(first)

        handles.append(m.register_forward_hook(hook))
    try:
        torch.manual_seed(seed)
        out = model(*clone_inputs(args), **clone_inputs(kwargs))
        loss = _loss(out)
        if loss is not None:
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return {p: _detach(t) for p, t in seen.items()}


def _detach(t: Any) -> tuple[Any, Any]:
    if isinstance(t, Tensor):
        return t.detach().clone(), None if t.grad is None else t.grad.detach().clone()
    return t, None


def _node_values(part: Any, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int) -> dict[str, Any] | None:
    """``{node name: (value, gradient)}`` of the graph run node by node, forward and backward."""
    env: dict[str, Any] = {}

    class _Recorder(Interpreter):
        def run_node(self, n: Any) -> Any:
            value = super().run_node(n)
            if isinstance(value, Tensor):
                env[n.name] = _retain(value)
            elif isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
                env[n.name] = _retain(value[0])
            return value

    try:
        flat = bind_inputs(part, *clone_inputs((args, kwargs)))
        torch.manual_seed(seed)
        out = _Recorder(part).run(*flat)
        loss = _loss(out)
        if loss is not None:
            loss.backward()
    except Exception:  # locating is best effort; the mismatch itself is already reported
        return None
    return {k: _detach(v) for k, v in env.items()}
