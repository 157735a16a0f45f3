"""``repro``: a one-file, plain-torch script that reproduces a model's first NaN/Inf or failing op.

``repro(dbg, inputs, path)`` reruns ``inputs`` node by node (fxdebug's own nodes skipped; the
model's buffers and the RNG are restored afterwards), stops at the first node that turns finite
inputs into NaN/Inf — or at the op that raised — and writes:

* ``path``: a standalone script (imports only torch, operator, math — no fxdebug, no user code);
* ``<path stem>.pt`` beside it: the tensors the script feeds the ops (the captured inputs, plus
  the parameters of any module the reproduction needs).

The script is the smallest subgraph that still reproduces the failure: the failing op alone
when that is enough, else grown toward its inputs one producer level at a time (each candidate is
written and run before it is accepted). A module call becomes the torch ops it is made of
(traced through), with its parameters saved as tensors. Run, the script prints what it
reproduced and exits 1 when the failure reproduces, 0 when it does not.

A live (Dynamo) module is a set of graphs around eager code: its model is captured once more as one
snapshot graph (``fxdebug.trace``: symbolic, else export) to cut the script from.
"""

from __future__ import annotations

import importlib
import math
import operator
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node
from torch.utils import _pytree as pytree

from fxdebug.errors import FxDebugError, UsageError
from fxdebug.graph.meta import describe, is_instrumentation, module_path, op_label
from fxdebug.instrumented.face import model_of
from fxdebug.instrumented.base import Instrumented

__all__ = ["Repro", "repro"]

_ALLOWED = ("torch", "operator", "_operator", "math", "builtins")
_MAX_GROW = 8


@dataclass
class Repro:
    """What ``repro`` wrote: the script, its tensor file, and what it reproduces."""

    path: Path
    tensors: Path
    node: str
    kind: str  # "nonfinite" or "error"
    message: str
    nodes: list[str] = field(default_factory=list)
    reproduced: bool = False

    def __str__(self) -> str:
        what = "NaN/Inf" if self.kind == "nonfinite" else "error"
        state = "reproduces" if self.reproduced else "does NOT reproduce"
        return (f"repro {self.path} ({self.tensors.name}): {what} at node '{self.node}' — {self.message}; "
                f"subgraph of {len(self.nodes)} node(s) {self.nodes}; the script {state} it in isolation")


class _Failure:
    def __init__(self, node: Node, kind: str, message: str, exc: BaseException | None = None) -> None:
        self.node, self.kind, self.message, self.exc = node, kind, message, exc


def _nonfinite(value: Any) -> bool:
    return any(isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel()
               and not bool(torch.isfinite(t).all()) for t in pytree.tree_leaves(value))


def _clone(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, value)


