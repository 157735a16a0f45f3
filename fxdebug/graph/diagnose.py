"""Turning a failure inside torch into a sentence about the user's graph.

When an op fails (a Linear fed the wrong number of features, a cat along a mismatched dim, a
weight on one device and its input on another), torch names an aten op. fxdebug names the node,
its module, the op and every input's shape and device, and chains torch's error.

At run time this costs nothing until something fails: the generated ``forward`` is plain Python,
so the failing line of the traceback identifies the node, and that frame's locals hold the
node's inputs.
"""

from __future__ import annotations

import re
from typing import Any

from torch import Tensor, nn
from torch.fx import GraphModule, Node

from fxdebug.errors import DeviceMismatchError, FxDebugError, ShapeMismatchError
from fxdebug.graph.meta import describe, source_line

__all__ = ["describe_value", "locate_failure", "op_failure"]

_SHAPE_WORDS = re.compile(
    r"shape|size|mat1 and mat2|dimension|dim |expected input|must match|cannot be multiplied|"
    r"channels|out of range|broadcast",
    re.IGNORECASE,
)
_DEVICE_WORDS = re.compile(
    r"same device|device type|on device|Expected all tensors|cuda.*cpu|cpu.*cuda|meta.*(cpu|cuda)|(cpu|cuda).*meta",
    re.IGNORECASE,
)


def describe_value(value: Any) -> str:
    """``(8, 1440) float32 cpu`` for a tensor; a short type name otherwise."""
    if isinstance(value, Tensor):
        dims = ", ".join(str(d) for d in value.shape)
        return f"({dims}{',' if value.dim() == 1 else ''}) {str(value.dtype).replace('torch.', '')} {value.device}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe_value(v) for v in value[:4])
        return f"[{inner}{', ...' if len(value) > 4 else ''}]"
    return type(value).__name__


def _inputs_text(args: Any) -> str:
    flat = [a for a in (args if isinstance(args, (tuple, list)) else (args,))]
    return "; ".join(describe_value(a) for a in flat) if flat else "none"


def _module_fix(node: Node, args: Any) -> str:
    """A concrete remedy where one is evident (Linear in_features, conv in_channels)."""
    gm = node.graph.owning_module
    if node.op != "call_module" or gm is None:
        return ""
    try:
        mod = gm.get_submodule(str(node.target))
    except AttributeError:
        return ""
    x = args[0] if isinstance(args, (tuple, list)) and args else None
    if not isinstance(x, Tensor) or x.dim() == 0:
        return ""
    if isinstance(mod, nn.modules.conv._ConvNd):
        return _conv_fix(type(mod).__name__, x, mod.in_channels, len(mod.kernel_size))
    if hasattr(mod, "in_features") and x.shape[-1] != mod.in_features:
        return (f" {type(mod).__name__} has in_features={mod.in_features} but receives {x.shape[-1]}:"
                f" set in_features={x.shape[-1]} (or use nn.LazyLinear).")
    if hasattr(mod, "in_channels") and x.dim() >= 2 and x.shape[1] != mod.in_channels:
        return (f" {type(mod).__name__} has in_channels={mod.in_channels} but receives {x.shape[1]} channels:"
                f" set in_channels={x.shape[1]} or fix the input.")
    return ""


_CONV_FUNCTIONS = {"conv1d": 1, "conv2d": 2, "conv3d": 3}


def _function_fix(node: Node, args: Any) -> str:
    """The conv advice for ``F.conv2d`` / ``torch.conv2d`` calls (a bare conv root traces to one), the
    in_features advice for ``F.linear`` / ``torch.linear`` (how Dynamo and export graphs call a Linear)."""
    if getattr(node.target, "__name__", "") == "linear" and node.op == "call_function":
        return _linear_fix(args)
    dims = _CONV_FUNCTIONS.get(getattr(node.target, "__name__", ""))
    if node.op != "call_function" or dims is None or not isinstance(args, (tuple, list)) or len(args) < 2:
        return ""
    x, weight = args[0], args[1]
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or weight.dim() != dims + 2:
        return ""
    groups: Any = args[6] if len(args) > 6 and isinstance(args[6], int) else node.kwargs.get("groups", 1)
    return _conv_fix(f"conv{dims}d", x, weight.shape[1] * int(groups or 1), dims)


def _linear_fix(args: Any) -> str:
    x = args[0] if isinstance(args, (tuple, list)) and len(args) >= 2 else None
    weight = args[1] if x is not None else None
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor) or weight.dim() != 2 or x.dim() == 0:
        return ""
    if x.shape[-1] == weight.shape[1]:
        return ""
    return (f" linear has in_features={weight.shape[1]} but receives {x.shape[-1]}:"
            f" set in_features={x.shape[-1]} (or use nn.LazyLinear).")


