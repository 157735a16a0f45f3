"""``ShapeAssert``: every tensor keeps the shape and dtype the example inputs gave it.

At instrumentation time the example inputs fix each tensor-valued node's shape and dtype. Dims
listed in ``dynamic_dims`` (the batch dim by default) and dims that differ between the example
inputs and ``other_inputs`` are symbolic and print as letters (``N`` for the batch size). At run
time the first node whose output differs raises ``ShapeMismatchError``::

    node 'conv1' (module layer2.0.conv1, Conv2d) produced (N, 128, 14, 14); expected
    (N, 128, 28, 28). Inputs: (N, 64, 28, 28). Defined at model.py:41 `out = self.conv1(x)`.

The check reads ``tensor.shape`` and ``tensor.dtype`` — host metadata — and does no reduction:
no device work, no sync. It costs no Python per node and call: the graph's inputs carry one small
probe each, and only when the inputs arrive with a shape/dtype signature not seen before is every
node's shape checked, by running the graph once on fake tensors (``FakeTensorMode``: shapes only,
no data, nothing of the model mutated) before the real call proceeds. A signature that passed is
remembered, so a training loop pays the check once per input shape, and every other node stays a
fused observation (what NaNCheck + StatCollector cost). Graphs that cannot run on fake tensors
(data-dependent control flow in a leaf module, ...), and graphs calling a user's leaf module
(whose forward may change Python state), keep a probe on every node, checked per call. When an op itself fails on a bad shape (a Linear fed the wrong number
of features), the instrumented module already re-raises that as ``ShapeMismatchError`` naming
the node and its inputs' shapes; this pass catches what does *not* fail, just goes wrong.

The expectations belong to the modules they were learnt from. A live module's recapture (another
shape, mode or keyword) keeps the first capture's; but where a module was replaced since
(``model.fc = nn.Linear(512, 5)`` for a new head), its nodes and every node computed from them are
learnt again from the recapture, while the modules that were not replaced keep theirs.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

import fxdebug
from fxdebug import ShapeMismatchError
from .shape_probe import Dims, ShapeProbe
from .shape_rules import Meta, meta_of, rule_for
from fxdebug.authoring import (
    FusedProbe, ObservationContext, Options, PassContext, PassResult, Probe, Reductions, TensorSpec, Where,
    is_instrumentation, module_path,
)

__all__ = ["ShapeAssert"]

_OPS = ("placeholder", "call_module", "call_function", "call_method")
_LETTERS = "NLMKPQRSTUVW"

class ShapeAssert(fxdebug.Pass):
    """Raise ``ShapeMismatchError`` at the first node whose output shape or dtype differs from
    what the example inputs produced.

    Args:
        dynamic_dims: dims (per tensor, negative allowed) that may vary: the batch dim by default.
        other_inputs: a second set of example inputs (another batch size or sequence length);
            every dim that differs between the two runs is symbolic as well.
        check_dtype: also require the example dtype (turn off under autocast).
        where: limit the checked nodes (globs over module paths / node names, or a predicate).
    """

    name = "shape-assert"
    observe_only = True
    shares_instances = True  # its probes keep identities (the copy for another instance renames them)
    requires = ("shapes",)

    def __init__(self, dynamic_dims: Iterable[int] = (0,), *, other_inputs: Any = None, check_dtype: bool = True,
                 where: Where = None) -> None:
        super().__init__(where=where)
        opts = Options(self)
        self.dynamic_dims = opts.iterable("dynamic_dims", dynamic_dims, int, what="dim indices (ints)",
                                          example="(0,) or (0, 1), () for none")
        self.other_inputs = other_inputs
        self.check_dtype = opts.flag("check_dtype", check_dtype)
        # a live (Dynamo) module captures these too, quietly, at instrument(): a graph specialised to the first
        # example's sizes cannot run them, so their own capture is where the differing dims are learnt
        self.example_variants = () if other_inputs is None else (other_inputs,)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        specs = dict(ctx.specs(gm))
        other_run = False
        try:
            other = PassContext(self.other_inputs).specs(gm) if self.other_inputs is not None else {}
        except fxdebug.FxDebugError:  # a live capture's graph is specialised to the sizes it was captured on
            other, other_run = {}, self._ran_on_other_inputs(gm, specs)
        names = _SymbolNames(gm, specs)
        # a live graph Dynamo compiled with dynamic dims (it had seen them vary: the other example's call can reuse
        # it, so this pass never sees that call's sizes) keeps those dims symbolic when other_inputs are given
        varied = _dynamic_dims(gm) if self.other_inputs is not None and not other else {}
        symbolic: dict[str, Dims] = {}
        weights = {n.name for n in gm.graph.nodes if n.op == "get_attr"}  # lettered last: N, L, ... are activations'
        for name in [k for k in specs if k not in weights] + [k for k in specs if k in weights]:
            spec = specs[name]
            if isinstance(spec, TensorSpec):
                symbolic[name] = names.dims(spec, self._dynamic(spec, other.get(name)) | varied.get(name, set()))
        # A live (Dynamo) module hands over a new graph for each recompile (another shape, mode or keyword), all over
        # the model's own module dictionary, with stable node names: the first capture's expectation holds for them
        first = self._expected(gm)
        if first:  # a recapture: what a module replaced since (model.fc = nn.Linear(.., 5)) computes is learnt again
            for name in _replaced(gm, self.__dict__["_owners"][id(gm.__dict__.get("_modules"))]):
                first.pop(name, None)
        if other_run:
            _widen(first, specs, weights)
        # this graph's own nodes looked up: ``first`` holds every graph of the capture (a part per block: walking it
        # for each part was quadratic in the model's depth)
        for name, now in list(specs.items()):
            learnt = first.get(name)
            if learnt is not None and isinstance(now, TensorSpec) and len(now.shape) == len(learnt[0].shape):
                specs[name], symbolic[name] = learnt
        for name, spec in specs.items():
            if isinstance(spec, TensorSpec) and name not in first:
                first[name] = (spec, symbolic[name])
        _remember_owners(gm, self.__dict__["_owners"][id(gm.__dict__.get("_modules"))])
        added: list[Node | None] = []
        probes: dict[str, ShapeProbe] = {}
        nodes = list(ctx.nodes(gm, ops=_OPS, tensor_outputs=True))
        for node in nodes:
            spec = specs[node.name]
            # weights the op reads as get_attr inputs (every weight in a Dynamo graph) are not the activations the
            # message is about: left out of it, as a module call's own weights are
            inputs = [(a.name, None if a.op == "get_attr" else symbolic.get(a.name, {})) for a in node.all_input_nodes
                      if not is_instrumentation(a)]
            probes[node.name] = ShapeProbe(node, spec, symbolic[node.name], inputs, self.check_dtype)
        graph_inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(specs.get(n.name), TensorSpec)]
        guard = _ShapeGuard(gm, probes, specs, [n.name for n in graph_inputs])
        if guard.usable():
            # one probe per graph input (checking it too if selected); every other node is checked
            # once per new input signature
            for node in graph_inputs:
                added.append(ctx.observe(node, _GuardProbe(guard, probes.get(node.name))))
            for node in nodes:  # keeps each checked node in the report: free beside NaNCheck/StatCollector
                if node.op != "placeholder":
                    added.append(ctx.observe(node, _ShapeRow()))
        else:
            for node in nodes:
                added.append(ctx.observe(node, probes[node.name]))
        return PassResult(gm, added=added)

    def on_instance_copy(self, source: GraphModule, copy: GraphModule, renamed: dict[str, str]) -> None:
        """A block's copy for another instance: its nodes expect what the source's learnt (a later capture of that
        instance compares with it, as with the source's), and its modules are the ones it was learnt from."""
        first = self._expected(copy)
        for old, new in renamed.items():
            learnt = first.get(old)
            if learnt is not None:
                first.setdefault(new, learnt)
        # the copy's module paths are the source's, renamed: the source's are found once, not walked per copy
        cache = self.__dict__.setdefault("_paths", {})
        hit = cache.get(id(source))
        if hit is None or hit[0] is not source.graph:
            hit = cache[id(source)] = (source.graph, _paths(source), weakref.ref(source))
        owners = self.__dict__["_owners"][id(copy.__dict__.get("_modules"))]
        paths = {renamed.get(p, p) for p in hit[1]}
        for path, module in _modules_at(copy, {p for p in paths if p not in owners}).items():
            owners[path] = weakref.ref(module)

    def _ran_on_other_inputs(self, gm: GraphModule, specs: dict[str, Any]) -> bool:
        """Whether this (live) graph was captured on ``other_inputs``: its tensor inputs have their shapes."""
        leaves: list[Any] = []
        stack = [self.other_inputs]
        while stack:  # the tensors of (args...), {kwargs}, nested lists/tuples/dicts, in order
            item = stack.pop(0)
            if isinstance(item, dict):
                stack[:0] = list(item.values())
            elif isinstance(item, (list, tuple)):
                stack[:0] = list(item)
            elif isinstance(item, Tensor):
                leaves.append(tuple(item.shape))
        shapes = [tuple(specs[n.name].shape) for n in gm.graph.nodes
                  if n.op == "placeholder" and isinstance(specs.get(n.name), TensorSpec)]
        return bool(leaves) and shapes == leaves

    def _expected(self, gm: GraphModule) -> dict[str, tuple[TensorSpec, Dims]]:
        """``{node: (spec, symbolic dims)}`` first learnt for the model behind ``gm`` (keyed by its module table,
        which every graph of one live capture shares; a snapshot graph has its own). Beside it, in
        ``_owners``, the module object each expectation was learnt from: ``{module path: weakref}``."""
        table = gm.__dict__.get("_modules")
        memory = self.__dict__.setdefault("_first", {})
        owners = self.__dict__.setdefault("_owners", {})
        key = id(table)
        found = memory.get(key)
        if found is None or found[0] is not table:
            found = memory[key] = (table, {})
            owners[key] = {}
        return found[1]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_first", "_owners", "_paths")}

    def _dynamic(self, spec: TensorSpec, other: Any) -> set[int]:
        rank = len(spec.shape)
        dims = {d % rank for d in self.dynamic_dims if rank and -rank <= d < rank}
        if isinstance(other, TensorSpec) and len(other.shape) == rank:
            dims |= {i for i, (a, b) in enumerate(zip(spec.shape, other.shape)) if a != b}
        return dims


def _modules_at(gm: GraphModule, paths: Iterable[str]) -> dict[str, Any]:
    """``{path: the module now at path}`` for the non-root ``paths`` (one walk of the module tree)."""
    wanted = set(paths) - {""}
    if not wanted:
        return {}
    found: dict[str, Any] = {}
    for name in wanted:  # each looked up (a live part shares the whole model: a walk per part was quadratic)
        module: Any = gm
        for step in name.split("."):  # through the module tables (get_submodule: ~6 us a path, per copy of a block)
            module = (module.__dict__.get("_modules") or {}).get(step)
            if module is None:
                break
        if module is None:  # anything else on the way (a module held as a plain attribute): as torch finds it
            try:
                module = gm.get_submodule(name)
            except AttributeError:
                continue
        found[name] = module
    return found


def _paths(gm: GraphModule) -> frozenset[str]:
    """The module paths the graph's own nodes belong to."""
    return frozenset(module_path(n) for n in gm.graph.nodes if not is_instrumentation(n))


def _remember_owners(gm: GraphModule, owners: dict[str, Any]) -> None:
    """Note, for each module path the graph's nodes belong to, the module object there now (weakly)."""
    paths = _paths(gm)
    for path, module in _modules_at(gm, {p for p in paths if p not in owners}).items():  # (not set(owners): per graph)
        owners[path] = weakref.ref(module)


def _replaced(gm: GraphModule, owners: dict[str, Any]) -> set[str]:
    """Nodes of ``gm`` whose expectation belongs to a module that is no longer the one at its path (a
    replaced head), and every node computed from them: their shapes may legitimately differ now."""
    nodes = [n for n in gm.graph.nodes if not is_instrumentation(n)]
    paths = {p for p in {module_path(n) for n in nodes} if p in owners}  # this graph's paths, not all the capture's
    now = _modules_at(gm, paths)
    gone = {p for p in paths if owners[p]() is not now.get(p)}
    if not gone:
        return set()
    for p in gone:
        del owners[p]  # learnt again from this capture
    out: set[str] = set()
    for n in nodes:  # graph order is topological: a node is affected by its module or by an affected input
        if module_path(n) in gone or any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


def _dynamic_dims(gm: GraphModule) -> dict[str, set[int]]:
    """``{node: dims}`` a Dynamo graph traced as symbolic sizes (its ``example_value`` fake tensors)."""
    out: dict[str, set[int]] = {}
    for n in gm.graph.nodes:
        value = n.meta.get("example_value")
        if isinstance(value, Tensor):
            dims = {i for i, d in enumerate(value.shape) if not isinstance(d, int)}
            if dims:
                out[n.name] = dims
    return out


def _widen(first: dict[str, tuple[TensorSpec, Dims]], specs: dict[str, Any], weights: set[str]) -> None:
    """Make every dim symbolic in which the other example's graph (``specs``) differs from the first capture,
    then letter them again in graph order by size (the batch size ``N``), as a snapshot graph's are; the
    weights a live graph reads (``weights``) are lettered last, so they do not take the activations' letters."""
    grown = {}
    for name, (spec, dims) in first.items():
        now = specs.get(name)
        differ: set[int] = set()
        if isinstance(now, TensorSpec) and len(now.shape) == len(spec.shape):
            differ = {i for i, (a, b) in enumerate(zip(spec.shape, now.shape)) if a != b}
        grown[name] = set(dims) | differ
    batch = next((spec.shape[0] for spec, dims in first.values() if dims.get(0) == "N"), None)
    letters: dict[int, str] = {} if batch is None else {batch: "N"}
    order = [k for k in first if k not in weights] + [k for k in first if k in weights]
    for name in order:
        spec = first[name][0]
        lettered = {}
        for i in sorted(grown[name]):
            size = spec.shape[i]
            if size not in letters:
                used = set(letters.values())
                letters[size] = next((c for c in _LETTERS if c not in used), f"s{size}")
            lettered[i] = letters[size]
        first[name] = (spec, lettered)


class _SymbolNames:
    """Letters for symbolic dims, by example size: the batch size is ``N``, others ``L``, ``M``..."""

    def __init__(self, gm: GraphModule, specs: dict[str, Any]) -> None:
        self.by_size: dict[int, str] = {}
        for n in gm.graph.nodes:
            spec = specs.get(n.name)
            if n.op == "placeholder" and isinstance(spec, TensorSpec) and spec.shape:
                self.by_size[spec.shape[0]] = "N"
                break

    def dims(self, spec: TensorSpec, dynamic: set[int]) -> Dims:
        out = {}
        for i in sorted(dynamic):
            size = spec.shape[i]
            if size not in self.by_size:
                used = set(self.by_size.values())
                self.by_size[size] = next((c for c in _LETTERS if c not in used), f"s{size}")
            out[i] = self.by_size[size]
        return out


class _ShapeRow(FusedProbe):
    """A checked node's place in the report: a fused probe, so its node stays one fused op call."""

    key = "shape-assert"


class _GuardProbe(Probe):
    """On a graph input: checks the input itself, and hands its shape to the graph's guard."""

    key = "shape-assert"

    def __init__(self, guard: "_ShapeGuard", probe: ShapeProbe | None) -> None:
        self.guard, self.probe = guard, probe

    def update(self, state: dict[str, Any], r: Reductions, ctx: ObservationContext) -> None:
        if ctx.phase == "forward":
            if self.probe is not None:
                self.probe.check(r.x, ())
            self.guard.see(ctx.node_name, r.x, ctx.call)


class _ShapeGuard:
    """Every node's shape, checked once per new input signature by a fake-tensor run of the graph."""

    MAX_SIGNATURES = 256

    def __init__(self, gm: GraphModule, probes: dict[str, ShapeProbe], specs: dict[str, Any], inputs: list[str]) -> None:
        self.gm, self.probes = gm, probes
        self.inputs = inputs
        self.example = tuple((tuple(specs[n].shape), specs[n].dtype, specs[n].device) for n in self.inputs)
        self.pending: dict[str, tuple[Any, ...]] = {}
        self.call = -1
        self.verified: set[tuple[Any, ...]] = set()

    def __getstate__(self) -> dict[str, Any]:
        # The graph module holds this guard (through its observers): pickling it here would be a
        # cycle torch cannot rebuild. A loaded guard checks the inputs only.
        return dict(self.__dict__, gm=None, pending={}, verified=set())

    def usable(self) -> bool:
        """Whether the graph runs on fake tensors (tried once, at instrument time, on the example)."""
        if not self.inputs:
            return False
        for node in self.gm.graph.nodes:  # a user's leaf module may change Python state when run
            if node.op == "call_module" and not is_instrumentation(node):
                if not type(self.gm.get_submodule(str(node.target))).__module__.startswith("torch."):
                    return False
        try:
            self._fake_run(self.example, check=False)
        except Exception:  # noqa: BLE001 - any failure: keep a probe on every node instead
            return False
        self.verified.add(self.example)
        return True

    def see(self, name: str, x: Tensor, call: int) -> None:
        if call != self.call:
            self.pending.clear()
            self.call = call
        self.pending[name] = (tuple(x.shape), x.dtype, x.device)
        if len(self.pending) < len(self.inputs):
            return
        sig = tuple(self.pending.get(n) for n in self.inputs)
        self.pending.clear()
        if sig in self.verified or self.gm is None:
            return
        try:
            self._fake_run(sig, check=True)
        except ShapeMismatchError:
            raise
        except Exception:  # noqa: BLE001 - an op fails on these shapes: the real call raises it, named
            return
        if len(self.verified) >= self.MAX_SIGNATURES:
            self.verified.clear()
        self.verified.add(sig)

    def _fake_run(self, sig: tuple[Any, ...], check: bool) -> None:
        """Every node's shape for the input signature ``sig``: from the shape rules where a node has
        one (``shape_rules``: microseconds, no tensor made), else from a fake-tensor run of that node
        alone (``FakeTensorMode``: shapes only, nothing of the model read or written). Linear in the
        graph: a module call reads only its own parameters."""
        from torch.fx.node import map_arg

        gm = self.gm
        fakes = _Fakes()
        env: dict[Node, Any] = {}
        inputs = dict(zip(self.inputs, sig))
        for node in gm.graph.nodes:
            if node.op == "output":
                break
            if is_instrumentation(node):
                continue
            if node.op == "placeholder":
                spec = inputs.get(node.name)
                env[node] = None if spec is None else Meta(tuple(spec[0]), spec[1], torch.device(spec[2]))
                continue
            if node.op == "get_attr":
                value: Any = gm
                for part in str(node.target).split("."):
                    value = getattr(value, part)
                env[node] = value  # a real tensor: its fake keeps what from_tensor keeps; rules read its Meta
                continue
            target: Any = gm.get_submodule(str(node.target)) if node.op == "call_module" else node.target
            rule = rule_for(node.op, target)
            out = None
            if rule is not None:
                out = rule(target, map_arg(node.args, lambda n: _ruled(env.get(n))),
                           map_arg(node.kwargs, lambda n: _ruled(env.get(n))))
            if out is None:
                out = fakes.run(node, target, map_arg(node.args, lambda n: env.get(n)),
                                map_arg(node.kwargs, lambda n: env.get(n)))
            env[node] = out
            probe = self.probes.get(node.name)
            if check and probe is not None and meta_of(out) is not None:
                probe.check(meta_of(out), tuple(meta_of(env.get(a)) or env.get(a) for a in node.all_input_nodes
                                                if not is_instrumentation(a)))


def _ruled(value: Any) -> Any:
    """What a shape rule reads for a value: a tensor as its ``Meta``, anything else as it is."""
    return meta_of(value) if isinstance(value, Tensor) else value


class _Fakes:
    """The fake-tensor side of a check: one ``FakeTensorMode`` (made at the first node without a shape
    rule), the nodes without a rule run in it on fake copies of their inputs and own parameters."""

    def __init__(self) -> None:
        self.mode: Any = None
        self._fake_type: Any = ()  # FakeTensor, once the mode exists
        self.made: dict[int, Tensor] = {}  # id(real tensor) -> its fake (a parameter shared by two modules)

    def fake(self, value: Any) -> Any:
        if isinstance(value, Meta):
            return torch.empty(value.shape, dtype=value.dtype, device=value.device)  # under the mode: a fake
        if isinstance(value, Tensor) and not isinstance(value, self._fake_type):
            found = self.made.get(id(value))
            if found is None:
                found = self.made[id(value)] = self.mode.from_tensor(value)
            return found
        if isinstance(value, (list, tuple)):
            return type(value)(self.fake(v) for v in value) if not hasattr(value, "_fields") else value
        if isinstance(value, dict):
            return {k: self.fake(v) for k, v in value.items()}
        return value

    def run(self, node: Node, target: Any, args: Any, kwargs: Any) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        if self.mode is None:
            self.mode, self._fake_type = FakeTensorMode(allow_non_fake_inputs=False), FakeTensor
        with self.mode:
            args, kwargs = self.fake(args), self.fake(kwargs)
            if node.op == "call_module":
                state = {k: self.fake(v) for k, v in itertools.chain(target.named_parameters(), target.named_buffers())}
                return torch.func.functional_call(target, state, args, kwargs)
            if node.op == "call_function":
                return target(*args, **kwargs)
            self_, *rest = args
            return getattr(self_, str(target))(*rest, **kwargs)
