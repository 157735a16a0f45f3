"""What one report over every live capture needs beyond merging rows: call indices in the module's time
order, the origin's facts from the capture that holds it, and notes on the arguments a capture pinned."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from torch import nn

from fxdebug.graph.meta import graph_record
from fxdebug.render.joined import JoinedParts
from fxdebug.report.report import Report, _grad_producers, _nonfinite_params
from fxdebug.runtime.columns import ORIGIN


def _origin_facts(merged: Report, reports: list[tuple[Report, Any]]) -> None:
    """What the merged rows alone cannot say, read from the capture whose graph holds the origin node:
    the users whose backward made the first non-finite gradient (``nonfinite_grad_from``), and the
    non-finite weights the forward origin's op reads (``nonfinite_params``: in a Dynamo graph they are
    ``get_attr`` inputs of ``torch.linear``, not a module's). A saved capture gives what it said then."""
    entered, origin = merged.first_nonfinite_grad, merged.first_nonfinite
    for rep, part in reports:
        nodes = {} if isinstance(part, dict) else {n.name: n for n in part.graph.nodes}
        if entered is not None and not merged.nonfinite_grad_from:
            if entered in nodes:
                merged.nonfinite_grad_from = _grad_producers(entered, nodes)
            elif rep.first_nonfinite_grad == entered:
                merged.nonfinite_grad_from = list(rep.nonfinite_grad_from)
        if origin is not None and not merged.nonfinite_params:
            if origin in nodes:
                merged.nonfinite_params = _nonfinite_params(part, nodes[origin])
            elif rep.first_nonfinite == origin:
                merged.nonfinite_params = list(rep.nonfinite_params)


def _global_calls(report: Report, calls: list[int]) -> None:
    """Rewrite a graph's call indices (its ``ORIGIN`` columns) as the live module's: first NaN across captures.

    Each graph counts its own calls; after a recompile or a graph break, graph B's call 0 may be the
    module's call 5. The host list of the module's call index at each of the graph's calls (one int
    per call, no device read) maps them, so the earliest non-finite value is found in time order.
    """
    keys = [c.key for c in report.columns_with(ORIGIN)]
    for row in report.rows:
        for key in keys:
            value = row.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(calls):
                row[key] = calls[value]


def _note_none_arguments(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], notes: list[str]) -> None:
    """A note naming the forward's arguments that were ``None`` in a call that captured: the graphs hold
    that branch (a symbolic trace pins them; Dynamo guards on them and captures again when one is given)."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return
    bound.apply_defaults()
    none = [k for k, v in bound.arguments.items() if v is None]
    if not none:
        return
    names = ", ".join(none)
    note = (f"dynamo: captured with {names} None (each graph holds the None branch; Dynamo guards on it: a call "
            f"that passes {'them' if len(none) > 1 else 'it'} is captured again, into the same rows)")
    if note not in notes:
        notes.append(note)


_FAST_PATH_MODULES = (nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.MultiheadAttention)


def _note_fast_paths(model: nn.Module, notes: list[str]) -> None:
    """A note for each fused-fast-path module of ``model`` that eager PyTorch would run fused in a call like this
    one (eval, no gradient wanted, fast path on): Dynamo traces the standard path instead, as
    ``torch.compile(model)`` does. The values agree at every real position; where a padding mask hides a
    position, eager's fast path writes 0 and the captured graph writes what the standard path computes."""
    from fxdebug.capture.faithful_reads import would_take_fast_path

    outer = [(path, m) for path, m in model.named_modules() if isinstance(m, _FAST_PATH_MODULES)]
    inside = {id(sub) for _, m in outer for sub in m.modules() if sub is not m}
    for path, module in outer:
        if id(module) in inside or not would_take_fast_path(module):
            continue
        note = (f"dynamo: {type(module).__name__} at '{path or type(model).__name__}' would take PyTorch's fused fast "
                "path in eager (eval, no gradient); the captured graphs run its standard path, as torch.compile(model) "
                "does: outputs agree at real positions, but positions a padding mask hides hold computed values where "
                "eager writes 0 (mask them out before comparing or reducing)")
        if note not in notes:
            notes.append(note)


def joined_parts(dbg: Any) -> JoinedParts | None:
    """A live module's parts as one picture joins them (``render.joined``), or ``None`` when it holds one graph or
    none of its graphs took another's output while ``instrument()`` ran (then its largest graph is drawn)."""
    state = dbg._live_state
    if len(state.parts) < 2 or not state.feeds:
        return None
    return JoinedParts(dbg.parts(), state.feeds, type(dbg._model).__name__)


def merged_pass_results(dbg: Any) -> list[Any]:
    """Each pass's ``PassResult`` over every captured graph (its nodes added, removed and replaced in all of them, its
    notes once; ``seconds`` the first graph's). A capture in several graphs (block regions, graph breaks) reported
    the first graph's alone, so ``dbg.pass_results[0].added`` missed every node the pass added in the others."""
    top = graph_record(dbg).passes
    per_part = [graph_record(p).passes for p in dbg.parts().values()]
    per_part = [r for r in per_part if r]
    if len(per_part) < 2:
        return top
    out = []
    for i, first in enumerate(per_part[0]):
        same = [r[i] for r in per_part if i < len(r) and r[i].pass_name == first.pass_name]
        out.append(dataclasses.replace(
            first, added=[n for r in same for n in r.added], removed=[n for r in same for n in r.removed],
            replaced={k: v for r in same for k, v in r.replaced.items()},
            notes=list(dict.fromkeys(n for r in same for n in r.notes))))
    return out