def _conv_fix(name: str, x: Tensor, in_channels: int, dims: int) -> str:
    """Batched input: fix in_channels. Unbatched (one dim short): the batch or channel dim is missing."""
    if x.dim() == dims + 2:
        if x.shape[1] == in_channels:
            return ""
        return (f" {name} has in_channels={in_channels} but receives {x.shape[1]} channels:"
                f" set in_channels={x.shape[1]} or fix the input.")
    if x.dim() != dims + 1 or x.shape[0] == in_channels:
        return ""
    shape = tuple(x.shape)
    batch = (shape[0], in_channels, *shape[1:]) if in_channels == 1 else None
    return (f" The input {shape} has no batch dimension: {name} expects (N, {in_channels}, ...) and torch "
            f"read the {dims + 1}-dim input as one unbatched sample with {shape[0]} channels, so do not change "
            f"in_channels. "
            + (f"For a batch of {shape[0]} single-channel samples use x.unsqueeze(1), giving {batch}."
               if batch else f"Add the batch dimension (x.unsqueeze(0) for one sample) with {in_channels} "
               "channels in dim 1."))


def _producers(node: Node, env: dict[str, Any] | None = None) -> str:
    parts = []
    for inp in node.all_input_nodes:
        if inp.op == "placeholder":
            parts.append(f"input '{inp.name}'")
        elif inp.op != "get_attr":
            parts.append(f"'{inp.name}' ({describe(inp).split('(', 1)[1].rstrip(')')}{_made_from(inp, env)})")
    return f" Its input comes from {', '.join(parts)}." if parts else ""


def _made_from(node: Node, env: dict[str, Any] | None = None) -> str:
    """`` of (2, 10, 12, 12) from 'pool'``: what a producer itself consumed, when shapes are known.

    At run time (``env``: the failing call's locals) only that call's own values count: the shapes
    the example run recorded may belong to other inputs, and a producer's freed input is left out.
    """
    sources = [i for i in node.all_input_nodes if i.op != "get_attr"]
    if env is None:
        shaped = [(i, i.meta.get("fxdebug", {}).get("shape")) for i in sources]
    else:
        shaped = [(i, tuple(env[i.name].shape) if isinstance(env.get(i.name), Tensor) else None) for i in sources]
    shaped = [(i, s) for i, s in shaped if s is not None]
    if not shaped:
        return ""
    return " of " + ", ".join(f"({', '.join(str(d) for d in s)}) from '{i.name}'" for i, s in shaped)


def op_failure(node: Node, exc: BaseException, args: Any, *, when: str = "running") -> BaseException:
    """A typed fxdebug error for ``exc`` raised by ``node`` on ``args`` (to be raised ``from exc``)."""
    if isinstance(exc, FxDebugError):
        return exc
    text = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else type(exc).__name__
    where = source_line(node)
    at = f" Defined at {where}." if where else ""
    head = f"{describe(node)} failed while {when}: {text}. Inputs: {_inputs_text(args)}."
    if _DEVICE_WORDS.search(text) and isinstance(exc, RuntimeError):
        return DeviceMismatchError(
            head + " Move the model and its inputs to one device (model.to(x.device)), "
            "or create tensors inside forward with device=x.device." + at,
            node=node.name, module=_mod(node), op=_op(node),
        )
    if _SHAPE_WORDS.search(text) and isinstance(exc, (RuntimeError, ValueError, IndexError)):
        env = getattr(args, "env", None)
        return ShapeMismatchError(head + (_module_fix(node, args) or _function_fix(node, args)) + _producers(node, env) + at,
                                  node=node.name, module=_mod(node), op=_op(node))
    return FxDebugError(head + at, node=node.name, module=_mod(node), op=_op(node))


def _mod(node: Node) -> str:
    from fxdebug.graph.meta import module_path

    return module_path(node)


def _op(node: Node) -> str:
    from fxdebug.graph.meta import op_label

    return op_label(node)


_ASSIGN = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")


def locate_failure(gm: GraphModule, exc: BaseException) -> tuple[Node, tuple[Any, ...]] | None:
    """Which node of ``gm``'s generated forward raised ``exc``, and the values of its inputs."""
    filename = getattr(type(gm).forward, "__code__", None)
    filename = filename.co_filename if filename is not None else None
    tb = exc.__traceback__
    frame_hit = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            frame_hit = tb
        tb = tb.tb_next
    if frame_hit is None:
        return None
    lines = gm.code.splitlines()
    lineno = frame_hit.tb_lineno
    if not (0 < lineno <= len(lines)):
        return None
    m = _ASSIGN.match(lines[lineno - 1])
    if not m:
        return None
    by_name = {n.name: n for n in gm.graph.nodes}
    node = by_name.get(m.group(1))
    if node is None:
        return None
    local = frame_hit.tb_frame.f_locals
    args = tuple(local.get(inp.name, getattr(gm, str(inp.target), None) if inp.op == "get_attr" else None)
                 for inp in node.all_input_nodes)
    if node.op == "call_module":
        args = tuple(local.get(a.name) if isinstance(a, Node) else a for a in node.args)
    return node, _RunInputs(args, dict(local))


class _RunInputs(tuple[Any, ...]):
    """A failing node's inputs, carrying that call's locals so messages cite its own shapes."""

    env: dict[str, Any]

    def __new__(cls, values: tuple[Any, ...], env: dict[str, Any]) -> "_RunInputs":
        self = super().__new__(cls, values)
        self.env = env
        return self
