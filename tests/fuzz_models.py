"""A hypothesis strategy that builds random, valid PyTorch models for property tests.

A model is described by a ``ModelSpec``: an input shape and dtype, a list of ``Step`` s (each
one op over earlier values, by index), and which values the forward returns and how (a tensor,
a tuple, a dict, a nested dict, or a tuple with an ``int`` in it). ``FuzzModel`` turns a spec
into an ``nn.Module`` whose ``forward`` replays the steps; symbolic tracing unrolls that loop,
so each step becomes ordinary graph nodes: module calls, ``torch``/``F`` functions, tensor
methods, in-place ops and ``get_attr`` parameters.

With ``faithful=True`` the space also holds what symbolic tracing and export are blind to: custom
``torch.autograd.Function`` s (a straight-through estimator, gradient reversal, a two-output
Function), ``no_grad`` / ``enable_grad`` / ``set_grad_enabled`` / ``autocast`` regions,
``if self.training:`` branches, a submodule that reassigns its buffer (an EMA) and one that counts
its calls in Python, a counter in the root's own forward, and forward hooks and pre-hooks on the
root and on an inner (non-leaf) block.

The generator tracks every value's shape, so each drawn model runs. In-place ops are drawn only
where autograd allows them: on the newest value, produced by an op that does not save its output
for backward, before anything else read it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import Tensor, nn

# Hypothesis imports libcst to suggest patches when a test fails; libcst's import warns
# (DeprecationWarning from mypy_extensions), which pytest turns into an internal error that hides
# the real failure. Import it once here, with that warning silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import libcst.metadata  # noqa: F401
    except ImportError:  # pragma: no cover - libcst is optional
        pass

__all__ = ["FAITHFUL_OPS", "RELU_FORMS", "FuzzModel", "ModelSpec", "Step", "build", "flat_tensors", "model_specs"]

RELU_FORMS = ("relu_mod", "relu_mod_inplace", "F.relu", "F.relu_inplace", "torch.relu", "torch.relu_",
              "method.relu", "method.relu_")
_INPLACE = {"relu_mod_inplace", "F.relu_inplace", "torch.relu_", "method.relu_", "affine_"}
_ACTS = ("gelu_mod", "F.silu", "torch.tanh", "method.sigmoid", "leaky_mod", "F.elu", "method.softmax",
         "hardswish_mod", "torch.sigmoid")
# constructs a graph must keep to stay faithful (model_specs(faithful=True)); all shape-preserving
FAITHFUL_OPS = ("fn.ste", "fn.reverse", "fn.pair", "no_grad", "enable_grad", "set_grad", "autocast",
                "train_branch", "ema", "counter", "hooked_block")
# ops whose backward does not read their own output: an in-place op may follow them directly
_SAFE_PRODUCERS = {"conv", "F.conv", "linear", "F.linear", "add", "cat", "bn", "ln", "F.layer_norm", "gn",
                   "avgpool", "add_const", "scale_param", "affine_"}


@dataclass(frozen=True)
class Step:
    op: str
    inputs: tuple[int, ...]
    arg: Any = None  # op-specific: out features, kernel size, groups, flavour ...


@dataclass
class ModelSpec:
    in_shape: tuple[int, ...]
    dtype: torch.dtype
    steps: list[Step]
    outputs: tuple[int, ...]
    out_format: str
    seed: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    root_counter: bool = False  # the root's forward does self.calls += 1 (keeps the root eager)
    root_hooks: tuple[str, ...] = ()  # "pre" (scales the input), "post" (scales outputs), "log" (counts calls)

    def example(self, batch: int | None = None) -> Tensor:
        """A deterministic example input (seeded by the spec)."""
        g = torch.Generator().manual_seed(self.seed)
        shape = self.in_shape if batch is None else (batch, *self.in_shape[1:])
        return torch.randn(shape, generator=g, dtype=torch.float64).to(self.dtype)

    def ops(self) -> list[str]:
        return [s.op for s in self.steps]


def _param_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A per-channel parameter shape that broadcasts against ``shape`` (channels = dim 1)."""
    return (shape[1],) + (1,) * (len(shape) - 2)


