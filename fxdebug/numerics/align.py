"""``align``: two *different* implementations of one model, matched op by op by their values; the
first op where they part.

``fxdebug.diff`` aligns runs of one graph. ``align`` takes two models that should compute the same
function — a port and its reference, a hand-written LLaMA and Hugging Face's, SDPA against eager
attention, one fused qkv projection against three — runs each once (``align_record``: every aten
op's output and the module that ran it) and matches the two recordings by value, not by name:

1. **Layout-free candidates.** Each op's mean, rms and mean |x| are a fingerprint no reshape,
   transpose or permutation changes, and each moves by at most ``‖c − r‖₂ / √n``: how far they
   differ over the rms is a lower bound of the relative error in any layout. Ops of equal size
   whose bound is within tolerance are candidates, tried best bound first; the search stops when
   the next bound exceeds the best verified error.
2. **Verification.** A candidate op matches a reference op when a real relative error
   ``‖c − r‖₂ / ‖r‖₂`` is within tolerance: in the same shape (``"same"``), or after a reshape or a
   permutation of the dims of either side (``"transposed/reshaped"``). Failing that, a slice along
   one dim of a larger reference op (``"slice of fused"``: one of q/k/v against a fused qkv
   projection), or the sum of two or three reference ops (``"sum of several"``, found with random
   projections, which add up). A candidate op that is fused where the reference is not — all its
   consumers are matched slices of it — is ``"fused (slices match)"``. Views and copies inherit
   their input's match.
3. **The first divergence** is the earliest candidate op with no match whose effect reaches the
   output through ops with no match either, and that reads agreed values (a matched op, a
   parameter or an input) — an op the reference merely computes differently (eager softmax inside
   SDPA) is followed by matched ops again and is no divergence, so there is none exactly when the
   outputs agree. Its reference counterpart is the reference's own first op that nothing in the
   candidate reproduces (same rule, mirrored), looked for first inside the reference module that
   the candidate op's module corresponds to (where that module's matched ops matched).

Masking values (``|x| >= 1e30``: ``finfo.min`` added to a score) count as ``±inf``, so a mask
written with ``-inf`` and one written with the dtype's lowest number agree.

The tolerance is a **dtype-aware noise floor**: the precision each run was *set up* with (its
float parameters, float inputs and any autocast dtype, see ``align_record``) — the coarser of the
two —, ``FLOOR × eps × √depth``, where depth counts the arithmetic ops on the longest path from
the inputs (rounding errors add up like a random walk). An fp32 run against a bf16-autocast run is
judged at bf16's floor; an op that quietly computes in bf16 inside an fp32 run is judged at fp32's.
``rtol`` replaces the floor; ``atol`` (default 0) is added per element, for tensors near zero.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from fxdebug.errors import ArgumentTypeError, UsageError
from fxdebug.graph.inputs import Inputs, normalize_inputs
from fxdebug.numerics.align_match import FLOOR, _Matcher
from fxdebug.numerics.align_record import Trace, record
from fxdebug.numerics.tensors import device_of

__all__ = ["FLOOR", "AlignRow", "Alignment", "Divergence", "align"]


@dataclass(frozen=True)
class Divergence:
    """Where two implementations part.

    Attributes:
        reference: ``(node name, module path)`` of the reference op the candidate should have
            reproduced there (its closest unmatched counterpart).
        candidate: ``(node name, module path)`` of the first candidate op that matches nothing in
            the reference and whose effect reaches the output.
        error: relative error ``‖c − r‖₂ / ‖r‖₂`` between the two (in the layout that fits best; for
            ops no layout lines up, such as ops of different sizes, how far their mean, rms and mean |x|
            differ over the reference's rms).
        tolerance: the noise floor it exceeded.
        op: the candidate's aten op.
    """

    reference: tuple[str | None, str | None]
    candidate: tuple[str, str]
    error: float
    tolerance: float
    op: str

    def __str__(self) -> str:
        ref = f"{self.reference[0]} in {_where(self.reference[1])}" if self.reference[0] else "nothing"
        return (f"candidate {self.candidate[0]} ({self.op}) in {_where(self.candidate[1])} first departs from the reference "
                f"(counterpart {ref}): relative error {self.error:.3g}, noise floor {self.tolerance:.3g}")


def _where(module: str | None) -> str:
    return "the top-level forward" if module == "" else repr(module)


@dataclass(frozen=True)
class AlignRow:
    """One matched pair: a candidate op and the reference op(s) whose values it reproduces.

    ``reference`` is one ``(node, module)``; ``references`` lists them all (several for
    ``"sum of several"`` and ``"fused (slices match)"``). ``match`` is how it was matched,
    ``error`` the relative error, ``tolerance`` the floor it was judged at."""

    candidate: tuple[str, str]
    reference: tuple[str, str]
    match: str
    error: float
    tolerance: float
    op: str
    shape: tuple[int, ...]
    references: tuple[tuple[str, str], ...] = ()


class Alignment:
    """Two implementations matched op by op (see ``fxdebug.numerics.align``).

    Attributes:
        first_divergent: ``None`` when the candidate reproduces the reference within the noise
            floor, else a ``Divergence`` (``.reference``, ``.candidate``: (node, module path);
            ``.error``).
        rows: the matched pairs (``AlignRow``), in the candidate's execution order.
        unmatched: ``(node, module path)`` of candidate ops that match nothing (most are harmless:
            intermediates the reference computes inside a fused op).
        eps: the machine epsilon of the coarser of the two runs' set-up precision.
    """

    def __init__(self, ref: Trace, cand: Trace, matcher: _Matcher, first: Divergence | None) -> None:
        self._ref, self._cand, self._m = ref, cand, matcher
        self.first_divergent = first
        self.eps = matcher.eps
        self.rtol = matcher.rtol
        self.dtypes = (ref.dtype, cand.dtype)
        self.rows: list[AlignRow] = []
        for c in cand.ops:
            m = matcher.matches.get(c.index)
            if m is None or c.layout_of is not None:
                continue
            refs = tuple((ref.ops[j].name, ref.ops[j].module) for j in m.refs)
            self.rows.append(AlignRow((c.name, c.module), refs[0], m.kind, m.error, m.tol, c.op,
                                      tuple(c.value.shape), refs))
        self.unmatched = [(c.name, c.module) for c in cand.ops if c.index not in matcher.matches and c.layout_of is None]

    # ------------------------------------------------------------------ reading
    def table(self, max_rows: int = 200) -> str:
        head = (f"fxdebug align — {len(self.rows)} matched candidate ops, {len(self.unmatched)} unmatched, "
                f"noise floor {FLOOR:g}·eps·√depth (eps {self.eps:.3g}: {self.dtypes[0]} vs {self.dtypes[1]})"
                if self.rtol is None else
                f"fxdebug align — {len(self.rows)} matched candidate ops, {len(self.unmatched)} unmatched, rtol {self.rtol:g}")
        lines = [head, f"first divergent: {self.first_divergent or 'none — the candidate reproduces the reference'}"]
        cols = ("candidate", "module", "reference", "ref module", "match", "error", "floor")
        cells = [[r.candidate[0], r.candidate[1], "+".join(n for n, _ in r.references), r.reference[1], r.match,
                  f"{r.error:.3g}", f"{r.tolerance:.3g}"] for r in self.rows[:max_rows]]
        if self.first_divergent is not None:
            d = self.first_divergent
            cells.append([d.candidate[0], d.candidate[1], str(d.reference[0]), str(d.reference[1]), "DIVERGES",
                          f"{d.error:.3g}", f"{d.tolerance:.3g}"])
        widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
        if len(self.rows) > max_rows:
            lines.insert(-1 if self.first_divergent else len(lines), f"... {len(self.rows) - max_rows} more rows")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        first = None if self.first_divergent is None else self.first_divergent.candidate
        return f"Alignment({len(self.rows)} matched, {len(self.unmatched)} unmatched, first_divergent={first!r})"

    # ------------------------------------------------------------------ drawing
    def graph(self, side: str = "candidate") -> Any:
        """The recorded graph of one side (``"reference"`` or ``"candidate"``) as an aten-level
        ``GraphModule`` (for drawing; its nodes carry the names used in ``rows``)."""
        from fxdebug.numerics.align_draw import trace_graph

        gm = trace_graph(self._side(side))
        object.__setattr__(gm, "fxdebug_align_side", "reference" if self._side(side) is self._ref else "candidate")
        return gm

    def for_graph(self, gm: Any) -> Any:
        """What ``fxdebug.render(gm, path, diff=alignment)`` colours ``gm`` by: for a graph from
        ``graph(side)``, that side's per-op error over floor; for another graph of one of the two
        models (``fxdebug.trace(model)``'s), the worst score of each node's module, and the first
        node of the divergent module highlighted."""
        from fxdebug.numerics.align_draw import SideDiff

        side = getattr(gm, "fxdebug_align_side", None)
        return SideDiff.of(self, side) if side is not None else SideDiff.for_fx(self, gm)

    def side(self, side: str = "candidate") -> Any:
        """What ``fxdebug.render(al.graph(side), path, diff=al.side(side))`` colours by: each
        node's error over its noise floor; unmatched ops on the divergent path count as diverged."""
        from fxdebug.numerics.align_draw import SideDiff

        return SideDiff.of(self, side)

    def render(self, path_prefix: str | os.PathLike[str], ext: str = "svg", **options: Any) -> tuple[str, str]:
        """Draw both recorded graphs, coloured by the alignment: ``<prefix>.reference.svg`` and
        ``<prefix>.candidate.svg`` (the first divergence highlighted on each; ``ext="html"`` writes
        the viewer, opened as a heat map of error over noise floor). ``options`` go to ``render``
        (``depth``, ``fold``). Returns the two paths."""
        from fxdebug.render.draw import render as draw

        prefix = os.fspath(path_prefix)
        out = []
        for side in ("reference", "candidate"):
            out.append(draw(self.graph(side), f"{prefix}.{side}.{ext}", diff=self.side(side), **options))
        return out[0], out[1]

    def _side(self, side: str) -> Trace:
        if side in ("reference", "a", "ref"):
            return self._ref
        if side in ("candidate", "b", "cand"):
            return self._cand
        raise UsageError(f"side={side!r}: 'reference' or 'candidate'.")


def align(reference: nn.Module, candidate: nn.Module, example_inputs: Any, *, candidate_inputs: Any = None,
          rtol: float | None = None, atol: float | None = None) -> Alignment:
    """Run ``reference`` and ``candidate`` once each and find the first op where they part.

    Args:
        reference: the implementation taken as right.
        candidate: the one under suspicion (another port, a rewrite, an inference engine's model).
        example_inputs: a tensor, a tuple (positional), a dict (keywords) or ``fxdebug.Inputs``.
        candidate_inputs: the candidate's inputs when they differ in layout or device (default:
            ``example_inputs``, moved to the candidate's device when it lives elsewhere).
        rtol: relative tolerance replacing the dtype-aware noise floor.
        atol: absolute tolerance per element (default 0).

    Each model runs once, in eval mode, under ``no_grad``, on its own device; training flags,
    buffers and random streams are put back afterwards. See the module docstring for the method.
    """
    for name, m in (("reference", reference), ("candidate", candidate)):
        if not isinstance(m, nn.Module):
            hint = " (it is a class: instantiate it first)" if isinstance(m, type) else ""
            raise ArgumentTypeError(f"align(): {name} must be an nn.Module; got {type(m).__name__}{hint}.")
    if rtol is not None and not rtol >= 0:
        raise UsageError(f"align(rtol={rtol!r}): a relative tolerance >= 0, or None for the dtype-aware floor.")
    if atol is not None and not atol >= 0:
        raise UsageError(f"align(atol={atol!r}): an absolute tolerance >= 0.")
    if candidate_inputs is None:
        candidate_inputs = _to_device(example_inputs, _param_device(candidate))
    ref = _record("reference", reference, example_inputs)
    cand = _record("candidate", candidate, candidate_inputs)
    if not ref.ops or not cand.ops:
        which = "reference" if not ref.ops else "candidate"
        raise UsageError(f"align(): the {which} ran no tensor op on the example inputs; nothing to align.")
    matcher = _Matcher(ref, cand, rtol, atol or 0.0)
    matcher.run()
    first_i = matcher.first_divergent()
    first = None
    if first_i is not None:
        c = cand.ops[first_i]
        j, err, tol = matcher.counterpart(first_i)
        r = ref.ops[j] if j is not None else None
        first = Divergence((r.name, r.module) if r else (None, None), (c.name, c.module), err, tol, c.op)
    return Alignment(ref, cand, matcher, first)


def _record(which: str, model: nn.Module, inputs: Any) -> Trace:
    try:
        return record(model, inputs)
    except Exception as e:
        hint = (" When the candidate takes its inputs in another layout (or on another device), pass them as "
                "candidate_inputs=." if which == "candidate" else "")
        raise UsageError(f"align(): the {which} ({type(model).__name__}) failed on its example inputs: "
                         f"{type(e).__name__}: {e}.{hint}") from e


def _param_device(model: nn.Module) -> torch.device | None:
    for p in itertools.chain(model.parameters(), model.buffers()):
        return p.device
    return None


def _to_device(inputs: Any, device: torch.device | None) -> Any:
    if device is None or device_of(normalize_inputs(inputs)) == device:
        return inputs
    if isinstance(inputs, Inputs):
        return Inputs(*tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, inputs.args),
                      **tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, inputs.kwargs))
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, inputs)
