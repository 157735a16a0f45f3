"""Which ops must stay in fp32? ``precision_plan`` finds them; ``keep_float`` applies a plan.

``keep_float`` turns each chosen node into a ``KeepFloat`` call (same node name, same place in the
graph): its reduced-precision inputs are upcast to float32, its module's parameters too (copied
once, re-copied only when they change), it runs with autocast off, and its float32 output feeds
the other kept nodes directly; every other user gets it cast back to the node's original dtype,
so the rest of the model runs exactly as before.

``precision_plan`` measures before it guesses: one ``Shadow`` run of the model in the target dtype
gives each node's error growth (``err_growth``); nodes are tried from the largest growth down,
each grown one level at a time toward its inputs and its users until keeping the region in fp32
actually brings the output error down (a cancellation is fixed only by keeping its operands'
producers wide too, since the subtraction itself is exact; an fp16 overflow only by keeping the
values wide until they are small again, past the softmax); every candidate is verified by running the model, and the final set
is pruned node by node while the error stays under ``tol``. The search runs one instrumented copy
whose ``KeepFloat`` nodes are switched on and off, so each try costs one forward call.

Ops that write into an input (``relu_``, ``+=``) are never candidates: kept in fp32 they would
write into an upcast copy instead of the tensor their other readers see.

The reference is the same model computed in float32 from the same (rounded) parameters and
inputs: the plan measures, and removes, the error of *arithmetic* in the target dtype; rounding
the weights themselves is reported separately as ``error_weights`` (no op placement can undo it).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from fxdebug.authoring.context import PassContext
from fxdebug.errors import MissingInputsError, UsageError
from fxdebug.graph.meta import fx_meta, is_instrumentation, module_path, op_label
from fxdebug.numerics.tensors import _leaves, _map, device_of, no_autocast, rel_error, tree_cast

__all__ = ["KeepFloat", "PrecisionPlan", "cast_back", "keep_float", "precision_plan"]

_CALLS = ("call_function", "call_method", "call_module")


def _leaf_dtypes(value: Any) -> list[torch.dtype | None]:
    """The dtype of each tensor inside ``value`` (``None`` for non-floating ones), in order."""
    return [t.dtype if t.is_floating_point() else None for t in _leaves(value, [])]


def _to_dtypes(value: Any, dtypes: Sequence[torch.dtype | None]) -> Any:
    """Cast each floating tensor of ``value`` to its recorded dtype (the i-th tensor to
    ``dtypes[i]``; ``None`` leaves it alone). Unchanged when the tensor count differs."""
    seen = [0]

    def cast(t: Tensor) -> Tensor:
        i = seen[0]
        seen[0] += 1
        d = dtypes[i] if i < len(dtypes) else None
        return t.to(d) if d is not None and t.is_floating_point() and t.dtype != d else t

    out = _map(cast, value)
    return out if seen[0] == len(dtypes) else value


def cast_back(value: Any, dtypes: tuple[torch.dtype | None, ...]) -> Any:
    """A kept node's float32 output in the dtypes the rest of the model expects from it."""
    return _to_dtypes(value, dtypes)


