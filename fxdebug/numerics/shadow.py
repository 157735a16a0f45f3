"""The precision shadow: every watched node also runs in a wider dtype, from shadow inputs.

``add_shadow`` rewrites a graph so that after each selected node ``n`` a ``ShadowOp`` runs the
same op twice in the shadow dtype (float64 by default), with autocast off and no autograd:

* from the *shadow* inputs (the shadow outputs of ``n``'s producers): the value ``n`` would have
  had if the whole model had run in the shadow dtype. ``acc_err`` = ‖real − shadow‖ / ‖shadow‖,
  the error accumulated up to ``n``;
* from the *real* inputs, upcast: the op alone in high precision. ``local_err`` =
  ‖real − local‖ / ‖local‖, the error this op adds by itself.

``err_growth`` = (``acc_err`` + u) / (``acc_in`` + u), where ``acc_in`` is the same relative
error measured over ``n``'s inputs and u the unit roundoff of ``n``'s dtype: the factor by which
the accumulated error grew at ``n`` (about 1 for an op that adds nothing; about 2 for one
rounding of exact inputs). A cancellation (``E[x²] − E[x]²`` in bf16) has a small ``local_err``
at the subtraction (subtracting two bf16 numbers is nearly exact) and a huge growth (their small
errors become the whole result): ``precision_origin`` names the node with the largest growth.
A ratio, not a difference, so that the ops downstream of the culprit, which only carry the large
error along (or amplify it less), are not blamed for it. Shadow values only feed other shadow ops, never the model, so the model's outputs
stay bitwise unchanged. Per-call errors are folded into fixed-size device tensors (maxima over
calls): no host sync until the report.

Random ops cannot be replayed: dropout in training reuses the real mask (zeros of the real
output), other random ops pass the real value through (their ``local_err`` is 0). A call whose
shadow computation fails (an op without a float64 kernel, say) passes the real value through
and the row says ``shadow_failed``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from fxdebug.runtime.columns import HIDDEN, Column
from fxdebug.authoring.context import PassContext
from fxdebug.graph.meta import fx_meta, is_instrumentation
from fxdebug.graph.serialize import picklable_target, resolved_target
from fxdebug.runtime.observer import ObservationContext, Probe, Reductions
from fxdebug.numerics.tensors import device_of, float_leaves, no_autocast, rel_error, tree_cast

__all__ = ["ROLE", "ShadowOp", "ShadowProbe", "add_shadow", "as_shadow", "precision_origin"]

ROLE = "shadow"  # node.meta["fxdebug"]["role"] of every node the numerics rewrites add
_CALLS = ("call_function", "call_method", "call_module")
_CAST_METHODS = {"float", "half", "bfloat16", "double"}
_DROPOUT_FUNCS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                  torch.dropout}
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
_RANDOM_FUNCS = {torch.rand, torch.randn, torch.rand_like, torch.randn_like, torch.randint, torch.randint_like,
                 torch.bernoulli, torch.multinomial, torch.normal, torch.randperm, F.gumbel_softmax, F.rrelu}
_RANDOM_METHODS = {"uniform_", "normal_", "bernoulli_", "exponential_", "random_", "cauchy_", "log_normal_",
                   "geometric_", "bernoulli"}
_RANDOM_ATEN = ("native_dropout", "rand", "randn", "rand_like", "randn_like", "bernoulli", "randint", "randperm",
                "normal", "uniform", "multinomial")


def as_shadow(value: Any, dtype: torch.dtype) -> Any:
    """The shadow of a value the shadow does not compute (an input, a parameter): a copy in
    ``dtype``, so shadow in-place ops never write into the model's own tensors."""
    return tree_cast(value, dtype, copy=True)


def snapshot(args: Any, kwargs: Any, dtype: torch.dtype) -> Any:
    """The real inputs of an in-place op, copied in ``dtype`` before the op overwrites them."""
    return tree_cast((args, kwargs), dtype, copy=True)


def _kind(node: Node, module: nn.Module | None) -> str:
    target = node.target
    if node.op == "call_module":
        return "dropout" if isinstance(module, _DROPOUT_MODULES) else "module"
    if node.op == "call_method":
        if target in _RANDOM_METHODS:
            return "random"
        if target in _CAST_METHODS or target == "type_as":
            return "cast"
        return "method"
    try:
        if target in _DROPOUT_FUNCS:
            return "dropout"
        if target in _RANDOM_FUNCS:
            return "random"
    except TypeError:
        pass
    name = getattr(getattr(target, "overloadpacket", None), "__name__", None)
    if name in _RANDOM_ATEN:
        return "random"
    return "function"