class _STE(torch.autograd.Function):
    """Straight-through rounding: forward rounds to quarters, backward passes the gradient on."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g


class _Reverse(torch.autograd.Function):
    """Gradient reversal with a scale (a non-tensor argument)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return -ctx.scale * g, None


class _Pair(torch.autograd.Function):
    """Two outputs, saved tensors, a backward unlike the forward's derivative."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(x)
        return x.sin(), x * 2

    @staticmethod
    def backward(ctx: Any, ga: Tensor, gb: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return ga * x.sign() + gb


class _EMA(nn.Module):
    """Reassigns its buffer in forward (``self.avg = ...``): an EMA of the batch mean."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(shape[1:]))

    def forward(self, x: Tensor) -> Tensor:
        self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
        return x + self.avg


class _Counter(nn.Module):
    """Counts its calls in Python, and uses the count."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x * (1.0 + 0.1 * min(self.calls, 3))


class _Block(nn.Module):
    """A non-leaf block (traced through unless it has hooks) with a scale parameter."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(_param_shape(shape)) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.scale)


class FuzzModel(nn.Module):
    """The model a ``ModelSpec`` describes. Also holds an unused layer (state_dict checks)."""

    def __init__(self, spec: ModelSpec, leaky: float | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.leaky = leaky  # build every ReLU form as the matching LeakyReLU form instead
        self.unused = nn.Linear(2, 2)
        self.calls = 0
        self.hook_log: list[int] = []
        shapes = spec.shapes
        for i, s in enumerate(spec.steps):
            mod = self._make(s, [shapes[j] for j in s.inputs], leaky)
            if isinstance(mod, nn.Module):
                self.add_module(f"m{i}", mod)
            elif isinstance(mod, dict):
                for k, v in mod.items():
                    self.register_parameter(f"p{i}_{k}", v)
        self.to(spec.dtype)

    @staticmethod
    def _make(s: Step, shapes: list[tuple[int, ...]], leaky: float | None) -> Any:
        shape = shapes[0]
        op = s.op
        if op == "relu_mod":
            return nn.ReLU() if leaky is None else nn.LeakyReLU(leaky)
        if op == "relu_mod_inplace":
            return nn.ReLU(inplace=True) if leaky is None else nn.LeakyReLU(leaky, inplace=True)
        if op == "gelu_mod":
            return nn.GELU()
        if op == "leaky_mod":
            return nn.LeakyReLU(0.2)
        if op == "hardswish_mod":
            return nn.Hardswish()
        if op == "dropout_mod":
            return nn.Dropout(0.3)
        if op == "linear":
            out, twice = s.arg
            return nn.Linear(shape[-1], shape[-1] if twice else out)
        if op == "conv":
            out, k, twice = s.arg
            cls = nn.Conv1d if len(shape) == 3 else nn.Conv2d
            return cls(shape[1], shape[1] if twice else out, k, padding=k // 2)
        if op == "bn":
            return (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(shape[1])
        if op == "ln":
            return nn.LayerNorm(shape[-1])
        if op == "gn":
            return nn.GroupNorm(s.arg, shape[1])
        if op == "maxpool" and len(shape) == 4:
            return nn.MaxPool2d(2)
        if op == "avgpool" and len(shape) == 4:
            return nn.AvgPool2d(2)
        if op == "flatten" and s.arg == "module":
            return nn.Flatten()
        if op in ("scale_param", "no_grad", "enable_grad", "set_grad"):
            return {"scale": nn.Parameter(torch.rand(_param_shape(shape)) + 0.5)}
        if op == "autocast":
            return {"w": nn.Parameter(torch.randn(shape[-1], shape[-1]) / math.sqrt(shape[-1]))}
        if op == "ema":
            return _EMA(shape)
        if op == "counter":
            return _Counter()
        if op == "hooked_block":
            block = _Block(shape)
            block.register_forward_hook(lambda m, args, out: out * 0.5)
            block.register_forward_pre_hook(lambda m, args: (args[0] + 0.25,))
            return block
        if op == "F.linear":
            return {"w": nn.Parameter(torch.randn(s.arg, shape[-1]) / math.sqrt(shape[-1])),
                    "b": nn.Parameter(torch.randn(s.arg) * 0.1)}
        if op == "F.conv":
            return {"w": nn.Parameter(torch.randn(s.arg, shape[1], 3, 3) / math.sqrt(9 * shape[1])),
                    "b": nn.Parameter(torch.randn(s.arg) * 0.1)}
        return None

    def forward(self, x: Tensor) -> Any:
        if self.spec.root_counter:
            self.calls += 1
        vals = [x]
        for i, s in enumerate(self.spec.steps):
            vals.append(self._step(i, s, [vals[j] for j in s.inputs]))
        outs = [vals[j] for j in self.spec.outputs]
        fmt = self.spec.out_format
        if fmt == "tensor":
            return outs[0]
        if fmt == "tuple":
            return tuple(outs)
        if fmt == "dict":
            return {f"out{k}": o for k, o in enumerate(outs)}
        if fmt == "nested":
            return {"main": outs[0], "aux": tuple(outs[1:])}
        return (*outs, x.shape[0])  # "with_int": a non-tensor output

    def _step(self, i: int, s: Step, xs: list[Tensor]) -> Tensor:  # noqa: C901 - one branch per op
        op, h = s.op, xs[0]
        mod = getattr(self, f"m{i}", None)
        if op in ("relu_mod", "relu_mod_inplace", "gelu_mod", "leaky_mod", "hardswish_mod", "dropout_mod", "bn",
                  "ln", "gn", "ema", "counter", "hooked_block"):
            return mod(h)
        if op in FAITHFUL_OPS:
            return self._faithful(i, op, h)
        if op in ("linear", "conv"):
            return mod(mod(h)) if s.arg[-1] else mod(h)  # a module called twice
        if self.leaky is not None and op in RELU_FORMS[2:]:
            return F.leaky_relu(h, self.leaky, inplace=op in _INPLACE)
        if op == "F.relu":
            return F.relu(h)
        if op == "F.relu_inplace":
            return F.relu(h, inplace=True)
        if op == "torch.relu":
            return torch.relu(h)
        if op == "torch.relu_":
            return torch.relu_(h)
        if op == "method.relu":
            return h.relu()
        if op == "method.relu_":
            return h.relu_()
        if op == "F.silu":
            return F.silu(h)
        if op == "torch.tanh":
            return torch.tanh(h)
        if op == "method.sigmoid":
            return h.sigmoid()
        if op == "torch.sigmoid":
            return torch.sigmoid(h)
        if op == "F.elu":
            return F.elu(h)
        if op == "method.softmax":
            return h.softmax(dim=-1)
        if op == "F.dropout":
            return F.dropout(h, 0.3, training=self.training)
        if op == "affine_":
            return h.mul_(0.5).add_(0.25)
        if op == "add_const":
            return h + 0.5 if s.arg == "op" else torch.add(h, 0.5)
        if op == "scale_param":
            return h * getattr(self, f"p{i}_scale")
        if op == "F.linear":
            return F.linear(h, getattr(self, f"p{i}_w"), getattr(self, f"p{i}_b"))
        if op == "F.conv":
            return F.conv2d(h, getattr(self, f"p{i}_w"), getattr(self, f"p{i}_b"), padding=1)
        if op == "F.layer_norm":
            return F.layer_norm(h, (s.arg,))
        if op == "se":
            return h * h.mean(dim=s.arg, keepdim=True).sigmoid()
        if op == "maxpool":
            return mod(h) if mod is not None else F.max_pool1d(h, 2)
        if op == "avgpool":
            return mod(h) if mod is not None else F.avg_pool1d(h, 2)
        if op == "adaptive":
            return F.adaptive_avg_pool2d(h, 1)
        if op == "flatten":
            if s.arg == "module":
                return mod(h)
            if s.arg == "torch":
                return torch.flatten(h, 1)
            if s.arg == "view":
                return h.reshape(h.size(0), -1)
            return h.flatten(1)
        if op == "to3d":
            return h.flatten(2) if s.arg == 4 else h.unsqueeze(-1)
        if op == "to4d":
            return h.unsqueeze(-1)
        if op == "permute":
            out = h.permute(0, 1, 3, 2) if s.arg[0] == 4 else h.transpose(1, 2)
            return out.contiguous() if s.arg[1] else out
        if op == "add":
            a, b = xs
            return a + b if s.arg == "op" else (torch.add(a, b) if s.arg == "torch" else a.add(b))
        if op == "mul":
            return xs[0] * xs[1]
        if op == "cat":
            return torch.cat(xs, dim=1)
        raise AssertionError(f"unknown op {op}")


    def _faithful(self, i: int, op: str, h: Tensor) -> Tensor:
        if op == "fn.ste":
            return _STE.apply(h)
        if op == "fn.reverse":
            return _Reverse.apply(h, 0.5)
        if op == "fn.pair":
            a, b = _Pair.apply(h)
            return a + b
        scale = getattr(self, f"p{i}_scale", None)
        if op == "no_grad":  # a target computed without gradients (an EMA teacher's output)
            with torch.no_grad():
                t = h * scale
            return h + t
        if op == "enable_grad":
            with torch.no_grad():
                with torch.enable_grad():
                    t = h * scale
            return h - t
        if op == "set_grad":
            with torch.set_grad_enabled(False):
                t = (h * scale).tanh()
            return h * t
        if op == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                t = F.linear(h.float(), getattr(self, f"p{i}_w").float())
            return h + t.to(h.dtype)
        if op == "train_branch":
            return h * 1.5 + 0.1 if self.training else h - 0.2
        raise AssertionError(f"unknown op {op}")


def _out_shape(op: str, arg: Any, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    shape = shapes[0]
    if op == "linear":
        return (*shape[:-1], shape[-1] if arg[-1] else arg[0])
    if op == "F.linear":
        return (*shape[:-1], arg)
    if op == "conv":
        return (shape[0], shape[1] if arg[-1] else arg[0], *shape[2:])
    if op == "F.conv":
        return (shape[0], arg, *shape[2:])
    if op in ("maxpool", "avgpool"):
        return (*shape[:2], *(d // 2 for d in shape[2:]))
    if op == "adaptive":
        return (*shape[:2], 1, 1)
    if op == "flatten":
        return (shape[0], math.prod(shape[1:]))
    if op == "to3d":
        return (*shape[:2], math.prod(shape[2:])) if len(shape) == 4 else (*shape, 1)
    if op == "to4d":
        return (*shape, 1)
    if op == "permute":
        return (*shape[:2], shape[3], shape[2]) if len(shape) == 4 else (shape[0], shape[2], shape[1])
    if op == "cat":
        return (shape[0], shapes[0][1] + shapes[1][1], *shape[2:])
    return shape


def _candidates(shape: tuple[int, ...], fresh_safe: bool, steps_left: int, faithful: bool = False) -> list[str]:
    """Ops that can follow a value of ``shape``."""
    nd = len(shape)
    if faithful:
        return [*FAITHFUL_OPS, *FAITHFUL_OPS, "linear", "relu_mod", "F.dropout", "dropout_mod", "add_const",
                *(["bn"] if nd in (2, 3) else []), *(["conv", "bn"] if nd == 4 else [])]
    ops = ["relu_mod", "F.relu", "torch.relu", "method.relu", *_ACTS, "dropout_mod", "F.dropout", "linear",
           "F.linear", "ln", "F.layer_norm", "add_const", "scale_param", "se"]
    if fresh_safe:
        ops += ["relu_mod_inplace", "F.relu_inplace", "torch.relu_", "method.relu_", "affine_"]
    if nd in (2, 3):
        ops.append("bn")
    if nd == 3:
        ops += ["conv", "to4d", "permute"]
        if shape[2] >= 2:
            ops += ["maxpool", "avgpool"]
    if nd == 4:
        ops += ["conv", "F.conv", "bn", "adaptive", "to3d", "permute", "flatten"]
        if min(shape[2:]) >= 2:
            ops += ["maxpool", "avgpool"]
    if nd == 3:
        ops += ["flatten", "gn"]
    if nd == 4:
        ops.append("gn")
    if nd == 2 and shape[1] <= 16:
        ops.append("to3d")
    return ops


@st.composite
def model_specs(draw: Any, max_steps: int = 7, fusable: bool = False, faithful: bool = False) -> ModelSpec:
    """Random valid ``ModelSpec`` s: 1..max_steps ops over 2-d, 3-d or 4-d float inputs.

    ``fusable=True`` follows a conv or linear by a batch-norm half of the time (for ``Fuse``).
    ``faithful=True`` draws mostly ``FAITHFUL_OPS`` (see the module docstring), a counter in the
    root's forward now and then, and hooks on the root.
    """
    nd = draw(st.sampled_from([2, 3, 4]))
    batch = 2
    chans = draw(st.integers(1, 4))
    spatial = [draw(st.sampled_from([1, 2, 3, 4, 5])) for _ in range(nd - 2)]
    in_shape = (batch, chans + (2 if nd == 2 else 0), *spatial)
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float64]))
    shapes: list[tuple[int, ...]] = [in_shape]
    producers: list[str] = ["input"]
    steps: list[Step] = []
    for _ in range(draw(st.integers(1, max_steps))):
        last = len(shapes) - 1
        # usually extend the newest value; sometimes branch from an earlier one
        src = last if draw(st.booleans()) or last == 0 else draw(st.integers(0, last))
        shape = shapes[src]
        fresh = src == last and producers[src] in _SAFE_PRODUCERS and src > 0
        binary = [j for j in range(len(shapes)) if j != src and len(shapes[j]) == len(shape)]
        same = [j for j in binary if shapes[j] == shape]
        catable = [j for j in binary if shapes[j][0] == shape[0] and shapes[j][2:] == shape[2:] and len(shape) > 1]
        ops = _candidates(shape, fresh, 0, faithful and draw(st.integers(0, 3)) > 0)
        ops += [o for o in ("linear", "conv") if o in ops]  # weight the layers transforms act on
        if src == last and producers[src] in ("conv", "F.conv", "linear") and "bn" in ops:
            ops += ["bn", "bn", "bn"]  # conv/linear -> batch-norm: what Fuse folds
        if same:
            ops += ["add", "add", "mul"]
        if catable:
            ops.append("cat")
        if fusable and src == last and producers[src] in ("conv", "linear") and "bn" in ops and draw(st.booleans()):
            op = "bn"
        elif fusable and draw(st.integers(0, 2)) == 0:
            op = draw(st.sampled_from([o for o in ("conv", "linear") if o in ops]))
        else:
            op = draw(st.sampled_from(ops))
        inputs: tuple[int, ...] = (src,)
        arg: Any = None
        if op in ("add", "mul"):
            inputs = (src, draw(st.sampled_from(same)))
            arg = draw(st.sampled_from(["op", "torch", "method"]))
        elif op == "cat":
            inputs = (src, draw(st.sampled_from(catable)))
        elif op == "linear":
            arg = (draw(st.integers(1, 6)), draw(st.booleans()))
        elif op == "F.linear":
            arg = draw(st.integers(1, 6))
        elif op == "conv":
            arg = (draw(st.integers(1, 5)), draw(st.sampled_from([1, 3])), draw(st.booleans()))
        elif op == "F.conv":
            arg = draw(st.integers(1, 4))
        elif op == "gn":
            arg = draw(st.sampled_from([g for g in (1, 2, 3, 4) if shape[1] % g == 0]))
        elif op == "flatten":
            arg = draw(st.sampled_from(["module", "torch", "view", "method"]))
        elif op == "permute":
            arg = (len(shape), draw(st.booleans()))
        elif op == "to3d":
            arg = len(shape)
        elif op == "se":
            arg = tuple(range(2, len(shape))) or (1,)
        elif op == "F.layer_norm":
            arg = shape[-1]
        elif op == "add_const":
            arg = draw(st.sampled_from(["op", "torch"]))
        out = _out_shape(op, arg, [shapes[j] for j in inputs])
        if math.prod(out) > 4096:
            continue
        steps.append(Step(op, inputs, arg))
        shapes.append(out)
        producers.append(op)
    if not steps:
        steps.append(Step("F.relu", (0,)))
        shapes.append(in_shape)
    n_out = draw(st.integers(1, min(3, len(steps))))
    later = list(range(1, len(shapes) - 1))
    outputs = (len(shapes) - 1, *draw(st.lists(st.sampled_from(later), min_size=0, max_size=n_out - 1, unique=True))) \
        if later else (len(shapes) - 1,)
    fmt = draw(st.sampled_from(["tensor", "tuple", "dict", "nested", "with_int"]))
    if fmt == "nested" and len(outputs) < 2:
        fmt = "dict"
    seed = draw(st.integers(0, 2**16))
    spec = ModelSpec(in_shape, dtype, steps, outputs, fmt, seed, shapes)
    if faithful:
        spec.root_counter = draw(st.integers(0, 5)) == 0
        spec.root_hooks = tuple(draw(st.lists(st.sampled_from(["pre", "post", "log"]), max_size=2, unique=True)))
    return spec


class KeywordFuzzModel(FuzzModel):
    """A ``FuzzModel`` whose forward also takes an optional keyword (``scale=``), as real models take
    ``labels=`` or ``attention_mask=``: a call may bring a keyword the example inputs did not."""

    def forward(self, x: Tensor, scale: float | None = None) -> Any:  # type: ignore[override]
        if scale is not None:
            x = x * scale
        return super().forward(x)


def build(spec: ModelSpec, leaky: float | None = None, keyword: bool = False) -> FuzzModel:
    """The model for ``spec``, its parameters (and batch-norm statistics) drawn from its seed."""
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = (KeywordFuzzModel if keyword else FuzzModel)(spec, leaky)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.running_mean.normal_(0, 0.3)
                    m.running_var.uniform_(0.5, 2.0)
                    m.weight.normal_(1, 0.3)
                    m.bias.normal_(0, 0.3)
        log = model.hook_log
        for kind in spec.root_hooks:
            if kind == "pre":
                model.register_forward_pre_hook(lambda m, args: (args[0] * 0.75,))
            elif kind == "post":
                model.register_forward_hook(lambda m, args, out: _scaled(out, 2.0))
            else:
                model.register_forward_hook(lambda m, args, out: log.append(1))
        return model


def _scaled(out: Any, k: float) -> Any:
    """Every floating tensor in a (nested) output times ``k`` (a hook that changes the numbers)."""
    if isinstance(out, Tensor):
        return out * k if out.is_floating_point() else out
    if isinstance(out, dict):
        return {key: _scaled(v, k) for key, v in out.items()}
    if isinstance(out, tuple):
        return tuple(_scaled(v, k) for v in out)
    return out


def flat_tensors(out: Any) -> list[Tensor]:
    """Every tensor in a (nested) model output, in a fixed order."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in flat_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat_tensors(o)]
    return []