class KeepFloat(nn.Module):
    """One node's op, run in ``dtype`` (float32) when ``active``, natively otherwise.

    Called as ``keep(module, args, kwargs)``; ``module`` is the node's own submodule for
    ``call_module`` nodes (read from the live model each call), else ``None``.
    """

    def __init__(self, node_name: str, op: str, target: Any, in_dtypes: Sequence[torch.dtype | None],
                 dtype: torch.dtype = torch.float32, active: bool = True) -> None:
        super().__init__()
        self.node_name, self.op, self.dtype, self.active = node_name, op, dtype, active
        self.target: Any = target if op != "call_module" else None
        self.in_dtypes = list(in_dtypes)
        self._params: dict[str, tuple[int, int, Tensor]] = {}

    def forward(self, module: Any, args: Any, kwargs: Any) -> Any:
        if not self.active:
            args, kwargs = _to_dtypes((tuple(args), dict(kwargs)), self.in_dtypes)
            return self._call(module, args, kwargs, None)
        wide_args, wide_kwargs = tree_cast((tuple(args), dict(kwargs)), self.dtype, only_lower=True)
        with no_autocast(device_of(wide_args).type):
            return self._call(module, wide_args, wide_kwargs, self.dtype)

    def _call(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype | None) -> Any:
        if self.op == "call_function":
            return self.target(*args, **kwargs)
        if self.op == "call_method":
            return getattr(args[0], self.target)(*args[1:], **kwargs)
        if dtype is None:
            return module(*args, **kwargs)
        return torch.func.functional_call(module, self._wide_params(module, dtype), args, kwargs, strict=False)

    def _wide_params(self, module: nn.Module, dtype: torch.dtype) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
            if t is None or not t.is_floating_point() or torch.finfo(t.dtype).bits >= torch.finfo(dtype).bits:
                continue
            key = (id(t), t._version)
            cached = self._params.get(name)
            if cached is None or cached[:2] != key:
                cached = self._params[name] = (*key, t.detach().to(dtype))
            out[name] = cached[2]
        return out

    def shadow_call(self, shadow_op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What a ``Shadow`` pass runs for this node: the wrapped op itself, in the shadow dtype."""
        module, inner_args, inner_kwargs = args
        return shadow_op.call_as(self.op, self.target, module, tuple(inner_args), dict(inner_kwargs))

    def extra_repr(self) -> str:
        return f"node={self.node_name!r}, dtype={self.dtype}, active={self.active}"


def keep_float(gm: GraphModule, ctx: PassContext, nodes: Iterable[Node], *, dtype: torch.dtype = torch.float32,
               active: bool = True) -> dict[str, KeepFloat]:
    """Make each of ``nodes`` a ``KeepFloat`` call in place (its name stays); returns them by name.

    Users outside ``nodes`` (and the graph output) read the value cast back to its original dtype.
    """
    chosen = [n for n in nodes if n.op in _CALLS and not is_instrumentation(n)]
    names = {n.name for n in chosen}
    graph = gm.graph
    kept: dict[str, KeepFloat] = {}
    for node in chosen:
        out_spec = ctx.spec(node) if ctx.inputs is not None else None
        arg_dtypes = _leaf_dtypes(pytree.tree_map(
            lambda a: _spec_probe(ctx, a), (tuple(node.args), dict(node.kwargs)), is_leaf=lambda a: isinstance(a, Node)))
        keep = KeepFloat(node.name, node.op, node.target, arg_dtypes, dtype, active)
        label, path = op_label(node), module_path(node)
        meta = fx_meta(node)
        meta["module"] = path
        meta["module_type"] = f"{label} (kept {str(dtype).replace('torch.', '')})"
        meta["kept_float"] = True
        mod_node = None
        if node.op == "call_module":
            with graph.inserting_before(node):
                mod_node = graph.get_attr(str(node.target))
            fx_meta(mod_node)["module"] = path  # part of the dataflow (not instrumentation): the live module
        target = ctx.add_module(gm, f"keep_{node.name}", keep)
        node.args = (mod_node, tuple(node.args), dict(node.kwargs))
        node.kwargs = {}
        node.op, node.target = "call_module", target
        kept[node.name] = keep
        out_dtypes = tuple(_leaf_dtypes(pytree.tree_map(lambda s: _fake(s), out_spec))) if out_spec is not None else None
        outside = [u for u in node.users if u.name not in names and not is_instrumentation(u)]
        if outside and out_dtypes is not None:
            with graph.inserting_after(node):
                back = graph.call_function(cast_back, (node, out_dtypes))
            fx_meta(back)["module"] = path
            for u in outside:
                u.replace_input_with(node, back)
    return kept


def _spec_probe(ctx: PassContext, a: Any) -> Any:
    """A tiny tensor standing for a node argument's recorded dtype (None for non-float values)."""
    if isinstance(a, Node):
        spec = ctx.spec(a) if ctx.inputs is not None else None
        return pytree.tree_map(_fake, spec) if spec is not None else None
    return a


def _fake(spec: Any) -> Any:
    """An empty tensor of a ``TensorSpec``'s dtype (so tensor positions line up with the run)."""
    dtype = getattr(spec, "dtype", None)
    if isinstance(dtype, torch.dtype) and hasattr(spec, "shape"):
        return torch.empty(0, dtype=dtype)
    return None


# -- the plan -----------------------------------------------------------------------------------
@dataclass
class PrecisionPlan:
    """The nodes to keep in fp32 when running a model in ``dtype``, and what that buys.

    ``error_before`` / ``error_after``: relative output error of the model in ``dtype`` against
    the same model computed in float32, without and with the plan. ``growth``: each planned
    node's error growth measured by ``Shadow``. Apply it with ``fxdebug.passes.Precision(plan)``.
    """

    nodes: list[str]
    error_before: float
    error_after: float
    tol: float
    dtype: torch.dtype
    modules: dict[str, str] = field(default_factory=dict)
    ops: dict[str, str] = field(default_factory=dict)
    growth: dict[str, float] = field(default_factory=dict)
    error_weights: float | None = None
    runs: int = 0

    @property
    def ok(self) -> bool:
        return self.error_after <= self.tol

    def __iter__(self) -> Any:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __str__(self) -> str:
        name = str(self.dtype).replace("torch.", "")
        verdict = "met" if self.ok else "NOT met"
        head = (f"precision plan for {name}: keep {len(self.nodes)} node(s) in float32; output error "
                f"{self.error_before:.3g} -> {self.error_after:.3g} (tol {self.tol:g}: {verdict}, "
                f"{self.runs} verifying runs)")
        lines = [head]
        for n in self.nodes:
            lines.append(f"  {n:<24} {self.modules.get(n) or '<root>':<24} {self.ops.get(n, ''):<20} "
                         f"growth {self.growth.get(n, math.nan):.3g}")
        if not self.ok:
            lines.append(f"  tolerance not met: the error {self.error_after:.3g} is still above tol {self.tol:g}; the "
                         "remaining error is in ops fp32 cannot help, or in the inputs (raise tol or max_nodes)")
        return "\n".join(lines)


def _inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from fxdebug.graph.inputs import normalize_inputs

    got = normalize_inputs(example_inputs)
    if got is None:
        raise MissingInputsError("precision_plan(model, example_inputs, ...) needs example inputs to run the model on.")
    return tuple(got[0]), dict(got[1])


def precision_plan(model: nn.Module, example_inputs: Any, dtype: torch.dtype = torch.bfloat16, tol: float = 1e-2,
                   *, max_nodes: int | None = None, max_runs: int = 300) -> PrecisionPlan:
    """Find a small set of nodes that must stay in fp32 for ``model`` run in ``dtype`` to keep its
    output within relative error ``tol`` (see the module docstring for how).

    ``model`` is not changed (a copy is converted). ``max_nodes`` caps the plan's size;
    ``max_runs`` the number of verifying forward calls the search may make (then the best set
    found so far is returned).
    """
    from fxdebug.api import instrument
    from fxdebug.graph.inputs import Inputs

    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point) or torch.finfo(dtype).bits > 32:
        raise UsageError(f"precision_plan(dtype={dtype!r}): dtype is the reduced precision to run in, "
                         "e.g. torch.bfloat16 or torch.float16.")
    if not tol > 0:
        raise UsageError(f"precision_plan(tol={tol!r}): tol is a relative output error > 0, e.g. 1e-2.")
    args, kwargs = _inputs(example_inputs)
    low = copy.deepcopy(model).to(dtype)
    low_args, low_kwargs = tree_cast((args, kwargs), dtype)
    low_inputs = Inputs(*low_args, **low_kwargs)

    with torch.no_grad():
        shadow = instrument(low, [_ShadowAll()], example_inputs=low_inputs)
        _seeded(shadow, low_args, low_kwargs)
        growth = {r["node"]: r["err_growth"] for r in shadow.report().rows if r.get("err_growth") is not None}
        del shadow
        search = instrument(low, [_KeepAll()], example_inputs=low_inputs)
    keeps = {m.node_name: m for m in search.modules() if isinstance(m, KeepFloat)}
    saved = [(b, b.detach().clone()) for b in low.buffers()]
    by_name = {n.name: n for n in search.graph.nodes}
    runs = 0

    def run(active: set[str]) -> Any:
        nonlocal runs
        runs += 1
        for name, k in keeps.items():
            k.active = name in active
        with torch.no_grad():
            for b, v in saved:  # batch-norm statistics as they were: every try sees the same model
                b.copy_(v)
            return _seeded(search, low_args, low_kwargs)

    with torch.no_grad():  # the reference: the same rounded weights and inputs, computed in float32
        ref_args, ref_kwargs = tree_cast((low_args, low_kwargs), torch.float32)
        ref = _seeded(copy.deepcopy(low).float(), ref_args, ref_kwargs)
        error_weights = _err(ref, _seeded(copy.deepcopy(model), args, kwargs))

    def err(active: set[str]) -> float:
        return _err(run(active), ref)

    plan: set[str] = set()
    current = before = err(plan)
    order = sorted((n for n in keeps if growth.get(n, 0.0) > 1.0), key=lambda n: -growth[n])
    for start in order:
        if current <= tol or (max_nodes is not None and len(plan) >= max_nodes) or runs >= max_runs:
            break
        if start in plan:
            continue
        region = {start}
        while True:
            e = err(plan | region)
            if e <= tol or e < 0.5 * current or runs >= max_runs:
                break
            # toward the inputs (a cancellation needs its operands wide) and the users (an
            # overflow needs the values kept wide until they are small again, e.g. past a softmax)
            near = [p for r in region for p in by_name[r].all_input_nodes] + \
                   [u for r in region for u in by_name[r].users]
            frontier = {p.name for p in near if p.name in keeps and p.name not in plan and p.name not in region}
            if not frontier:
                break
            region |= frontier
        if e < current:
            plan |= region
            current = e
    if current <= tol:  # prune: drop nodes (least growth first) while the error stays under tol
        for name in sorted(plan, key=lambda n: growth.get(n, 0.0)):
            if runs >= max_runs + len(keeps):
                break
            e = err(plan - {name})
            if e <= tol:
                plan.discard(name)
                current = e
    if max_nodes is not None and len(plan) > max_nodes:
        plan = set(sorted(plan, key=lambda n: -growth.get(n, 0.0))[:max_nodes])
    after = err(plan)
    ordered = [n.name for n in search.graph.nodes if n.name in plan]
    return PrecisionPlan(
        nodes=ordered, error_before=before, error_after=after, tol=tol, dtype=dtype,
        modules={n: fx_meta(by_name[n]).get("module", "") for n in ordered},
        ops={n: str(fx_meta(by_name[n]).get("module_type", "")).split(" (kept")[0] for n in ordered},
        growth={n: growth.get(n, math.nan) for n in ordered}, error_weights=error_weights, runs=runs)