class ShadowOp(nn.Module):
    """Runs one node's op in the shadow dtype and folds its errors into device state.

    Called as ``shadow_op(real_out, module, shadow_args, shadow_kwargs, real_args, real_kwargs)``
    and returns the shadow output, which only other ``ShadowOp`` nodes read.
    """

    def __init__(self, node_name: str, op: str, target: Any, kind: str, dtype: torch.dtype, *,
                 snapshot: bool = False, record: bool = True) -> None:
        super().__init__()
        self.record = record  # False: only carry the shadow value on (views, unreported nodes)
        self.retarget = True  # the node's arguments name a floating dtype (set by add_shadow)
        self.node_name, self.op, self.kind, self.dtype = node_name, op, kind, dtype
        self.target = target if op != "call_module" else None
        self.snapshot = snapshot
        self.failed: str | None = None
        self.calls = 0
        self.unit = 2.0 ** -24  # unit roundoff of the real output's dtype, learnt on the first call
        self._state: dict[torch.device, Tensor] = {}
        self._params: dict[str, tuple[int, int, Tensor]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # the op by name: F.max_pool2d is a local function pickle cannot write
        state["target"] = picklable_target(state.get("target"))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state, target=resolved_target(state.get("target")))
        super().__setstate__(state)

    # -- runtime --------------------------------------------------------------------------------
    def forward(self, real_out: Any, module: Any, sargs: Any, skwargs: Any, rargs: Any, rkwargs: Any) -> Any:
        if self.snapshot:
            rargs, rkwargs = rargs
        if not float_leaves((sargs, skwargs)) and self.kind != "module":
            return tree_cast(real_out, self.dtype, copy=True)  # shapes, ints, masks: nothing to shadow
        self.calls += 1
        dev = device_of(real_out)
        outs = float_leaves(real_out)
        if outs:
            self.unit = torch.finfo(outs[0].dtype).eps / 2
        with torch.no_grad(), no_autocast(dev.type):
            sa, skw = tree_cast((tuple(sargs), dict(skwargs)), self.dtype)
            if not self.record:
                try:
                    if self.kind in ("random", "dropout"):
                        return tree_cast(self._dropout(real_out, module, sa, skw) if self.kind == "dropout"
                                         else real_out, self.dtype, copy=True)
                    return tree_cast(self._call(module, sa, skw), self.dtype)
                except Exception as exc:
                    self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                    return tree_cast(real_out, self.dtype, copy=True)
            ra, rkw = tree_cast((tuple(rargs), dict(rkwargs)), self.dtype, copy=not self.snapshot and self.kind != "cast")
            acc_in = rel_error((rargs, rkwargs), (sa, skw))
            try:
                if self.kind == "random":
                    shadow = local = tree_cast(real_out, self.dtype, copy=True)
                elif self.kind == "dropout":
                    shadow, local = self._dropout(real_out, module, sa, skw), self._dropout(real_out, module, ra, rkw)
                else:
                    shadow = self._call(module, sa, skw)
                    local = self._call(module, ra, rkw)
            except Exception as exc:  # the shadow must never break the model's run
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                return tree_cast(real_out, self.dtype, copy=True)
            self._record(dev, rel_error(real_out, local), rel_error(real_out, shadow), acc_in)
        return tree_cast(shadow, self.dtype)

    def _call(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.op == "call_module" and hasattr(module, "shadow_call"):  # a wrapper (KeepFloat) shadows what it wraps
            return module.shadow_call(self, args, kwargs)
        return self.call_as(self.op, self.target, module, args, kwargs)

    def call_as(self, op: str, target: Any, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``op``/``target`` (or ``module``) on shadow-dtype values, keeping them in that dtype."""
        if op == "call_function":
            return target(*self._retarget(args), **self._retarget(kwargs))
        if op == "call_method":
            obj, rest = args[0], self._retarget(args[1:])
            if target in _CAST_METHODS or target == "type_as":
                return obj.clone() if isinstance(obj, Tensor) else obj
            if target == "to":
                rest = tuple(a.device if isinstance(a, Tensor) else a for a in rest)
            return getattr(obj, target)(*rest, **self._retarget(kwargs))
        if not isinstance(module, nn.Module):
            return module(*args, **kwargs)
        return torch.func.functional_call(module, self._wide_params(module), args, kwargs, strict=False)

    def _retarget(self, value: Any) -> Any:
        """Floating dtypes requested by the op (``.to(torch.bfloat16)``, ``dtype=torch.float16``)
        become the shadow dtype: the shadow stays wide through the model's own casts."""
        if not self.retarget:
            return value
        return pytree.tree_map(lambda v: self.dtype if isinstance(v, torch.dtype) and v.is_floating_point else v, value)

    def _wide_params(self, module: nn.Module) -> dict[str, Tensor]:
        """The module's floating parameters and buffers in the shadow dtype, re-copied only when
        the original changed (its version counter moved: an optimizer step, a BN update)."""
        out: dict[str, Tensor] = {}
        for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
            if t is None or not t.is_floating_point():
                continue
            key = (id(t), t._version)
            cached = self._params.get(name)
            if cached is None or cached[:2] != key:
                cached = self._params[name] = (*key, t.detach().to(self.dtype, copy=True))
            out[name] = cached[2]
        return out

    def _dropout(self, real_out: Any, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if isinstance(module, nn.Module):
            p, training = float(getattr(module, "p", 0.5)), module.training
        else:
            names = ("input", "p", "training", "inplace") if self.target is not torch.dropout else ("input", "p", "train")
            bound = dict(zip(names, args))
            bound.update(kwargs)
            p = float(bound.get("p", 0.5))
            training = bool(bound.get("training", bound.get("train", True)))
        x = args[0]
        if not training or p == 0.0:
            return x.clone()
        keep = real_out.detach() != 0
        return torch.where(keep, x / (1.0 - p), torch.zeros_like(x)) if p < 1.0 else torch.zeros_like(x)

    def _record(self, dev: torch.device, local: Tensor | None, acc: Tensor | None, acc_in: Tensor | None) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        inf = math.inf
        local = zero if local is None else torch.nan_to_num(local.to(dev), nan=inf, posinf=inf)
        acc = zero if acc is None else torch.nan_to_num(acc.to(dev), nan=inf, posinf=inf)
        acc_in = zero if acc_in is None else torch.nan_to_num(acc_in.to(dev), nan=inf, posinf=inf)
        u = self.unit
        growth = torch.where(torch.isinf(acc_in), torch.ones_like(acc), (acc + u) / (acc_in + u))
        vec = torch.stack([local, acc, acc_in, growth])
        state = self._state.get(dev)
        if state is None:
            self._state[dev] = vec.clone()
        else:
            torch.maximum(state, vec, out=state)

    # -- reading --------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """``local_err``, ``acc_err``, ``err_growth`` (maxima over calls); reading them syncs."""
        out: dict[str, Any] = {}
        states = [s for d, s in self._state.items() if d.type != "meta"]
        if states:
            vec = torch.stack([s.cpu() for s in states]).amax(0).tolist()
            out.update(local_err=vec[0], acc_err=vec[1], err_growth=vec[3])
        if self.failed:
            out["shadow_failed"] = self.failed
        return out

    def reset(self) -> None:
        self._state.clear()
        self.calls = 0
        self.failed = None

    def extra_repr(self) -> str:
        return f"node={self.node_name!r}, dtype={self.dtype}, kind={self.kind}"


def _precision_origin(rows: Sequence[dict[str, Any]]) -> str | None:
    return precision_origin(rows)


class ShadowProbe(Probe):
    """Puts a ``ShadowOp``'s errors into the node's report row (the shadow op does the work)."""

    key = "shadow"
    columns = (
        Column("local_err", doc="relative error this op adds alone: its real output vs the op run in the shadow "
               "dtype on its real inputs (max over calls)"),
        Column("acc_err", doc="relative error accumulated up to here: real output vs the all-shadow-dtype run "
               "(max over calls)"),
        Column("err_growth", doc="factor by which the accumulated error grew at this node; the largest is "
               "Report.precision_origin", answers="precision_origin", reading=_precision_origin),
        Column("shadow_failed", roles=HIDDEN, doc="why the shadow could not run this op (real value passed on)"),
    )

    def __init__(self, shadow_op: ShadowOp) -> None:
        self.shadow_op = shadow_op

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        # Fresh probe state means a first call or ``reset()``: the observer runs before the
        # shadow op, so clearing the shadow op's maxima here starts it afresh for this call.
        self.shadow_op.reset()
        return {}

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        return None

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        return self.shadow_op.summary() if phase == "forward" else {}


def _mark(node: Node, observed: Node) -> Node:
    meta = fx_meta(node)
    meta["role"], meta["shadows"] = ROLE, observed.name
    meta.setdefault("module", fx_meta(observed).get("module", ""))
    return node


def add_shadow(gm: GraphModule, ctx: PassContext, nodes: Sequence[Node], dtype: torch.dtype = torch.float64,
               *, report_nodes: Sequence[Node] | None = None) -> list[Node]:
    """Insert a ``ShadowOp`` after each of ``nodes`` (graph order) and report their errors.

    Inputs of shadowed nodes that are not shadowed themselves (placeholders, parameters, nodes
    outside the selection) enter the shadow as wide copies of their real value. ``report_nodes``
    (default: ``nodes``) get a ``ShadowProbe`` on their observer. Returns the nodes added.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"the shadow dtype must be a floating torch.dtype, got {dtype!r}")
    graph = gm.graph
    selected = set(nodes)
    reported = set(report_nodes) if report_nodes is not None else selected
    shadow_of: dict[Node, Node] = {}
    added: list[Node] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last_input = placeholders[-1] if placeholders else None

    def shadow_arg(a: Node) -> Node:
        if a in shadow_of:
            return shadow_of[a]
        with graph.inserting_after(last_input if a.op == "placeholder" else a):
            new = graph.call_function(as_shadow, (a, dtype))
        added.append(_mark(new, a))
        shadow_of[a] = new
        return new

    for node in list(graph.nodes):
        if node.op not in _CALLS or node not in selected or is_instrumentation(node):
            continue
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        kind = _kind(node, module)
        sargs = map_arg(node.args, shadow_arg)
        skwargs = map_arg(node.kwargs, shadow_arg)
        inplace = _is_inplace(node, module)
        rargs: Any = node.args
        rkwargs: Any = node.kwargs
        if inplace:
            with graph.inserting_before(node):
                snap = graph.call_function(snapshot, (node.args, node.kwargs, dtype))
            added.append(_mark(snap, node))
            rargs, rkwargs = snap, {}
        op = ShadowOp(node.name, node.op, node.target, kind, dtype, snapshot=inplace, record=node in reported)
        op.retarget = any(isinstance(v, torch.dtype) and v.is_floating_point
                          for v in pytree.tree_leaves((node.args, node.kwargs)))
        anchor = node
        if node in reported:
            # The observer first, the shadow op after it: the probe's fresh state (first call,
            # or after reset()) clears the op's maxima before the op records this call.
            obs = ctx.observe(node, ShadowProbe(op))
            if obs is not None:
                added.append(obs)
            anchor = next((u for u in node.users if fx_meta(u).get("observes") == node.name
                           and u.op == "call_module"), node)
        with graph.inserting_after(anchor):
            mod_node = graph.get_attr(str(node.target)) if module is not None else None
        if mod_node is not None:
            added.append(_mark(mod_node, node))
        new = ctx.insert_after(node, op, (node, mod_node, sargs, skwargs, rargs, rkwargs),
                               hint=f"shadow_{node.name}", after=mod_node if mod_node is not None else anchor)
        added.append(_mark(new, node))
        shadow_of[node] = new
    return added


def _is_inplace(node: Node, module: nn.Module | None) -> bool:
    from fxdebug.graph.classify import is_inplace

    return is_inplace(node, node.graph.owning_module)


def precision_origin(rows: Sequence[dict[str, Any]]) -> str | None:
    """The node where the accumulated error grew the most, among those whose error matters.

    Candidates are the rows whose ``acc_err`` is at least 1 % of the worst ``acc_err`` in the
    report (a tiny error growing a hundredfold in float32 is not what drifts the output) and whose
    ``err_growth`` exceeds 2 (more than one rounding of exact inputs); the largest growth wins,
    ties going to the first in execution order. ``None`` when no node qualifies.
    """
    accs = [r["acc_err"] for r in rows if r.get("acc_err") is not None]
    if not accs:
        return None
    worst = max(accs)
    floor = 0.01 * worst if math.isfinite(worst) else 0.0
    best, best_growth = None, 2.0
    for r in rows:
        growth, acc = r.get("err_growth"), r.get("acc_err")
        if growth is None or acc is None or acc < floor or (math.isfinite(worst) and not math.isfinite(acc)):
            continue
        if growth > best_growth:
            best, best_growth = r["node"], growth
    return best
