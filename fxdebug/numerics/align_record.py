"""The recorder behind ``fxdebug.align``: every aten op a model runs, its output and its module.

One forward, under ``no_grad`` and a ``TorchDispatchMode``: each op's output is kept (a detached
copy, so later in-place ops cannot change it), with the op, the module that ran it (a stack kept by
forward pre/post hooks on the model's submodules, removed afterwards) and which earlier ops
produced its inputs (by tensor identity). Recording at the dispatch level sees what really ran —
inside SDPA or eager attention, fused or separate projections, renamed modules alike — and works
on any model, traceable or not. The model is run in eval mode on copies of the inputs, and its
training flags, buffers, Python state and random streams are put back afterwards.

The run's *precision* (``Trace.eps``) is what it was set up with: the narrowest of its float
parameters, its float inputs and the autocast dtype in force when it ran (at the call, or entered
inside a forward: a ``TorchFunctionMode`` notes it, since autocast runs above the dispatch level)
— not the dtype an op happens to produce, so an op that silently computes in bf16 inside an fp32
run is judged at fp32.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fxdebug.graph.inputs import clone_inputs, normalize_inputs, preserved_state

__all__ = ["LAYOUT_OPS", "Op", "Trace", "record"]

# Ops whose output holds exactly their first input's values in another layout (or a copy).
LAYOUT_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "clone",
    "contiguous", "alias", "detach", "lift_fresh", "lift_fresh_copy", "view_as", "flatten", "movedim",
    "as_strided", "_reshape_alias", "unflatten",
})
# ... and these when their output has as many elements as their first input (no broadcast, full slice)
_LAYOUT_IF_SAME_SIZE = frozenset({"expand", "slice", "cat", "narrow", "repeat", "expand_as"})
_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass
class Op:
    """One recorded op: ``name`` (``mm_3``), the aten ``op`` (``mm``), the owning ``module`` path and
    type, its output ``value`` (on the CPU), the indices of the ops that produced its inputs, and
    ``depth`` (arithmetic ops on the longest path from the inputs)."""

    index: int
    name: str
    op: str
    module: str
    module_type: str
    value: Tensor
    inputs: tuple[int, ...]
    depth: int
    layout_of: int | None = None  # the input whose values this op only re-lays out (a view, a copy)
    target: Any = None  # the aten op overload (to draw the recorded graph)
    leaf_input: bool = False  # reads a tensor no recorded op produced (a parameter, buffer or input)


@dataclass
class Trace:
    ops: list[Op]
    outputs: list[int]  # ops whose outputs the model returned
    eps: float  # the run's precision (machine epsilon of its narrowest set-up dtype)
    dtype: torch.dtype
    users: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        users: dict[int, list[int]] = defaultdict(list)
        for op in self.ops:
            for i in op.inputs:
                users[i].append(op.index)
        self.users = dict(users)


def _autocast_dtype() -> torch.dtype | None:
    for dev in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(dev):
                return torch.get_autocast_dtype(dev)
        except (RuntimeError, TypeError):  # pragma: no cover - older torch spellings
            continue
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.producer: dict[int, int] = {}
        self.keep: list[Tensor] = []  # outputs kept alive so their ids stay unique while recording
        self.stack: list[tuple[str, str]] = [("", "")]
        self.counts: dict[str, int] = defaultdict(int)
        self.autocast: list[torch.dtype] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
        if not outs:
            return out
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        srcs = tuple(dict.fromkeys(self.producer[id(t)] for t in ins if id(t) in self.producer))
        leaf = any(id(t) not in self.producer for t in ins)
        op_name = func.overloadpacket.__name__.rstrip("_") if hasattr(func, "overloadpacket") else str(func)
        module, mtype = self.stack[-1]
        for t in outs:
            k = self.counts[op_name]
            self.counts[op_name] += 1
            name = op_name if k == 0 else f"{op_name}_{k}"
            layout = None
            if (op_name in LAYOUT_OPS or op_name in _LAYOUT_IF_SAME_SIZE) and ins and id(ins[0]) in self.producer \
                    and ins[0].numel() == t.numel():
                layout = self.producer[id(ins[0])]
            elif op_name == "_to_copy" and ins and id(ins[0]) in self.producer and ins[0].dtype == t.dtype:
                layout = self.producer[id(ins[0])]
            depth = max((self.ops[i].depth for i in srcs), default=0) + (0 if layout is not None else 1)
            value = t.detach().to("cpu", copy=True) if t.device.type != "meta" else t.detach()
            index = len(self.ops)
            self.ops.append(Op(index, name, op_name, module, mtype, value, srcs, depth, layout, func, leaf))
            self.producer[id(t)] = index
            self.keep.append(t)
        return out


class _AutocastWatch(TorchFunctionMode):
    """Notes the autocast dtype in force at any torch call (the dispatch level cannot see it: autocast
    runs above it), so a forward that enters autocast is judged at that precision."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self.rec.autocast:
            dt = _autocast_dtype()
            if dt is not None:
                self.rec.autocast.append(dt)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _module_stack(model: nn.Module, rec: _Recorder) -> Iterator[None]:
    handles = []

    def pre(path: str, typ: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            rec.stack.append((path, typ))
        return hook

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if len(rec.stack) > 1:
            rec.stack.pop()

    for path, mod in model.named_modules():
        if not path:
            continue
        handles.append(mod.register_forward_pre_hook(pre(path, type(mod).__name__)))
        handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, was in flags:
            m.training = was


def record(model: nn.Module, example_inputs: Any) -> Trace:
    """Run ``model`` once on ``example_inputs`` and record every op (see the module docstring)."""
    call = normalize_inputs(example_inputs)
    args, kwargs = clone_inputs(call if call is not None else ((), {}))  # a forward may write into its inputs
    rec = _Recorder()
    autocast_at_call = _autocast_dtype()
    with preserved_state(model), _eval(model), torch.no_grad(), _module_stack(model, rec), _AutocastWatch(rec), rec:
        out = model(*args, **kwargs)
    outputs: list[int] = []
    for t in pytree.tree_leaves(out):
        if isinstance(t, Tensor) and id(t) in rec.producer:
            outputs.append(rec.producer[id(t)])
    if not outputs and rec.ops:
        outputs = [len(rec.ops) - 1]
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtypes += [t.dtype for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.is_floating_point()]
    if autocast_at_call is not None:
        dtypes.append(autocast_at_call)
    dtypes += rec.autocast
    dtype = max(dtypes, key=_eps, default=torch.float32)
    del rec.keep
    return Trace(rec.ops, sorted(set(outputs)), _eps(dtype), dtype)