class _Runner(Interpreter):
    """Runs the model's own nodes; finds the failure; captures values for a chosen subgraph."""

    def __init__(self, gm: GraphModule, subgraph: set[Node] | None = None) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.extra_traceback = False
        self.failure: _Failure | None = None
        self.subgraph = subgraph
        self.captured: dict[Node, Any] = {}
        self.outputs: dict[Node, Any] = {}  # values the subgraph's own nodes produced (for recording modules)

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        if str(target).startswith("*"):
            return next(self.args_iter)
        return super().placeholder(target, args, kwargs)

    def run_node(self, n: Node) -> Any:
        if is_instrumentation(n):
            return None
        if self.subgraph is not None and n in self.subgraph:
            for a in n.all_input_nodes:
                if a not in self.subgraph and a not in self.captured:
                    self.captured[a] = _clone(self.env[a])  # before this op can overwrite it
        if n.op in ("call_module", "call_function", "call_method"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            inputs_finite = not _nonfinite((args, kwargs))
            try:
                value = getattr(self, n.op)(n.target, args, kwargs)
            except Exception as exc:
                self.failure = _Failure(n, "error", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}", exc)
                raise _Stop() from exc
            if self.subgraph is None and inputs_finite and _nonfinite(value):
                self.failure = _Failure(n, "nonfinite", _describe_bad(value) + " from finite inputs")
                raise _Stop()
            if self.subgraph is not None and n in self.subgraph:
                self.outputs[n] = _clone(value)
            return value
        return super().run_node(n)


class _Stop(Exception):
    pass


def _describe_bad(value: Any) -> str:
    nan = inf = total = 0
    for t in pytree.tree_leaves(value):
        if isinstance(t, Tensor) and t.is_floating_point():
            nan += int(torch.isnan(t).sum())
            inf += int(torch.isinf(t).sum())
            total += t.numel()
    return f"output holds {nan} NaN and {inf} Inf of {total} values"


def _run(gm: GraphModule, values: list[Any], subgraph: set[Node] | None) -> _Runner:
    from fxdebug.authoring.context import preserved_state

    runner = _Runner(gm, subgraph)
    with preserved_state(gm), torch.no_grad():
        try:
            runner.run(*values)
        except _Stop:
            pass
    return runner


# -- building the standalone graph ------------------------------------------------------------------
class _DeepTracer(fx.Tracer):
    """Traces through every module, torch.nn's own included, down to torch functions."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False


def _inline_module(g: fx.Graph, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   tensors: list[tuple[str, Tensor]], label: str, known: dict[Node, Any] | None = None) -> Any:
    """Emit ``module(*args, **kwargs)`` into ``g`` as the torch ops it is made of."""
    try:
        sub = _DeepTracer().trace(module)
    except Exception as exc:  # control flow on shapes (batch-norm, RNNs): record the aten ops it runs instead
        return _inline_recorded(g, module, args, kwargs, tensors, label, exc, known or {})
    env: dict[Node, Any] = {}
    params = [p for p in sub.nodes if p.op == "placeholder"]
    bound = list(args)
    for i, ph in enumerate(params):
        name = str(ph.target).lstrip("*")
        if i < len(bound):
            env[ph] = bound[i]
        elif name in kwargs:
            env[ph] = kwargs[name]
        elif ph.args:
            env[ph] = ph.args[0]
        else:
            env[ph] = None
    out: Any = None
    for n in sub.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "get_attr":
            value = _attr(module, str(n.target))
            if isinstance(value, Tensor):
                env[n] = _tensor_input(g, tensors, f"{label}.{n.target}", value)
            else:
                env[n] = value
        elif n.op == "output":
            out = fx.node.map_arg(n.args[0], lambda a: env[a])
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    return out


def _inline_recorded(g: fx.Graph, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     tensors: list[tuple[str, Tensor]], label: str, why: BaseException,
                     known: dict[Node, Any]) -> Any:
    """``module(*args)`` as the aten ops it runs on the captured values (``make_fx``), its
    parameters and buffers passed in as tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    values: dict[Node, Any] = {**_captured_values(g, tensors), **known}
    state: dict[str, Tensor] = {k: v for k, v in module.named_parameters(remove_duplicate=False)}
    state.update(dict(module.named_buffers(remove_duplicate=False)))
    names = list(state)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, v in enumerate(leaves) if isinstance(v, Node)]
    concrete = [values[leaves[i]] for i in slots]
    if any(v is None for v in concrete):
        raise UsageError(f"repro: cannot express module {label} ({type(module).__name__}) in plain torch: tracing "
                         f"through it failed ({type(why).__name__}: {why}) and its inputs are not plain tensors.")

    def call(*flat: Any) -> Any:
        params = dict(zip(names, flat[: len(names)]))
        filled = list(leaves)
        for i, v in zip(slots, flat[len(names):]):
            filled[i] = v
        a, kw = pytree.tree_unflatten(filled, spec)
        return torch.func.functional_call(module, params, tuple(a), dict(kw))

    try:
        with torch.no_grad():
            recorded = make_fx(call, tracing_mode="real")(*[t.detach() for t in state.values()], *concrete)
    except Exception as exc:
        raise UsageError(f"repro: cannot express module {label} ({type(module).__name__}) in plain torch: tracing "
                         f"through it failed ({type(why).__name__}: {why}), and running it to record its ops "
                         f"raised {type(exc).__name__}: {exc}.") from exc
    env: dict[Node, Any] = {}
    phs = [n for n in recorded.graph.nodes if n.op == "placeholder"]
    for ph, name in zip(phs, names):
        env[ph] = _tensor_input(g, tensors, f"{label}.{name}", state[name])
    for ph, i in zip(phs[len(names):], slots):
        env[ph] = leaves[i]
    out: Any = None
    for n in recorded.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "get_attr":
            env[n] = _tensor_input(g, tensors, f"{label}.{n.target}", _attr(recorded, str(n.target)))
        elif n.op == "output":
            out = fx.node.map_arg(n.args[0], lambda a: env[a])
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    return out


def _captured_values(g: fx.Graph, tensors: list[tuple[str, Tensor]]) -> dict[Node, Tensor | None]:
    """Placeholder node -> the tensor saved for it."""
    saved = dict(tensors)
    return {n: saved.get(str(n.target)) for n in g.nodes if n.op == "placeholder"}


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _tensor_input(g: fx.Graph, tensors: list[tuple[str, Tensor]], label: str, value: Tensor) -> Node:
    name = "".join(c if c.isalnum() else "_" for c in label).strip("_") or "t"
    if name[0].isdigit():
        name = f"t_{name}"
    existing = {n.target for n in g.nodes if n.op == "placeholder"}
    base, i = name, 1
    while name in existing:
        i += 1
        name = f"{base}_{i}"
    last = [n for n in g.nodes if n.op == "placeholder"]
    ctx = g.inserting_after(last[-1]) if last else g.inserting_before(next(iter(g.nodes), None)) if len(g.nodes) else None
    if ctx is None:
        ph = g.placeholder(name)
    else:
        with ctx:
            ph = g.placeholder(name)
    tensors.append((name, value.detach().clone()))
    return ph


