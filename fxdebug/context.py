"""``PassContext``: everything a pass may know or do besides the graph itself.

It carries the example inputs; answers "what shape/dtype/device does this node produce?" by
running the graph once on the example inputs (cached, and invalidated by the manager whenever a
pass changes the graph); selects nodes (``where=``, float outputs only, instrumentation
excluded); and performs the edits passes need — insert a call after a node and optionally rewire
its users, attach a probe, register a new module, replace a node by a module — recording
provenance under ``node.meta["fxdebug"]`` as it goes.

Running the example inputs never changes the model: buffers (batch-norm running statistics) and
the RNG state are restored afterwards, and instrumentation nodes are skipped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter, Node

from .diagnose import op_failure
from .errors import FxDebugError, PassError
from .meta import fx_meta, is_instrumentation, module_path, op_label
from .observe import Clock, Observer, Probe
from .select import Where, matches
from .tracing import normalize_inputs

__all__ = ["PassContext", "TensorSpec"]

NAMESPACE = "fxdebug"  # root attribute under which fxdebug registers the modules it adds


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and device of one tensor an example run produced."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False

    @classmethod
    def of(cls, t: Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype, t.device, t.requires_grad)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


def spec_of(value: Any) -> Any:
    """A ``TensorSpec`` for a tensor; tuples/lists/dicts of specs for containers; else the type name."""
    if isinstance(value, Tensor):
        return TensorSpec.of(value)
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, list):
        return [spec_of(v) for v in value]
    if isinstance(value, tuple):
        return tuple(spec_of(v) for v in value)
    if isinstance(value, dict):
        return {k: spec_of(v) for k, v in value.items()}
    return type(value).__name__


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Run code against ``module`` and put its buffers and the RNG streams back afterwards."""
    saved = [(b, b.detach().clone()) for b in module.buffers() if b.device.type != "meta"]
    tensors = list(module.parameters()) + list(module.buffers())
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})  # their RNGs too
    with torch.random.fork_rng(devices=devices, enabled=True):
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, copy in saved:
                    buf.copy_(copy)


