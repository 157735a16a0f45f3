"""``fxdebug.gradcheck``: check the backward of every custom op in a model, node by node.

A custom ``torch.autograd.Function`` with a wrong ``backward`` trains silently wrong. The guides'
remedy is ``torch.autograd.gradcheck`` on each Function by hand, in float64, with inputs you
invent. Here the graph already knows where the custom ops are and the example run gives their
real inputs: each selected node is extracted as a function of its captured tensor inputs (and, for
a module, its parameters), cast to float64, and checked with ``torch.autograd.gradcheck`` (and
``gradgradcheck`` with ``double=True``). The table names the nodes that fail and the largest
difference between the analytical and the numerical Jacobian.

Selected by default: calls of ``autograd.Function`` subclasses, ``torch.ops`` custom operators
(any namespace but ``aten``/``prims``), functions that are not torch's own (``torch.fx.wrap``-ed
helpers), and modules that are not ``torch.nn``'s (leaves). ``where=`` selects any nodes instead.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fxdebug.authoring.context import bind_inputs, preserved_state
from fxdebug.errors import ArgumentTypeError, MissingInputsError
from fxdebug.graph.meta import is_instrumentation, module_path, op_label, source_line
from fxdebug.instrumented.live import LiveInstrumented
from fxdebug.instrumented.snapshot_recipe import recipe
from fxdebug.graph.select import Where, matches
from fxdebug.capture.symbolic import normalize_inputs

__all__ = ["GradcheckResult", "gradcheck"]

_FULL_JACOBIAN = 4096  # input (and output) elements up to which full Jacobians are compared element by element


def _full(n_in: int, n_out: int) -> bool:
    """Small enough for full Jacobians (one backward per output, two forwards per input element);
    larger nodes are checked on random projections, as gradcheck's fast mode does."""
    return n_in <= _FULL_JACOBIAN and n_out <= _FULL_JACOBIAN and n_in * n_out <= _FULL_JACOBIAN * 16


@dataclass
class GradcheckRow:
    node: str
    module: str
    op: str
    passed: bool | None  # None: skipped
    max_diff: float | None = None  # largest |analytical - numerical| (first order, or second with double)
    order: int = 1  # which check failed (1 gradcheck, 2 gradgradcheck); 1 when all passed
    source: str | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "module": self.module, "op": self.op, "passed": self.passed,
                "max_diff": self.max_diff, "order": self.order, "source": self.source, "note": self.note}


@dataclass
class GradcheckResult:
    """What ``fxdebug.gradcheck`` found: one row per checked node, failures first in ``failures``."""

    rows: list[GradcheckRow] = field(default_factory=list)

    @property
    def failures(self) -> list[GradcheckRow]:
        return [r for r in self.rows if r.passed is False]

    @property
    def ok(self) -> bool:
        return not self.failures

    def __getitem__(self, node: str) -> GradcheckRow:
        for r in self.rows:
            if r.node == node:
                return r
        raise KeyError(f"gradcheck checked no node {node!r}; it checked {[r.node for r in self.rows]}.")

    def __str__(self) -> str:
        if not self.rows:
            return "gradcheck: no node selected (no custom autograd.Function or non-standard op; pass where=...)."
        head = ("node", "module", "op", "result", "max |analytical - numerical|")
        body = []
        for r in self.rows:
            result = "skipped" if r.passed is None else "ok" if r.passed else f"FAILED ({'gradgradcheck' if r.order == 2 else 'gradcheck'})"
            diff = "-" if r.max_diff is None else f"{r.max_diff:.3g}"
            body.append((r.node, r.module or "<root>", r.op, result, diff if not r.note else f"{diff}  {r.note}"))
        widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        fails = self.failures
        lines.append(f"{len(fails)} of {len(self.rows)} nodes fail" + (
            ": " + ", ".join(f"'{r.node}'" + (f" ({r.source})" if r.source else "") for r in fails) if fails else "."))
        return "\n".join(lines)


