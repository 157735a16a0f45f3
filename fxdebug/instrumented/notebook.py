"""Notebook display of an ``Instrumented`` module: the annotated graph as an inline, static SVG.

Jupyter calls ``_repr_mimebundle_`` on a cell's last value. The bundle holds ``text/plain`` (the
module's repr) and ``image/svg+xml``: the same picture as ``dbg.render("model.svg")``, with the
report's statistics when passes observed something. A static SVG has no script, so it shows in an
untrusted notebook too (the interactive viewer is ``dbg.render("model.html")``). Drawing needs
graphviz's ``dot``; without it, or for a graph too large to draw quickly, only the text is given
and it says why.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

__all__ = ["MAX_INLINE_NODES", "module_mimebundle"]

MAX_INLINE_NODES = 3000
"""Graphs with more nodes than this are not drawn inline (use ``render("model.html")``)."""


def module_mimebundle(module: Any, include: Any = None, exclude: Any = None) -> dict[str, str]:
    text = repr(module)
    bundle: dict[str, str] = {"text/plain": text}
    nodes = sum(len(part.graph.nodes) for part in module.parts().values())
    if nodes > MAX_INLINE_NODES:
        bundle["text/plain"] = text + f"\n(fxdebug: {nodes} nodes, not drawn inline; dbg.render('model.html') opens the viewer)"
    else:
        try:
            with tempfile.TemporaryDirectory(prefix="fxdebug-nb-") as tmp:
                path = module.render(os.path.join(tmp, "model.svg"))
                with open(path, encoding="utf-8") as f:
                    svg = f.read()
            start = svg.find("<svg")
            bundle["image/svg+xml"] = svg[start:] if start >= 0 else svg
        except Exception as exc:  # no graphviz, or a graph dot cannot lay out: keep the text
            bundle["text/plain"] = text + f"\n(fxdebug: no inline picture: {type(exc).__name__}: {exc})"
    if include:
        bundle = {k: v for k, v in bundle.items() if k in include}
    if exclude:
        bundle = {k: v for k, v in bundle.items() if k not in exclude}
    return bundle
