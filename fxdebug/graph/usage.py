"""Checks that turn a user's silent mistake into a sentence: options, example inputs, ``where=``.

Accepting a mistake silently is a bug too: an extra example input that the model never sees, a
``where=`` pattern that matches no node (so the pass does nothing), or a mistyped option name
that surfaces as a ``TypeError`` of some inner function. Each check here names what was given,
what was expected, and what to do.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterable, Mapping, Sequence

from torch import nn
from torch.fx import GraphModule

from fxdebug.errors import UsageError
from fxdebug.graph.meta import is_instrumentation, module_path
from fxdebug.graph.select import matches

__all__ = ["check_example_inputs", "check_options", "check_where_matched", "where_matches"]


def check_options(fn: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """Raise for an unknown keyword option, suggesting the closest known one."""
    allowed = sorted(set(allowed))
    for name in given:
        if name in allowed:
            continue
        close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]}=?" if close else f" Known options: {', '.join(allowed)}."
        raise UsageError(f"{fn}() got an unknown option {name}=.{hint}")


def check_example_inputs(model: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]] | None) -> None:
    """The example inputs must bind to ``model.forward``: none extra, no unknown keywords."""
    if inputs is None:
        return
    args, kwargs = inputs
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in params) and any(p.kind == p.VAR_KEYWORD for p in params):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        extra = ""
        if len(args) > len(positional) and not any(p.kind == p.VAR_POSITIONAL for p in params):
            extra = (f" {len(args)} positional example inputs were given but forward takes {len(positional)}; "
                     f"the last {len(args) - len(positional)} would be ignored or misplaced.")
        raise UsageError(
            f"the example inputs do not fit {type(model).__name__}.forward({', '.join(names)}): {exc}.{extra} "
            "Pass exactly the arguments forward takes (a tuple for positional ones, a dict or "
            "fxdebug.Inputs(...) for keywords).") from None


def where_matches(where: Any, gm: GraphModule) -> bool:
    """Whether ``where`` selects at least one of ``gm``'s own (non-instrumentation) nodes."""
    return any(n.op not in ("placeholder", "output") and not is_instrumentation(n) and matches(where, n)
               for n in gm.graph.nodes)


def check_where_matched(passes: Sequence[Any], parts: Mapping[str, GraphModule], *, prefixed: bool = True) -> None:
    """Every pass given ``where=`` must select some node in some part, else it would do nothing.

    ``prefixed=False``: the parts' keys are not module paths (a live capture's ``frame/recompile``)."""
    for p in passes:
        where = getattr(p, "where", None)
        if where is None or any(where_matches(where, part) for part in parts.values()):
            continue
        paths = sorted({".".join(x for x in (path if prefixed else "", module_path(n)) if x)
                        for path, part in parts.items() for n in part.graph.nodes
                        if module_path(n) or (path and prefixed)})
        shown = ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
        raise UsageError(
            f"pass '{getattr(p, 'name', type(p).__name__)}': where={where!r} matches no node, so the pass would do "
            f"nothing. Module paths in this model: {shown or '(none)'}; patterns are globs over module paths "
            "and node names (\"layer1.*\").")