def bind_inputs(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Positional values for ``gm``'s placeholders from ``args`` / ``kwargs`` / defaults."""
    pytree_info = getattr(gm.graph._codegen, "pytree_info", None)
    if pytree_info is not None and pytree_info.in_spec is not None:  # export graphs: flat (args, kwargs)
        from torch.fx._pytree import tree_flatten_spec

        return list(tree_flatten_spec((tuple(args), dict(kwargs)), pytree_info.in_spec))
    values: list[Any] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pos = list(args)
    for i, ph in enumerate(placeholders):
        name = str(ph.target).lstrip("*")
        if str(ph.target).startswith("**"):
            values.append(dict(kwargs))
        elif str(ph.target).startswith("*"):
            values.append(tuple(pos[i:]))
        elif name in kwargs:
            values.append(kwargs[name])
        elif i < len(pos):
            values.append(pos[i])
        elif ph.args:
            values.append(ph.args[0])
        else:
            raise FxDebugError(
                f"example inputs do not provide forward argument '{name}' and it has no default; "
                "pass it positionally or in a dict: example_inputs={'" + name + "': ...}.",
                node=ph.name,
            )
    return values


class _SpecRecorder(Interpreter):
    """Runs the graph on example inputs, skipping instrumentation, recording each node's spec."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.extra_traceback = False  # our own error names the node; torch's addendum is noise
        self.specs: dict[str, Any] = {}

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        if str(target).startswith("*"):  # bind_inputs packed ``*args`` as a tuple, ``**kwargs`` as a dict
            return next(self.args_iter)
        return super().placeholder(target, args, kwargs)

    def run_node(self, n: Node) -> Any:
        if is_instrumentation(n):
            return None
        try:
            value = super().run_node(n)
        except FxDebugError:
            raise
        except Exception as exc:
            args = self.fetch_args_kwargs_from_env(n)[0] if n.op != "placeholder" else ()
            raise op_failure(n, exc, args, when="running the example inputs") from exc
        spec = self.specs[n.name] = spec_of(value)
        if isinstance(spec, TensorSpec):  # written as we go, so an error later can cite it
            meta = fx_meta(n)
            meta["shape"], meta["dtype"], meta["device"] = spec.shape, str(spec.dtype).replace("torch.", ""), str(spec.device)
        return value


class PassContext:
    """What a pass knows besides the graph: example inputs, node specs, selection, edits.

    Args:
        example_inputs: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
        prior_report: statistics from an earlier run (``Report``), for passes such as
            ``SwapActivation(only_dead=...)`` that act on what was observed.
        instruments: objects with optional ``before_pass(pass_, gm)`` / ``after_pass(pass_, gm,
            result)`` methods — the place for dumping, timing and printing, not pass bodies.
    """

    def __init__(
        self,
        example_inputs: Any = None,
        *,
        prior_report: Any = None,
        instruments: Iterable[Any] = (),
    ) -> None:
        self.example_inputs = example_inputs
        self.inputs = normalize_inputs(example_inputs)
        self.prior_report = prior_report
        self.instruments = list(instruments)
        self.current_pass: str | None = None
        self.where: Where = None  # the running pass's where= option (set by the manager)
        self._specs: dict[str, Any] | None = None
        self._clock_nodes: dict[int, Node] = {}
        self._spec_graph: int | None = None

    # -- shapes ---------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget cached specs; the manager calls this whenever a pass changed the graph."""
        self._specs = None

    def specs(self, gm: GraphModule) -> dict[str, Any]:
        """``{node name: spec}`` for every node, from one run on the example inputs (cached)."""
        if self.inputs is None:
            raise PassError(
                f"pass '{self.current_pass or '?'}' needs shapes, so example_inputs are required: "
                "call instrument(model, passes, example_inputs=(x,)).",
                pass_name=self.current_pass,
            )
        if self._specs is None or self._spec_graph != id(gm.graph):
            recorder = _SpecRecorder(gm)
            values = bind_inputs(gm, *self.inputs)
            with preserved_state(gm), torch.no_grad():
                recorder.run(*values)
            self._specs, self._spec_graph = recorder.specs, id(gm.graph)
        return self._specs

    def spec(self, node: Node) -> Any:
        gm = node.graph.owning_module
        assert gm is not None, "node must belong to a GraphModule"
        return self.specs(gm).get(node.name)

    def tensor_spec(self, node: Node) -> TensorSpec | None:
        spec = self.spec(node)
        return spec if isinstance(spec, TensorSpec) else None

    # -- selection ------------------------------------------------------------------------------
    def nodes(
        self,
        gm: GraphModule,
        where: Where | str = "<current pass>",
        *,
        ops: tuple[str, ...] = ("call_module", "call_function", "call_method"),
        float_outputs: bool = False,
        tensor_outputs: bool = False,
        predicate: Callable[[Node], bool] | None = None,
    ) -> list[Node]:
        """The graph's own (non-instrumentation) nodes selected by ``where`` and the filters.

        ``where`` defaults to the running pass's own ``where=`` option.
        """
        if isinstance(where, str) and where == "<current pass>":
            where = self.where
        picked = []
        for node in list(gm.graph.nodes):
            if node.op not in ops or is_instrumentation(node) or not matches(where, node):
                continue
            if predicate is not None and not predicate(node):
                continue
            if float_outputs or tensor_outputs:
                spec = self.tensor_spec(node)
                if spec is None or (float_outputs and not spec.dtype.is_floating_point):
                    continue
            picked.append(node)
        return picked

    # -- edits ----------------------------------------------------------------------------------
    def add_module(self, gm: GraphModule, hint: str, module: nn.Module) -> str:
        """Register ``module`` on the instrumented module (never inside the user's model).

        Returns the dotted target for a ``call_module`` node: ``fxdebug.<hint>`` made unique.
        """
        space = getattr(gm, NAMESPACE, None)
        if space is None:
            space = nn.Module()
            space.training = gm.training
            gm.add_module(NAMESPACE, space)
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in hint) or "m"
        name, i = base, 1
        while hasattr(space, name):
            i += 1
            name = f"{base}_{i}"
        space.add_module(name, module)
        return f"{NAMESPACE}.{name}"

    def insert_after(
        self,
        node: Node,
        target: Callable[..., Any] | nn.Module,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        *,
        rewire: bool = False,
        hint: str | None = None,
        after: Node | None = None,
    ) -> Node:
        """Insert ``target(node, *args)`` right after ``node`` (or after ``after``).

        ``target`` is a function (``call_function``) or a module (registered with
        ``add_module``, then ``call_module``). With ``rewire=True`` every user of ``node`` is
        redirected to the new node, so the call can replace the value it sees.
        """
        gm = node.graph.owning_module
        args = (node,) if args is None else args
        with node.graph.inserting_after(after if after is not None else node):
            if isinstance(target, nn.Module):
                name = self.add_module(gm, hint or f"{type(target).__name__.lower()}_{node.name}", target)
                new = node.graph.call_module(name, args, kwargs or {})
                fx_meta(new)["module_type"] = type(target).__name__
            else:
                new = node.graph.call_function(target, args, kwargs or {})
        meta = fx_meta(new)
        meta["module"] = module_path(node)
        if self.current_pass:
            meta["added_by"] = self.current_pass
        if "stack_trace" in node.meta:
            new.meta["stack_trace"] = node.meta["stack_trace"]
        if rewire:
            node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        return new

    def replace_with_module(self, node: Node, module: nn.Module, args: tuple[Any, ...] | None = None) -> Node:
        """Replace ``node`` by a call of ``module`` on ``args`` (default: the node's first input).

        Users are rewired, metadata (module path, source line) carried over, the node erased.
        """
        graph = node.graph
        gm = graph.owning_module
        if args is None:
            args = (node.args[0],) if node.args else (next(iter(node.kwargs.values())),)
        name = self.add_module(gm, f"{node.name}", module)
        with graph.inserting_after(node):
            new = graph.call_module(name, args, {})
        self.copy_meta(node, new)
        fx_meta(new)["module_type"] = type(module).__name__
        fx_meta(new)["replaced"] = f"{op_label(node)} ({node.name})"
        if not node.users:  # the model computed a value nobody reads; its replacement keeps that shape
            fx_meta(new)["keep_unused"] = True
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        return new

    def copy_meta(self, old: Node, new: Node) -> None:
        """Carry torch's and fxdebug's metadata from ``old`` to ``new``, marking the change."""
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in old.meta:
                new.meta[key] = old.meta[key]
        meta = fx_meta(new)
        for key, value in old.meta.get("fxdebug", {}).items():
            meta.setdefault(key, value)
        if self.current_pass:
            changed = list(meta.get("changed_by", []))
            if self.current_pass not in changed:
                changed.append(self.current_pass)
            meta["changed_by"] = changed

    def observe(self, node: Node, probe: Probe) -> Node | None:
        """Attach ``probe`` to ``node``'s observer, creating the observer node if needed.

        Returns the observer node when something was added, ``None`` if the node already held a
        probe with the same key (passes and instrumentation compose instead of doubling up).
        """
        gm = node.graph.owning_module
        obs_node = next((u for u in node.users if fx_meta(u).get("observes") == node.name and u.op == "call_module"), None)
        if obs_node is None:
            observer = Observer(node.name, module_path(node), op_label(node), self.clock(gm))
            # An input's observer runs after the clock, so every observation sees this call's tick.
            after = self.clock_node(gm) if node.op == "placeholder" else node
            obs_node = self.insert_after(node, observer, (node,), hint=f"obs_{node.name}", after=after)
            meta = fx_meta(obs_node)
            meta["role"], meta["observes"] = "instrumentation", node.name
        else:
            observer = gm.get_submodule(str(obs_node.target))
        if not observer.add_probe(probe):
            return None
        if probe.wants_inputs and len(obs_node.args) == 1:
            tensor_inputs = [a for a in node.all_input_nodes if not is_instrumentation(a)]
            obs_node.args = (node, *tensor_inputs)
        probes = fx_meta(obs_node).setdefault("probes", [])
        probes.append(probe.key)
        return obs_node

    def clock(self, gm: GraphModule) -> Clock:
        """The graph's forward-call clock, inserted once at the start of the graph."""
        return gm.get_submodule(str(self.clock_node(gm).target))

    def clock_node(self, gm: GraphModule) -> Node:
        """The clock's node: right after the placeholders, before anything that observes them."""
        cached = self._clock_nodes.get(id(gm.graph))
        if cached is not None and cached.graph is gm.graph and not getattr(cached, "_erased", False):
            return cached
        for node in gm.graph.nodes:
            if node.op == "call_module" and fx_meta(node).get("role") == "clock":
                self._clock_nodes[id(gm.graph)] = node
                return node
        name = self.add_module(gm, "clock", Clock())
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        anchor = placeholders[-1] if placeholders else None
        ctx = gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before(next(iter(gm.graph.nodes)))
        with ctx:
            node = gm.graph.call_module(name, (), {})
        meta = fx_meta(node)
        meta["role"], meta["module"] = "clock", ""
        meta["added_by"] = self.current_pass or "fxdebug"
        self._clock_nodes[id(gm.graph)] = node
        return node