# -- selection ------------------------------------------------------------------------------------
def _function_class(target: Any) -> type | None:
    owner = getattr(target, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        return owner
    return None


def autograd_function(node: Node) -> type | None:
    """The ``autograd.Function`` subclass a node applies: ``Fn.apply(x)`` or, as fxdebug's tracer keeps
    it (one node per call), ``apply_function(Fn, x)``; ``None`` for any other node."""
    if node.op != "call_function":
        return None
    cls = _function_class(node.target)
    if cls is None and node.args and getattr(node.target, "__name__", "") == "apply_function":
        key: Any = node.args[0]
        if isinstance(key, str):  # the tracer names the Function by a key it resolves at run time
            try:
                from fxdebug.capture import faithful

                key = faithful._resolve(key)
            except Exception:  # noqa: BLE001 - an unknown key is simply not a Function we can name
                return None
        if isinstance(key, type) and issubclass(key, torch.autograd.Function):
            cls = key
    return cls


def is_custom(node: Node, gm: GraphModule) -> bool:
    """The default selection: custom autograd Functions, custom ops, user functions and modules."""
    if node.op == "call_function":
        target = node.target
        if autograd_function(node) is not None:
            return True
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return target.namespace not in ("aten", "prims", "fxdebug")
        mod = getattr(target, "__module__", None) or ""
        return not (mod.split(".")[0] in ("torch", "_operator", "operator", "builtins", "math", "fxdebug", "_codecs")
                    or mod == "")
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        return not type(sub).__module__.startswith(("torch.", "fxdebug."))
    return False


# -- capture --------------------------------------------------------------------------------------
class _InputRecorder(Interpreter):
    def __init__(self, gm: GraphModule, wanted: set[str]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.extra_traceback = False
        self.wanted = wanted
        self.captured: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        if str(target).startswith("*"):
            return next(self.args_iter)
        return super().placeholder(target, args, kwargs)

    def run_node(self, n: Node) -> Any:
        if is_instrumentation(n):
            return None
        if n.name in self.wanted:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            clone = lambda v: v.detach().clone() if isinstance(v, Tensor) else v  # noqa: E731
            self.captured[n.name] = (tree_map(clone, args), tree_map(clone, kwargs))
        return super().run_node(n)


# -- the check ------------------------------------------------------------------------------------
def _is_float(v: Any) -> bool:
    return isinstance(v, Tensor) and v.dtype.is_floating_point


def _node_function(node: Node, gm: GraphModule, args: Any, kwargs: Any) -> tuple[Callable[..., Any], list[Tensor], list[str]]:
    """``fn(*float64 tensors) -> tuple of float outputs`` for one node, with its float64 inputs and their names."""
    leaves, spec = tree_flatten((args, kwargs))
    slots = [i for i, v in enumerate(leaves) if _is_float(v)]
    tensors = [leaves[i].detach().to(torch.float64).requires_grad_() for i in slots]
    names = [f"input {k}" for k in range(len(slots))]
    params: list[tuple[str, Tensor]] = []
    module: nn.Module | None = None
    if node.op == "call_module":
        module = copy.deepcopy(gm.get_submodule(str(node.target))).to(torch.float64)
        params = [(k, p.detach().clone().requires_grad_()) for k, p in module.named_parameters() if p.requires_grad]
        names += [f"parameter {k}" for k, _ in params]
    n_in = len(tensors)

    def fn(*xs: Tensor) -> tuple[Tensor, ...]:
        filled = list(leaves)
        for i, x in zip(slots, xs[:n_in]):
            filled[i] = x
        a, kw = tree_unflatten(filled, spec)
        if module is not None:
            out = torch.func.functional_call(module, {k: x for (k, _), x in zip(params, xs[n_in:])}, tuple(a), kw)
        elif node.op == "call_method":
            out = getattr(a[0], str(node.target))(*a[1:], **kw)
        else:
            assert callable(node.target)
            out = node.target(*a, **kw)
        return tuple(t for t in tree_flatten(out)[0] if _is_float(t))

    return fn, tensors + [p for _, p in params], names


def _max_diff(fn: Callable[..., tuple[Tensor, ...]], inputs: list[Tensor], eps: float) -> float:
    """Largest |analytical - numerical| between the Jacobians of ``fn`` at ``inputs``.

    Element by element (central differences against one backward per output element) when the
    node is small; otherwise over eight random projections ``<v, J u>``, as gradcheck's fast mode.
    """
    with torch.no_grad():
        base = fn(*inputs)
    n_in = sum(x.numel() for x in inputs)
    n_out = sum(o.numel() for o in base)
    if n_in == 0 or n_out == 0:
        return 0.0

    def shift(u: Tensor, sign: float) -> list[Tensor]:
        parts, k = [], 0
        for x in inputs:
            parts.append(x.detach() + sign * eps * u[k:k + x.numel()].view_as(x))
            k += x.numel()
        return parts

    def jvp_numerical(u: Tensor) -> Tensor:
        with torch.no_grad():
            plus, minus = fn(*shift(u, 1.0)), fn(*shift(u, -1.0))
        return torch.cat([((p - m) / (2 * eps)).reshape(-1) for p, m in zip(plus, minus)]).detach()

    def vjp_analytical(v: Tensor) -> Tensor:
        outs = fn(*inputs)
        vs, k = [], 0
        for o in outs:
            vs.append(v[k:k + o.numel()].view_as(o))
            k += o.numel()
        pairs = [(o, w) for o, w in zip(outs, vs) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], inputs, [w for _, w in pairs], allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(x)).reshape(-1) for g, x in zip(grads, inputs)]).detach()

    if _full(n_in, n_out):
        eye_in = torch.eye(n_in, dtype=torch.float64)
        numerical = torch.stack([jvp_numerical(eye_in[j]) for j in range(n_in)], dim=1)  # (n_out, n_in)
        eye_out = torch.eye(n_out, dtype=torch.float64)
        analytical = torch.stack([vjp_analytical(eye_out[i]) for i in range(n_out)], dim=0)
        return float((analytical - numerical).abs().max())
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(8):
        u = torch.randn(n_in, generator=gen, dtype=torch.float64)
        v = torch.randn(n_out, generator=gen, dtype=torch.float64)
        worst = max(worst, abs(float(vjp_analytical(v) @ u) - float(v @ jvp_numerical(u))))
    return worst


