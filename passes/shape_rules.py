"""Shape rules for ``ShapeAssert``'s check of a new input signature: one rule per common op.

A fake-tensor run of the graph costs a dispatch (~0.3-1 ms) per node, several per module call
(``functional_call``): at 10,000 nodes that is seconds per new input shape. Most nodes of a deep
model are a few ops whose output shape is a plain function of their inputs' — activations, dropout,
norms, linear and conv layers, elementwise arithmetic — so the check reads those from this table
(microseconds, no tensor made) and runs only the other nodes on fake tensors.

A rule takes the node's target (module or function), its arguments — a ``Meta`` (shape, dtype,
device) where the graph has a tensor — and returns the output ``Meta``, or ``None`` when it is not
sure (a wrong number of features, mixed dtypes or devices, an unexpected argument): the node then
runs on fake tensors, which raise what the real op would. A rule never guesses.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Meta", "meta_of", "rule_for"]


class Meta(NamedTuple):
    """What the check knows of a tensor: shape, dtype, device (no data, no storage)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def dim(self) -> int:
        return len(self.shape)


def meta_of(value: Any) -> Meta | None:
    """A ``Meta`` for a tensor (real or fake) or a ``Meta``; ``None`` for anything else."""
    if isinstance(value, Meta):
        return value
    if isinstance(value, torch.Tensor):
        return Meta(tuple(int(d) for d in value.shape), value.dtype, value.device)
    return None


Rule = Callable[[Any, tuple[Any, ...], dict[str, Any]], "Meta | None"]


