"""One export capture per call signature: a real model must take the inputs the model takes.

``torch.export`` fixes what is not a tensor dimension: which arguments are given, Python values
(``use_cache=True``), and the structure of containers (a KV ``Cache`` that is absent on the
first call of ``generate`` and present on every later one). The dimensions themselves are
captured dynamic (``Dim.AUTO``); a call whose *signature* differs from the example inputs' is
captured again, by the same frontend with the same passes, on that call's own inputs, once per
signature (cached), and noted in ``trace_info``. Each extra capture keeps its own observers
(the runtime's state tables are per graph); ``captures(dbg)`` lists them and their reports.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fxdebug.instrumented.modes import recipe

__all__ = ["captures", "route_call", "signature", "with_signatures"]

_STORE = "_fxdebug_signatures"
_NAME = "_fxdebug_signature_name"


def _kind(value: Any, shapes: bool = False) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape) if shapes else value.dim(), str(value.dtype))
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    leaves, spec = pytree.tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
        return ("object", type(value).__qualname__)
    return ("tree", type(value).__qualname__, len(leaves), tuple(_kind(v, shapes) for v in leaves))


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], shapes: bool = False) -> Any:
    """What an export capture fixes about a call: arity, keyword names, values, container shapes.

    ``shapes=True`` adds every tensor's shape, for captures that could not be made dynamic.
    """
    return (tuple(_kind(a, shapes) for a in args),
            tuple(sorted((k, _kind(v, shapes)) for k, v in kwargs.items())))


def _notes(gm: nn.Module) -> list[str]:
    """The capture's notes (``Instrumented.trace_info.notes``; this module sits below ``instrumented``)."""
    notes: list[str] = getattr(gm, "trace_info").notes
    return notes


def _dynamic(gm: nn.Module) -> bool:
    return any("dynamic dimensions" in n for n in _notes(gm))


def route_call(gm: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module | None:
    """The capture for this call's signature when it is not ``gm``'s own; ``None`` to run ``gm``."""
    rec = recipe(gm)
    if rec is None or rec.frontend != "export" or rec.recapture is None:
        return None
    store = gm.__dict__.get(_STORE)
    if store is None:
        from fxdebug.graph.inputs import normalize_inputs

        base = normalize_inputs(rec.inputs)
        store = gm.__dict__[_STORE] = {"base": signature(*base, shapes=not _dynamic(gm)) if base is not None else None}
    sig, shaped = signature(args, kwargs), signature(args, kwargs, shapes=True)
    if store["base"] in (sig, shaped):
        return None
    other = store.get(shaped) or store.get(sig)
    if other is None:
        from fxdebug.graph.inputs import Inputs

        options = {k: v for k, v in rec.options.items() if k in ("dynamic_batch",)}
        other = rec.recapture(rec.model, "export", rec.passes, Inputs(*args, **kwargs), options)
        store[sig if _dynamic(other) else shaped] = other
        names = sorted(kwargs) if kwargs else [f"{len(args)} positional"]
        other.__dict__[_NAME] = "+".join(n.replace(" ", "_") for n in names)  # its rows read ``node@labels``
        _notes(gm).append(
            f"export: captured again for a call with another signature ({', '.join(names)}); "
            f"{len(store) - 1} extra capture(s), reported by fxdebug.instrumented.recapture.captures(dbg)")
    return other


def with_signatures(gm: nn.Module, report: Any) -> Any:
    """``report`` (of ``gm``'s own graph) with the rows and calls of its captures for other signatures.

    A training loop that always passes ``labels=`` runs only the capture for that signature: without
    these rows the report said 0 calls. Rows of such a capture read ``node@labels``.
    """
    extras = captures(gm)
    if not extras:
        return report
    rows, calls = list(report.rows), report.calls
    first = report.first_nonfinite
    for other in extras:
        rep = other.report()  # type: ignore[operator]
        tag = f"@{other.__dict__.get(_NAME, 'signature')}"
        rows.extend(dict(row, node=f"{row['node']}{tag}") for row in rep.rows)
        calls += rep.calls
        if first is None and rep.first_nonfinite is not None:
            first = f"{rep.first_nonfinite}{tag}"
    return dataclasses.replace(report, rows=rows, calls=calls, first_nonfinite=first)


def captures(gm: nn.Module) -> list[nn.Module]:
    """The extra captures made for calls of other signatures, in the order they were made."""
    store = gm.__dict__.get(_STORE) or {}
    return [v for k, v in store.items() if k != "base"]