def _check_node(node: Node, gm: GraphModule, args: Any, kwargs: Any, eps: float, atol: float, double: bool) -> GradcheckRow:
    cls = autograd_function(node)
    op = f"{cls.__name__}.apply" if cls is not None else op_label(node)
    row = GradcheckRow(node.name, module_path(node), op, None, source=source_line(node))
    fn, inputs, names = _node_function(node, gm, args, kwargs)
    if not inputs:
        row.note = "no floating-point input to differentiate"
        return row
    try:
        outs = fn(*inputs)
    except Exception as exc:  # the op rejects float64: say so instead of failing the whole table
        row.note = f"does not run in float64: {type(exc).__name__}: {str(exc).strip()[:120]}"
        return row
    if not any(o.requires_grad for o in outs):
        row.note = "no differentiable floating-point output"
        return row
    fast = not _full(sum(x.numel() for x in inputs), sum(o.numel() for o in outs))
    ok = torch.autograd.gradcheck(fn, tuple(inputs), eps=eps, atol=atol, raise_exception=False, fast_mode=fast)
    if fast:
        row.note = "(large node: Jacobians compared on random projections, as gradcheck's fast mode)"
    if not ok:
        row.passed, row.order, row.max_diff = False, 1, _max_diff(fn, inputs, eps)
        return row
    row.passed, row.max_diff = True, _max_diff(fn, inputs, eps)
    if double:
        gen = torch.Generator().manual_seed(1)
        vs = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        ok2 = torch.autograd.gradgradcheck(fn, tuple(inputs), tuple(vs), eps=eps, atol=atol, raise_exception=False,
                                           fast_mode=fast)

        def vjp(*xs: Tensor) -> tuple[Tensor, ...]:
            with torch.enable_grad():
                xs = tuple(x if x.requires_grad else x.detach().requires_grad_() for x in xs)
                outs = fn(*xs)
                grads = torch.autograd.grad(outs, xs, vs, create_graph=True, allow_unused=True)
            return tuple(g for g in grads if g is not None)

        diff2 = _max_diff(vjp, inputs, eps)
        if not ok2:
            row.passed, row.order, row.max_diff = False, 2, diff2
    return row


def gradcheck(
    dbg: GraphModule,
    where: Where | str = "<custom>",
    *,
    example_inputs: Any = None,
    eps: float = 1e-6,
    atol: float = 1e-5,
    double: bool = False,
) -> GradcheckResult:
    """Check the backward of each selected node of ``dbg`` on its inputs from the example run.

    Args:
        dbg: an ``Instrumented`` module (or any GraphModule with ``example_inputs``).
        where: nodes to check (globs / predicate); default: custom autograd Functions, custom
            ops, user functions and non-``torch.nn`` modules.
        example_inputs: inputs for the capturing run; default: those ``instrument``/``trace`` was given.
        eps, atol: as in ``torch.autograd.gradcheck``.
        double: also run ``gradgradcheck`` (second derivatives).
    """
    if not isinstance(dbg, (GraphModule, LiveInstrumented)):
        raise ArgumentTypeError(f"fxdebug.gradcheck needs an instrumented model (fxdebug.instrument(...)); got {type(dbg).__name__}.")
    remembered = recipe(dbg)  # what instrument()/trace() was given, kept to recapture other modes
    raw = example_inputs if example_inputs is not None else getattr(remembered, "inputs", None)
    if raw is None and isinstance(dbg, LiveInstrumented):
        raw = dbg.example_inputs  # a live (Dynamo) module keeps what instrument() was given
    inputs = normalize_inputs(raw)
    if inputs is None:
        raise MissingInputsError("fxdebug.gradcheck needs the example run's inputs: pass example_inputs=(x,).")
    if isinstance(dbg, LiveInstrumented):
        # a live module's graphs are Dynamo's (a custom autograd Function is a higher-order op there, not a node of
        # its own): check the backward on one snapshot graph of the model as it is now
        from fxdebug.api import trace

        dbg = trace(dbg._model, raw)
    calls = ("call_function", "call_method", "call_module")
    if isinstance(where, str) and where == "<custom>":
        picked = [n for n in dbg.graph.nodes if n.op in calls and not is_instrumentation(n) and is_custom(n, dbg)]
    else:
        picked = [n for n in dbg.graph.nodes if n.op in calls and not is_instrumentation(n) and matches(where, n)]
    recorder = _InputRecorder(dbg, {n.name for n in picked})
    with preserved_state(dbg), torch.no_grad():
        recorder.run(*bind_inputs(dbg, *inputs))
    result = GradcheckResult()
    with preserved_state(dbg):
        for node in picked:
            if node.name in recorder.captured:
                args, kwargs = recorder.captured[node.name]
                result.rows.append(_check_node(node, dbg, args, kwargs, eps, atol, double))
    return result