def _build(gm: GraphModule, subgraph: list[Node], captured: dict[Node, Any], target: Node,
           outputs: dict[Node, Any] | None = None) -> tuple[fx.Graph, list[tuple[str, Tensor]]]:
    g = fx.Graph()
    tensors: list[tuple[str, Tensor]] = []
    env: dict[Node, Any] = {}
    known: dict[Node, Any] = {}  # new-graph node -> the value it had in the real run
    for a, value in captured.items():
        if isinstance(value, Tensor):
            env[a] = _tensor_input(g, tensors, a.name, value)
        elif any(isinstance(t, Tensor) for t in pytree.tree_leaves(value)):
            leaves, spec = pytree.tree_flatten(value)
            env[a] = pytree.tree_unflatten(
                [_tensor_input(g, tensors, f"{a.name}_{i}", t) if isinstance(t, Tensor) else t for i, t in enumerate(leaves)], spec)
        else:
            env[a] = tuple(value) if isinstance(value, torch.Size) else value
    for n in subgraph:
        if n.op == "call_module":
            module = gm.get_submodule(str(n.target))
            args = fx.node.map_arg(n.args, lambda a: env[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
            env[n] = _inline_module(g, module, tuple(args), dict(kwargs), tensors, module_path(n) or n.name, known)
        elif n.op == "get_attr":
            env[n] = _tensor_input(g, tensors, n.name, _attr(gm, str(n.target)))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
        if isinstance(env[n], Node) and outputs is not None and n in outputs:
            known[env[n]] = outputs[n]
    g.output(env[target])
    return g, tensors


def _imports(globals_: dict[str, Any]) -> list[str]:
    lines = ["import math", "import operator", "import sys", "from pathlib import Path", "", "import torch"]
    custom = fx.graph._custom_builtins
    for name, obj in globals_.items():
        if name in custom:
            stmt = custom[name].import_str
            if stmt not in lines:
                lines.append(stmt)
            continue
        if isinstance(obj, type(math)):
            mod = obj.__name__
            if not mod.split(".")[0] in _ALLOWED:
                raise UsageError(f"repro: the reproduction needs module {mod}, which is not part of torch; the script "
                                 "would have to import user code.")
            lines.append(f"import {mod} as {name}" if name != mod else f"import {mod}")
            continue
        mod = getattr(obj, "__module__", None) or ""
        qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        if mod.split(".")[0] not in _ALLOWED or qual is None or "<" in qual:
            raise UsageError(f"repro: the failing ops call {qual or obj!r} from {mod or 'an unknown module'}, which is "
                             "user code; a standalone script cannot run it. Reproduce with the model instead.")
        lines.append(f"{name} = importlib.import_module({mod!r})." + qual)
        if "import importlib" not in lines:
            lines.insert(0, "import importlib")
    return lines


_TEMPLATE = '''\
"""Standalone reproduction written by fxdebug.repro — plain torch, no fxdebug, no model code.

{what}
Reproduces with the {count} op(s) of {nodes}, fed the tensors saved in {tensor_file}.
Run: python {script}   (exits 1 when the failure reproduces, 0 when it does not)
"""

{imports}

TENSORS = Path(__file__).with_name({tensor_file!r})
ORDER = {order!r}
KIND = {kind!r}
EXPECTED = {expected!r}
NODE = {node!r}


{source}


def load_inputs():
    saved = torch.load(TENSORS, map_location=None if torch.cuda.is_available() else "cpu", weights_only=True)
    return [saved[name] for name in ORDER]


def check():
    """(reproduced, message)"""
    inputs = load_inputs()
    try:
        out = forward(None, *inputs)
    except Exception as exc:
        if KIND == "error" and type(exc).__name__ == EXPECTED:
            return True, f"reproduced: {{NODE}} raised {{type(exc).__name__}}: {{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}}"
        return False, f"not reproduced: {{NODE}} raised {{type(exc).__name__}} instead of {{EXPECTED}}: {{exc}}"
    if KIND == "error":
        return False, f"not reproduced: {{NODE}} ran without raising {{EXPECTED}}"
    leaves = out if isinstance(out, (tuple, list)) else [out]
    bad = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        nan = sum(int(torch.isnan(t).sum()) for t in bad)
        inf = sum(int(torch.isinf(t).sum()) for t in bad)
        total = sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))
        return True, f"reproduced: {{NODE}} output holds {{nan}} NaN and {{inf}} Inf of {{total}} values from finite inputs"
    return False, f"not reproduced: {{NODE}} output is finite"


def main():
    reproduced, message = check()
    print(message)
    sys.exit(1 if reproduced else 0)


if __name__ == "__main__":
    main()
'''


def _write(path: Path, failure: _Failure, nodes: list[Node], g: fx.Graph, tensors: list[tuple[str, Tensor]]) -> str:
    code = g.python_code(root_module="self")
    tensor_file = path.with_suffix(".pt").name
    node = failure.node
    if failure.kind == "error":
        what = f"{describe(node)} raised {failure.message}"
        expected = type(failure.exc).__name__ if failure.exc is not None else "Exception"
    else:
        what = f"{describe(node)}: {failure.message}"
        expected = "nonfinite"
    text = _TEMPLATE.format(
        what="\n".join(textwrap.wrap(what, 96)), count=len(nodes), nodes=", ".join(n.name for n in nodes),
        tensor_file=tensor_file, script=path.name, imports="\n".join(_imports(code.globals)),
        order=[name for name, _ in tensors], kind=failure.kind, expected=expected,
        node=f"node '{node.name}' ({op_label(node)})", source=code.src.strip())
    path.write_text(text, encoding="utf-8")
    torch.save({name: t for name, t in tensors}, path.with_suffix(".pt"))
    return text


def _check(path: Path, text: str) -> tuple[bool, str]:
    namespace: dict[str, Any] = {"__name__": "fxdebug_repro_check", "__file__": str(path)}
    try:
        exec(compile(text, str(path), "exec"), namespace)
        return cast("tuple[bool, str]", namespace["check"]())
    except Exception as exc:  # the script itself is broken: not a reproduction
        return False, f"the script failed to run: {type(exc).__name__}: {exc}"


def _inputs_of(nodes: set[Node]) -> list[Node]:
    return [a for n in nodes for a in n.all_input_nodes if a not in nodes]


def repro(dbg: nn.Module, inputs: Any, path: str | Path) -> Repro:
    """Write a standalone script at ``path`` (and ``<stem>.pt``) reproducing the first NaN/Inf or
    failure of ``dbg`` on ``inputs``; see the module docstring. Returns a ``Repro``.

    Raises ``FxDebugError`` when the inputs run cleanly (nothing to reproduce).
    """
    from fxdebug.graph.inputs import bind_inputs, normalize_inputs

    if not isinstance(dbg, (GraphModule, Instrumented)):
        raise UsageError(f"repro(dbg, inputs, path): dbg is an fxdebug.Instrumented (or GraphModule), got {type(dbg).__name__}.")
    model = model_of(dbg) if isinstance(dbg, Instrumented) and dbg.trace_info.frontend == "dynamo" else None
    if model is not None:
        from fxdebug.api import trace  # one graph of the model as it is now (a repro is a snapshot by nature)

        dbg = trace(model, inputs)
    if not isinstance(dbg, GraphModule):
        raise UsageError(f"repro(dbg, inputs, path): dbg is an fxdebug.Instrumented (or GraphModule), got {type(dbg).__name__}.")
    parts = getattr(dbg, "parts", None)
    if callable(parts) and len(parts()) > 1:
        raise UsageError("repro: this model was captured per subtree; instrument it with frontend='symbolic' or "
                         "'export' (one graph) to write a repro.")
    got = normalize_inputs(inputs)
    if got is None:
        raise UsageError("repro(dbg, inputs, path) needs the inputs that fail.")
    values = bind_inputs(dbg, *got)
    first = _run(dbg, values, None)
    failure = first.failure
    if failure is None:
        raise FxDebugError("repro: the inputs ran without an error and every value stayed finite: nothing to reproduce.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    order = {n: i for i, n in enumerate(dbg.graph.nodes)}
    chosen: set[Node] = {failure.node}
    result: tuple[bool, str] = (False, "")
    nodes: list[Node] = []
    for _ in range(_MAX_GROW):
        nodes = sorted(chosen, key=order.__getitem__)
        rerun = _run(dbg, values, chosen)
        captured = rerun.captured
        g, tensors = _build(dbg, nodes, {a: captured[a] for a in sorted(captured, key=order.__getitem__)}, failure.node,
                            rerun.outputs)
        text = _write(path, failure, nodes, g, tensors)
        result = _check(path, text)
        if result[0]:
            break
        grow = {a for a in _inputs_of(chosen) if a.op in ("call_module", "call_function", "call_method")
                and not is_instrumentation(a)}
        if not grow:
            break
        chosen |= grow
    return Repro(path=path, tensors=path.with_suffix(".pt"), node=failure.node.name, kind=failure.kind,
                 message=failure.message, nodes=[n.name for n in nodes], reproduced=result[0])