def _only(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Meta | None:
    """The first argument, when it is the only tensor among the arguments."""
    x = args[0] if args else None
    if not isinstance(x, Meta):
        return None
    others = [*args[1:], *kwargs.values()]
    if any(isinstance(a, (Meta, torch.Tensor, list, tuple, dict)) for a in others):
        return None
    return x


def _same(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Meta | None:
    if kwargs.get("dtype") is not None:
        return None
    return _only(args, kwargs)


def _floating(m: Meta | None) -> bool:
    return m is not None and m.dtype.is_floating_point


def _linear_out(x: Meta, weight: Meta | None, bias: Any, in_features: int, out_features: int) -> Meta | None:
    if x.dim() < 1 or x.shape[-1] != in_features or not _floating(x):
        return None
    for p in (weight, bias):
        if p is not None and (not isinstance(p, Meta) or p.dtype != x.dtype or p.device != x.device):
            return None
    return Meta(x.shape[:-1] + (out_features,), x.dtype, x.device)


def _linear_module(mod: nn.Linear, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Meta | None:
    x = _only(args, kwargs)
    if x is None:
        return None
    return _linear_out(x, meta_of(mod.weight), meta_of(mod.bias), mod.in_features, mod.out_features)


def _linear_function(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Meta | None:
    if kwargs or not 2 <= len(args) <= 3:
        return None
    x, w = args[0], args[1]
    b = args[2] if len(args) == 3 else None
    if not isinstance(x, Meta) or not isinstance(w, Meta) or w.dim() != 2 or (b is not None and not isinstance(b, Meta)):
        return None
    return _linear_out(x, w, b, w.shape[1], w.shape[0])


def _conv_module(mod: nn.modules.conv._ConvNd, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Meta | None:
    x = _only(args, kwargs)
    n = len(mod.kernel_size)
    if x is None or isinstance(mod, nn.modules.conv._ConvTransposeNd) or x.dim() != n + 2 or x.shape[1] != mod.in_channels:
        return None
    if not _floating(x) or mod.weight.dtype != x.dtype or mod.weight.device != x.device:
        return None
    spatial = []
    for i in range(n):
        size, k, s, d = x.shape[2 + i], mod.kernel_size[i], mod.stride[i], mod.dilation[i]
        if mod.padding == "same":
            spatial.append(size)
            continue
        p = 0 if mod.padding == "valid" else mod.padding[i]  # type: ignore[index]
        out = math.floor((size + 2 * p - d * (k - 1) - 1) / s + 1)
        if out < 1:
            return None  # the real op fails: let the fake run say so
        spatial.append(out)
    return Meta((x.shape[0], mod.out_channels, *spatial), x.dtype, x.device)


def _norm_module(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Meta | None:
    x = _only(args, kwargs)
    if x is None or not _floating(x):
        return None
    weight = getattr(mod, "weight", None)
    if weight is not None and (weight.dtype != x.dtype or weight.device != x.device):
        return None
    if isinstance(mod, nn.LayerNorm):
        ns = tuple(mod.normalized_shape)
        return x if x.shape[len(x.shape) - len(ns):] == ns and x.dim() >= len(ns) else None
    if isinstance(mod, nn.GroupNorm):
        return x if x.dim() >= 2 and x.shape[1] == mod.num_channels else None
    dims = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}.get(type(mod))  # type: ignore[call-overload]
    if dims is None or x.dim() not in dims or x.shape[1] != getattr(mod, "num_features", -1):
        return None
    if mod.training and x.shape[0] * math.prod(x.shape[2:]) <= 1:
        return None  # batch-norm refuses one value per channel in training: the fake run says so
    return x


def _same_module(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Meta | None:
    return _only(args, kwargs)


def _binary(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Meta | None:
    if kwargs or len(args) != 2:
        return None
    a, b = args
    ma, mb = meta_of(a), meta_of(b)
    if ma is not None and mb is not None:  # floats of one dtype (int / int would give a float)
        if ma.dtype != mb.dtype or ma.device != mb.device or not ma.dtype.is_floating_point:
            return None
        try:
            shape = tuple(torch.broadcast_shapes(ma.shape, mb.shape))
        except RuntimeError:
            return None
        return Meta(shape, ma.dtype, ma.device)
    m, scalar = (ma, b) if ma is not None else (mb, a)
    if m is None or isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not m.dtype.is_floating_point:
        return None
    return m  # a float tensor with a Python number keeps its dtype


_SAME_MODULES: tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Dropout, nn.Dropout1d,
    nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Identity, nn.Softmax, nn.LogSoftmax,
)
_MODULE_RULES: dict[type, Callable[..., Meta | None]] = {t: _same_module for t in _SAME_MODULES}
_MODULE_RULES.update({nn.Linear: _linear_module, nn.Conv1d: _conv_module, nn.Conv2d: _conv_module,
                      nn.Conv3d: _conv_module, nn.LayerNorm: _norm_module, nn.GroupNorm: _norm_module,
                      nn.BatchNorm1d: _norm_module, nn.BatchNorm2d: _norm_module, nn.BatchNorm3d: _norm_module})

_SAME_FUNCTIONS = [torch.relu, F.relu, torch.tanh, torch.sigmoid, F.gelu, F.silu, F.mish, F.leaky_relu, F.elu,
                   F.dropout, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.exp, torch.neg,
                   torch.abs, F.hardtanh, F.relu6, F.hardswish, F.softplus, torch.nn.functional.sigmoid,
                   torch.nn.functional.tanh, torch._C._nn.gelu]
_FUNCTION_RULES: dict[Any, Rule] = {f: _same for f in _SAME_FUNCTIONS}
_FUNCTION_RULES.update({F.linear: _linear_function, torch._C._nn.linear: _linear_function})
_FUNCTION_RULES.update({f: _binary for f in (operator.add, operator.sub, operator.mul, operator.truediv,
                                              torch.add, torch.sub, torch.mul)})
_METHOD_RULES: dict[str, Rule] = {m: _same for m in ("relu", "tanh", "sigmoid", "exp", "neg", "abs", "contiguous",
                                                      "clone", "softmax", "log_softmax")}
_METHOD_RULES.update({m: _binary for m in ("add", "sub", "mul")})


def rule_for(op: str, target: Any) -> Callable[..., Meta | None] | None:
    """The rule of a node (``op`` its FX op, ``target`` the module for a ``call_module``), or ``None``."""
    if op == "call_module":
        return _MODULE_RULES.get(type(target))
    if op == "call_function":
        try:
            return _FUNCTION_RULES.get(target)
        except TypeError:  # an unhashable target
            return None
    if op == "call_method":
        return _METHOD_RULES.get(str(target))
    return None
