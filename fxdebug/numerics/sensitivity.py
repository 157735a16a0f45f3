"""``fxdebug.sensitivity``: how much each layer's weights matter, by perturbing them.

The guides' recipe: add small Gaussian noise to one layer's weights, rerun, see how far the
output (or the loss) moves, put the weights back, next layer. Here that is one call. For each
module that owns parameters, every parameter ``w`` of it gets ``noise * rms(w) * N(0, 1)`` (noise
relative to the weights' own scale, so layers of any size compare), the model runs on the example
inputs, and the change is measured:

* without ``loss_fn``: ``||y' - y|| / ||y||`` over every tensor output (relative L2 change);
* with ``loss_fn(outputs, example_inputs)``: ``|L' - L|`` (absolute loss change).

Weights are restored exactly (copied back from a saved clone, bitwise), buffers and the RNG state
too (``preserved_state``), and the model runs in eval mode under ``no_grad`` for the measurement
(its mode is put back). ``repeats`` draws average the noise out; the draws are seeded, so two calls
give the same table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from fxdebug.api import instrument
from fxdebug.errors import MissingInputsError, UsageError
from fxdebug.graph.inputs import normalize_inputs, preserved_state

__all__ = ["Sensitivity", "sensitivity"]


@dataclass
class Sensitivity:
    """Per-module sensitivity, most sensitive first in ``ranked()``; ``rows`` are in module order.

    Each row: ``module``, ``type``, ``params`` (elements), ``change`` (see the module docstring) and
    ``share`` (change over the largest change: 1.0 for the most sensitive module).
    """

    rows: list[dict[str, Any]]
    metric: str
    noise: float
    baseline: float
    model: Any = field(default=None, repr=False)
    example_inputs: Any = field(default=None, repr=False)

    def ranked(self) -> list[dict[str, Any]]:
        return sorted(self.rows, key=lambda r: -r["change"])

    def __getitem__(self, module: str) -> dict[str, Any]:
        for r in self.rows:
            if r["module"] == module:
                return r
        raise KeyError(f"no sensitivity row for module {module!r}; modules: {[r['module'] for r in self.rows][:20]}")

    def table(self) -> str:
        """An aligned text table, most sensitive first."""
        what = "relative output change" if self.metric == "output" else "loss change"
        head = [f"sensitivity — {what} under Gaussian weight noise of {self.noise:g} x rms(w), "
                f"{len(self.rows)} modules (baseline {self.metric} {self.baseline:.4g})"]
        cells = [(r["module"], r["type"], str(r["params"]), f"{r['change']:.3e}", f"{r['share']:.2f}",
                  "#" * max(0, round(20 * r["share"]))) for r in self.ranked()]
        names = ("module", "type", "params", "change", "share", "")
        widths = [max(len(n), *(len(c[i]) for c in cells)) if cells else len(n) for i, n in enumerate(names)]
        lines = head + ["  ".join(n.ljust(w) for n, w in zip(names, widths)).rstrip(),
                        "  ".join("-" * w for w in widths[:-1])]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def render(self, path: str, **options: Any) -> str:
        """The model's graph with each module's ``sensitivity`` share on its node (a ``COLOR``
        column: modules at or above half the largest change are marked as hot spots)."""
        if self.model is None:
            raise UsageError("this Sensitivity was built without its model; call fxdebug.sensitivity(model, ...).")
        shares = {r["module"]: r["share"] for r in self.rows}
        dbg = instrument(self.model, [_ShareAnnotation(shares)], example_inputs=self.example_inputs)
        bound = normalize_inputs(self.example_inputs)
        assert bound is not None, "a Sensitivity is built from example inputs"
        args, kwargs = bound
        with preserved_state(self.model), torch.no_grad():
            dbg(*args, **kwargs)
        return dbg.render(path, **options)


def _owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that own parameters directly (``recurse=False``), in registration order."""
    return [(name, m) for name, m in model.named_modules()
            if name and any(True for _ in m.parameters(recurse=False))] or (
        [("", model)] if any(True for _ in model.parameters(recurse=False)) else [])


def _flat(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return [t for v in getattr(value, "__dict__", {}).values() for t in _flat(v)] if hasattr(value, "to_tuple") else []


def _measure(outputs: Any, reference: list[Tensor] | None, loss_fn: Any, example: Any, base_loss: float | None) -> float:
    if loss_fn is not None:
        return abs(float(loss_fn(outputs, example)) - float(base_loss))  # type: ignore[arg-type]
    outs = [t.double() for t in _flat(outputs) if t.is_floating_point()]
    assert reference is not None
    num = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(outs, reference)))
    den = math.sqrt(sum(float(b.pow(2).sum()) for b in reference)) or 1.0
    return num / den