def _err(out: Any, ref: Any) -> float:
    e = rel_error(out, ref)
    if e is None:
        raise UsageError("precision_plan: the model returned no floating-point tensor to compare.")
    v = float(e)
    return math.inf if math.isnan(v) else v


def _seeded(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run with a fixed RNG seed, so dropout draws the same mask on every try."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return module(*args, **kwargs)


def _float_call_nodes(gm: GraphModule, ctx: PassContext, *, inplace: bool = True) -> list[Node]:
    """Call nodes with a floating output; ``inplace=False`` leaves out ops that write into an
    input (kept in fp32 they would write into an upcast copy, not the tensor others read)."""
    from fxdebug.graph.classify import is_inplace

    out = []
    for n in ctx.nodes(gm, None):
        if not inplace and is_inplace(n, gm):
            continue
        spec = ctx.spec(n)
        if any(isinstance(s, torch.dtype) and s.is_floating_point for s in
               (getattr(x, "dtype", None) for x in pytree.tree_leaves(spec, is_leaf=lambda v: hasattr(v, "dtype")))):
            out.append(n)
    return out


def _passes() -> tuple[type, type]:
    from fxdebug.authoring.pipeline import Pass
    from fxdebug.authoring.pipeline import PassResult

    class ShadowAll(Pass):
        name = "precision-plan-shadow"
        observe_only = True

        def run(self, gm: GraphModule, ctx: PassContext) -> Any:
            from fxdebug.numerics.shadow import add_shadow

            nodes = ctx.nodes(gm, None)
            report = _float_call_nodes(gm, ctx)
            return PassResult(gm, added=add_shadow(gm, ctx, nodes, torch.float64, report_nodes=report))

    class KeepAll(Pass):
        name = "precision-plan-search"

        def run(self, gm: GraphModule, ctx: PassContext) -> Any:
            kept = keep_float(gm, ctx, _float_call_nodes(gm, ctx, inplace=False), active=False)
            return PassResult(gm, replaced={k: k for k in kept})

    return ShadowAll, KeepAll


def _ShadowAll() -> Any:
    return _passes()[0]()


def _KeepAll() -> Any:
    return _passes()[1]()
