"""``ParamGrads``: gradient statistics of each module's *parameters* — what ``plot_grad_flow`` reads.

Guides loop over ``named_parameters()`` after ``backward()`` and print or bar-plot mean |grad|
and max |grad| per layer. ``ParamGrads`` keeps those numbers per module on the report row of the
node that calls it (for parameters read directly, ``get_attr``: the node that uses them), beside
the activation-gradient columns of ``StatCollector(grads=True)``:

* ``param_grad_mean_abs`` — mean |g| over every parameter element of the module and backward;
* ``param_grad_max_abs`` — the largest |g| seen;
* ``param_grad_norm`` — root-mean-square over backward passes of the module's gradient L2 norm
  (all its parameters together);
* ``param_count`` (hidden) — parameter elements; ``param_grad_calls`` (hidden) — backward passes seen;
  ``param_module`` (hidden) — the owning module (an LSTM's numbers sit on its first output's row).

How: each forward with grad enabled registers a one-shot gradient hook on each of the module's
parameters (removed when it fires, or at the next forward if no backward came); the hook adds
the gradient's reductions in place into device state, so nothing syncs before the report. The
hook sees the gradient of *this* backward, not ``.grad`` summed over steps. Parameters themselves,
``requires_grad`` and ``.grad`` are left alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxdebug.authoring import (
    GRADIENT, GRADIENT_MEAN, HIDDEN, VALUE, Column, ObservationContext, Pass, PassContext, PassResult, Probe,
    Reductions, Where, get_attr, is_instrumentation, matches, module_path, node_meta,
)

__all__ = ["ParamGradProbe", "ParamGrads"]


def _by_calls(rows: list[dict[str, Any]], key: str, squares: bool = False) -> float | None:
    """Rows of one module from several captures (a recompile for ``no_grad``, another shape) or ranks,
    merged as one probe would have accumulated them: weighted by backward passes (an RMS for the norm)."""
    seen = [(r[key], r.get("param_grad_calls") or 0) for r in rows if r.get(key) is not None]
    calls = sum(c for _, c in seen)
    if not seen or not calls:
        return None
    if squares:
        return float((sum(v * v * c for v, c in seen) / calls) ** 0.5)
    return float(sum(v * c for v, c in seen) / calls)


def _mean_by_calls(rows: list[dict[str, Any]]) -> float | None:
    return _by_calls(rows, "param_grad_mean_abs")


def _norm_by_calls(rows: list[dict[str, Any]]) -> float | None:
    return _by_calls(rows, "param_grad_norm", squares=True)


class ParamGradProbe(Probe):
    """Statistics of the gradients of ``params`` (``{name: Parameter}``), gathered by one-shot hooks."""

    key = "param_grads"
    columns = (
        Column("param_grad_mean_abs", roles=(VALUE, GRADIENT_MEAN), merge=_mean_by_calls,
               doc="mean |gradient| of the module's parameters"),
        Column("param_grad_max_abs", roles=(VALUE, GRADIENT), label="parameter gradients", merge="max",
               doc="largest |gradient| of the module's parameters"),
        Column("param_grad_norm", merge=_norm_by_calls,
               doc="RMS over backward passes of the parameters' gradient L2 norm"),
        Column("param_count", roles=HIDDEN, doc="parameter elements of the module"),
        Column("param_grad_calls", roles=HIDDEN, merge="sum", doc="backward passes that reached the parameters"),
        Column("param_module", roles=HIDDEN, doc="the module owning the parameters (may differ from the row's node)"),
    )

    def __init__(self, params: dict[str, nn.Parameter], owner: str = "") -> None:
        self.params = params
        self.owner = owner
        self._handles: list[Any] = []
        self._call: tuple[int, int] | None = None

    def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
        first = next(iter(self.params.values()))
        f64 = dict(dtype=torch.float64, device=first.device)
        # acc: sum |g|, sum g², elements, backward passes;  hi: max |g|
        return {"acc": torch.zeros(4, **f64), "hi": torch.zeros((), **f64),
                "count": sum(p.numel() for p in self.params.values())}

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        call = (id(state), ctx.call)  # the state too: after reset() the calls count from 0 again
        if not torch.is_grad_enabled() or torch.compiler.is_compiling() or call == self._call:
            return  # no backward can come, or this forward (a module called twice) already has its hooks
        self._call = call
        for h in self._handles:  # the previous forward had no backward
            h.remove()
        self._handles = []
        live = [(name, p) for name, p in self.params.items() if p.requires_grad]
        counted = [False]  # this forward's backward is counted by whichever hook fires first
        for name, p in live:
            self._handles.append(p.register_hook(self._hook(state, counted)))

    def _hook(self, state: dict[str, Any], counted: list[bool]) -> Any:
        handles = self._handles
        slot = len(handles)

        def hook(g: Tensor) -> None:
            g = g.detach()
            first, counted[0] = not counted[0], True  # a parameter the branch taken never used never fires
            one = torch.ones((), dtype=torch.float64, device=g.device) if first else \
                torch.zeros((), dtype=torch.float64, device=g.device)
            acc = state["acc"]
            vec = torch.stack([g.abs().sum(dtype=torch.float64), g.double().pow(2).sum(),
                               torch.full((), float(g.numel()), dtype=torch.float64, device=g.device), one])
            acc.add_(vec.to(acc.device))
            torch.maximum(state["hi"], g.abs().max().to(torch.float64).to(acc.device), out=state["hi"])
            if slot < len(handles):
                handles[slot].remove()
            return None

        return hook

    def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
        if state["acc"].device.type == "meta":
            return {}
        abs_sum, sq, n, calls = state["acc"].tolist()
        out: dict[str, Any] = {"param_count": state["count"], "param_grad_calls": int(calls), "param_module": self.owner}
        if calls:
            out.update(param_grad_mean_abs=abs_sum / n, param_grad_max_abs=float(state["hi"]),
                       param_grad_norm=(sq / calls) ** 0.5)
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> "ParamGradProbe":
        """The parameters are the model's, not the probe's: a copy of the instrumentation alone
        (``instrument(dbg, ...)`` re-instrumenting a module) hooks the same live parameters; a copy
        of the whole model hooks the copied ones (already in ``memo``)."""
        new = ParamGradProbe({k: memo.get(id(p), p) for k, p in self.params.items()}, self.owner)
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"], state["_call"] = [], None
        return state


def _module_params(gm: GraphModule, node: Node) -> tuple[dict[str, nn.Parameter], str]:
    """``(parameters, owner path)`` of a ``call_module`` node: the module's own; for a module
    fxdebug made without parameters of its own (Freeze's wrapper), those of the module it stands for."""
    target = str(node.target)
    if not target.startswith("fxdebug."):
        return dict(gm.get_submodule(target).named_parameters()), target
    stands_for = node_meta(node).stands_for
    if stands_for and not any(True for _ in gm.get_submodule(target).parameters()):
        return dict(gm.get_submodule(stands_for).named_parameters()), stands_for
    return {}, target  # a module fxdebug made with weights of its own (a fused conv): derived, not the model's


def _host(node: Node) -> Node | None:
    """The node whose row carries the statistics: ``node`` itself, or for a call returning a
    tuple (an LSTM module, or ``torch.lstm`` over the weights in a Dynamo graph) its first
    ``getitem`` user (a tuple-valued node has no row of its own)."""
    if node.op not in ("call_module", "call_function", "call_method"):
        return node
    getitems = [u for u in node.users if u.op == "call_function" and "getitem" in str(u.target)]
    return getitems[0] if getitems and node.meta.get("fxdebug", {}).get("shape") is None else node


class ParamGrads(Pass):
    """Per-module parameter-gradient statistics (see the module docstring for the columns).

    Args:
        where: limit the modules (globs over module paths, ``fxdebug.outputs_of(...)`` — meaning the
            modules themselves here — or a predicate over their nodes).
    """

    name = "param-grads"
    observe_only = True
    shares_instances = True  # its probes name parameters by path and hold them: a copy maps both to its instance's

    def __init__(self, *, where: Where = None) -> None:
        super().__init__(where=where)

    def on_instance_copy(self, source: GraphModule, copy: GraphModule, renamed: dict[str, str]) -> None:
        """A copy's probes start with no hooks of their own: the source's pending one-shot hooks are its own."""
        for observer in copy.get_submodule("fxdebug").children():
            probe = getattr(observer, "probes", {}).get(ParamGradProbe.key)
            if isinstance(probe, ParamGradProbe):
                probe._handles, probe._call = [], None

    def _selects(self, node: Node) -> bool:
        covers = getattr(self.where, "covers", None)  # outputs_of("layer1"): the modules themselves
        if covers is not None:
            return bool(covers(module_path(node)))
        return matches(self.where, node)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        groups: dict[Node, dict[str, nn.Parameter]] = {}
        owners: dict[Node, str] = {}
        seen: set[int] = set()
        for node in list(gm.graph.nodes):
            if is_instrumentation(node) or not self._selects(node):
                continue
            params: dict[str, nn.Parameter] = {}
            host: Node | None = None
            target = str(node.target)
            if node.op == "call_module":
                params, target = _module_params(gm, node)
                host = _host(node)
            elif node.op == "get_attr":
                value = get_attr(gm, str(node.target))
                if isinstance(value, nn.Parameter):
                    params = {str(node.target): value}
                    users = [u for u in node.users if not is_instrumentation(u)]
                    host = _host(users[0]) if users else None
            params = {k: p for k, p in params.items() if id(p) not in seen}  # a module called twice: once
            if not params or host is None:
                continue
            seen.update(id(p) for p in params.values())
            groups.setdefault(host, {}).update(params)
            owners.setdefault(host, target if node.op == "call_module" else target.rpartition(".")[0])
        added = [ctx.observe(host, ParamGradProbe(params, owners[host])) for host, params in groups.items()]
        return PassResult(gm, added=added)