def sensitivity(model: nn.Module, example_inputs: Any, *, noise: float = 0.01,
                loss_fn: Callable[[Any, Any], Tensor] | None = None, repeats: int = 3,
                modules: Sequence[str] | None = None, seed: int = 0) -> Sensitivity:
    """Per-module change of the output (or loss) under Gaussian weight noise; weights restored exactly.

    Args:
        model: any ``nn.Module`` (an ``Instrumented`` one works too: its parameters are the model's).
        example_inputs: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
        noise: the noise's standard deviation relative to each parameter's RMS.
        loss_fn: ``loss_fn(outputs, example_inputs) -> scalar``: measure the loss change instead.
        repeats: noise draws per module, averaged.
        modules: only these module paths (default: every module owning parameters).
        seed: seeds the noise draws.
    """
    from fxdebug.graph.inputs import normalize_inputs, preserved_state

    if not isinstance(model, nn.Module):
        raise UsageError(f"sensitivity() needs an nn.Module; got {type(model).__name__}.")
    if not (isinstance(noise, (int, float)) and noise > 0):
        raise UsageError(f"sensitivity(noise={noise!r}): give a positive relative noise level, e.g. 0.01.")
    normalized = normalize_inputs(example_inputs)
    if normalized is None:
        raise MissingInputsError("sensitivity() needs example_inputs to run the model on.")
    args, kwargs = normalized
    owners = _owners(model)
    if modules is not None:
        wanted = set(modules)
        missing = wanted - {n for n, _ in owners}
        if missing:
            raise UsageError(f"sensitivity(modules=...): {sorted(missing)} own no parameters; modules that do: "
                             f"{[n for n, _ in owners][:20]}.")
        owners = [(n, m) for n, m in owners if n in wanted]
    if not owners:
        raise UsageError(f"{type(model).__name__} has no parameters to perturb.")
    was_training = model.training
    model.eval()
    rows: list[dict[str, Any]] = []
    try:
        with preserved_state(model), torch.no_grad():
            base = model(*args, **kwargs)
            reference = [t.detach().double() for t in _flat(base) if t.is_floating_point()]
            base_loss = float(loss_fn(base, example_inputs)) if loss_fn is not None else None
            gen = torch.Generator().manual_seed(seed)
            for name, mod in owners:
                params = [p for p in mod.parameters(recurse=False) if p.is_floating_point()]
                saved = [p.detach().clone() for p in params]
                changes = []
                try:
                    for _ in range(max(1, repeats)):
                        for p, w in zip(params, saved):
                            scale = float(w.double().pow(2).mean().sqrt()) or 1.0
                            draw = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype)
                            p.copy_(w + noise * scale * draw)
                        changes.append(_measure(model(*args, **kwargs), reference, loss_fn, example_inputs, base_loss))
                finally:
                    for p, w in zip(params, saved):
                        p.copy_(w)  # bitwise: the saved clone
                rows.append({"module": name, "type": type(mod).__name__, "params": sum(p.numel() for p in params),
                             "change": sum(changes) / len(changes)})
    finally:
        model.train(was_training)
    top = max((r["change"] for r in rows), default=0.0)
    for r in rows:
        r["share"] = r["change"] / top if top > 0 else 0.0
    baseline = base_loss if base_loss is not None else math.sqrt(sum(float(t.pow(2).sum()) for t in reference))
    return Sensitivity(rows=rows, metric="loss" if loss_fn is not None else "output", noise=float(noise),
                       baseline=baseline, model=model, example_inputs=example_inputs)


# -- the picture -------------------------------------------------------------------------------
def _share_probe(value: float) -> Any:
    from fxdebug.runtime.columns import COLOR, Column
    from fxdebug.runtime.observer import Probe

    class SensitivityProbe(Probe):
        key = "sensitivity"
        columns = (Column("sensitivity", roles=COLOR, threshold=0.5,
                          doc="change under weight noise, over the most sensitive module's"),)

        def init_state(self, x: Tensor, phase: str) -> dict[str, Any]:
            return {}

        def summary(self, state: dict[str, Any], phase: str) -> dict[str, Any]:
            return {"sensitivity": value}

    return SensitivityProbe()


def _ShareAnnotation(shares: dict[str, float]) -> Any:
    from fxdebug.authoring.pipeline import Pass, PassResult

    class ShareAnnotation(Pass):
        name = "sensitivity"
        observe_only = True

        def run(self, gm: Any, ctx: Any) -> Any:
            from fxdebug.graph.meta import module_path

            # each module's output: its call (symbolic) or the last op it ran (torch.linear in Dynamo and export graphs)
            last: dict[str, Any] = {}
            for node in ctx.nodes(gm, None, tensor_outputs=True):
                path = module_path(node)
                if node.op in ("call_module", "call_function", "call_method") and path in shares:
                    last[path] = node
            added = [ctx.observe(node, _share_probe(shares[path])) for path, node in last.items()]
            return PassResult(gm, added=[a for a in added if a is not None])

    return ShareAnnotation()
