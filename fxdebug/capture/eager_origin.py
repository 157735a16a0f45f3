"""Where a NaN was made when it was made in code fxdebug does not see.

Under the subtrees frontend the root's forward (and every module that could not be captured)
runs eagerly between the captured parts. A NaN made there (``torch.log`` of a negative number in
the root's own forward) first shows up as the *input* of the next captured part, so the report's
origin would be that part's placeholder: true as far as the graphs go, and misleading. This
turns such an origin into what it is: the value was already non-finite when it entered the part,
so it was made in eager code before it, in the forward of the module that called the part.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["explain_eager_origin"]


def explain_eager_origin(dbg: nn.Module, report: Any) -> Any:
    """If ``report``'s NaN/Inf origin is a captured part's input, say that eager code made it."""
    origin = getattr(report, "first_nonfinite", None)
    if not origin or "/" not in origin:
        return report
    path, _, name = origin.rpartition("/")
    part = dbg.parts().get(path)  # type: ignore[operator]
    node = next((n for n in part.graph.nodes if n.name == name), None) if part is not None else None
    if node is None or node.op != "placeholder":
        return report
    owner = path.rpartition(".")[0]
    try:
        typ = type(dbg.get_submodule(owner)).__name__ if owner else getattr(dbg, "_get_name", lambda: "model")()
    except AttributeError:
        typ = "module"
    where = f"'{owner}' ({typ})" if owner else f"the root ({typ})"
    eager = sorted(p or "<root>" for p in getattr(dbg.trace_info, "eager_modules", {}))
    report.first_nonfinite = None
    report.nonfinite_in_eager = owner or "<root>"
    report.notes.append(
        f"NaN/Inf origin: in uninstrumented (eager) code, not in a captured part. Input '{name}' of the captured "
        f"part '{path}' was already non-finite when it arrived, and no captured part had made a NaN/Inf before: "
        f"it was made in the eager forward of {where} before it called '{path}'. Eager modules: "
        f"{', '.join(eager) or 'none'}. To see the op, capture more: move that code into a submodule, or "
        + (f"instrument that module itself (fxdebug.instrument(model.{owner}, ...))." if owner else
           "try frontend='export' for the whole model."))
    return report
