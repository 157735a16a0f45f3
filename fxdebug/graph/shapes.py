"""What each node produces on the example inputs: ``TensorSpec`` and the shape run.

One run of the graph on (cloned) example inputs, instrumentation skipped, buffers and RNG
restored, records a spec per node and writes shape/dtype/device into ``node.meta["fxdebug"]``
as it goes, so an error later in the run can cite the shapes before it. An op that fails becomes
a typed error naming the node (``diagnose.op_failure``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Interpreter, Node

from fxdebug.graph.diagnose import op_failure
from fxdebug.errors import FxDebugError
from fxdebug.graph.inputs import CallInputs, bind_inputs, clone_inputs, preserved_state
from fxdebug.graph.meta import is_instrumentation, node_meta

__all__ = ["TensorSpec", "learn_specs", "spec_of"]


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
        if (n.target if n.op == "call_method" else getattr(n.target, "__name__", None)) == "register_hook":
            # a tensor hook (Dynamo's graphs keep it as an op returning the tensor): nothing to learn, and under
            # no_grad torch refuses it
            return None if n.op == "call_method" else self.fetch_args_kwargs_from_env(n)[0][0]
        try:
            value = super().run_node(n)
        except FxDebugError:
            raise
        except Exception as exc:
            args = self.fetch_args_kwargs_from_env(n)[0] if n.op != "placeholder" else ()
            raise op_failure(n, exc, args, when="running the example inputs") from exc
        spec = self.specs[n.name] = spec_of(value)
        if isinstance(spec, TensorSpec):  # written as we go, so an error later can cite it
            meta = node_meta(n)
            meta.shape, meta.dtype, meta.device = spec.shape, str(spec.dtype).replace("torch.", ""), str(spec.device)
        return value


def learn_specs(gm: GraphModule, inputs: CallInputs) -> dict[str, Any]:
    """``{node name: spec}`` from one run of ``gm`` on clones of ``inputs``; the model is unchanged."""
    recorder = _SpecRecorder(gm)
    values = clone_inputs(bind_inputs(gm, *inputs))
    with preserved_state(gm), torch.no_grad():
        recorder.run(*values)
    return recorder.specs
