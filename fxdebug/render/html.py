"""``render("model.html")``: the interactive viewer, one self-contained file that opens offline.

The page carries the graph as JSON (every node with its shape, statistics, parameters, source
line and pass provenance; the report's column declarations; the findings) and two scripts inlined
from ``fxdebug/render/assets``: dagre (a maintained graph-layout library from npm, vendored with
its licence) and ``viewer.js``, which draws only what is visible — module clusters start as one
box each and are laid out when expanded — so large graphs open quickly. Nothing is fetched from
the network.

The view is the SVG's (``render_view``) with the same folds for parameters, asserts and plumbing
(``render_fold``). Repeated blocks are not folded away: the data lists each run of identical sibling
blocks (``folds``, from ``repeat_runs``) and the viewer draws a run as one box, ``layers.0–79 ×80``,
that opens into its blocks (a block holding a finding is never in a run). A cluster's mask/shape
plumbing sits in a child cluster of its own, ``(mask/shape plumbing)``, closed at first; a cluster
with more than 100 items (nodes or child modules) shows them in closed runs of 100, and runs of
runs (the viewer does this, so each layout stays small). Folded parameter and assert nodes are kept
in the data as hidden nodes, so the node count the page shows is the graph's.
"""

from __future__ import annotations

import html
import json
import math
import os
from importlib import resources
from typing import Any

from fxdebug.errors import UsageError
from fxdebug.graph.gc_pause import paused_gc
from fxdebug.render.fold import fold_asserts, fold_params, focus_paths, place_plumbing, repeat_runs
from fxdebug.render.view import GraphView, VisNode

__all__ = ["ASSETS", "PLUMBING_CLUSTER", "diff_scores", "html_data", "viewer_html", "write_html"]

ASSETS = ("dagre.min.js", "viewer.js", "viewer.css", "dagre-LICENSE")
"""The files under ``fxdebug/render/assets`` the page is built from (shipped as package data)."""


def _asset(name: str) -> str:
    return resources.files("fxdebug").joinpath("render", "assets", name).read_text(encoding="utf-8")


def _jsonable(value: Any) -> Any:
    """Numbers JSON can carry (NaN/Inf become strings), tuples as lists, anything else as text."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


PLUMBING_CLUSTER = "(mask/shape plumbing)"
"""The last part of the cluster path a cluster's plumbing nodes are grouped under (collapsed at first)."""


def _cluster(v: VisNode) -> str:
    if v.plumbing and v.kind != "placeholder" and not (v.origin or v.grad_origin or v.failed):
        return f"{v.cluster}.{PLUMBING_CLUSTER}" if v.cluster else PLUMBING_CLUSTER
    return v.cluster


def _node(v: VisNode, index: dict[str, int], hidden: bool, strings: dict[str, int]) -> dict[str, Any]:
    """One node for the page: the repeated strings (op, kind, module and cluster paths, module type,
    dtype) as indexes into ``strings``, and only the fields that differ from their defaults (false,
    empty, none), so a 100k-node page stays small to parse."""
    def ref(text: str) -> int:
        return strings.setdefault(text, len(strings))

    out: dict[str, Any] = {
        "name": v.name, "op": ref(v.label), "kind": ref(v.kind), "module": ref(v.module),
        "cluster": ref("" if hidden else _cluster(v)),
    }
    optional = {
        "module_type": v.module_type and ref(v.module_type), "hidden": hidden, "shape": _jsonable(v.shape),
        "dtype": v.dtype and ref(str(v.dtype)),
        "device": v.device, "stats": _jsonable(v.stats), "params": [[t, _jsonable(s)] for t, s, _ in v.params],
        "inputs": [index[i] for i in v.inputs if i in index], "origin": v.origin, "grad_origin": v.grad_origin,
        "failed": v.failed, "nonfinite": v.nonfinite, "dead": v.hot_spot, "plumbing": v.plumbing,
        "probes": v.probes, "added_by": v.added_by, "changed_by": v.changed_by, "notes": v.notes,
        "source": v.source,
    }
    out.update((k, value) for k, value in optional.items() if value or value == 0 and value is not False)
    return out


def diff_scores(diff: Any) -> tuple[dict[str, float], dict[str, str], str | None]:
    """``({node: score in [0, 1]}, {node: description}, first divergent)`` from ``diff=``.

    ``diff`` is a ``fxdebug.diff(...)`` result (``Diff``: divergence per node of report A, its
    ``rtol``) or a plain ``{node: number}``. A ``Diff``'s divergence is scaled as
    ``min(1, divergence / (10 * rtol))`` (``inf``, a shape or NaN/Inf mismatch, is 1); a plain
    mapping is scaled by its largest finite value.
    """
    if diff is None:
        return {}, {}, None
    if isinstance(diff, dict):
        finite = [float(v) for v in diff.values() if isinstance(v, (int, float)) and math.isfinite(v)]
        top = max(finite, default=0.0) or 1.0
        scores = {str(k): (1.0 if not math.isfinite(float(v)) else max(0.0, float(v)) / top)
                  for k, v in diff.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return scores, {k: f"diff {_jsonable(float(v))}" for k, v in diff.items() if k in scores}, None
    divergence = getattr(diff, "node_divergence", None)
    if not callable(divergence):
        raise UsageError(f"diff= takes a fxdebug.diff(report_a, report_b) result or a {{node: number}} dict; "
                         f"got {type(diff).__name__}.")
    rtol = float(getattr(diff, "rtol", 0.0) or 0.0) or 1e-12
    scores, texts = {}, {}
    for node, div in divergence("a").items():
        div = float(div)
        scores[node] = 1.0 if not math.isfinite(div) else min(1.0, max(0.0, div) / (10 * rtol))
        row = diff.row(node) if callable(getattr(diff, "row", None)) else {}
        detail = f" ({row.get('column')}: {row.get('a')} vs {row.get('b')})" if row.get("column") else ""
        texts[node] = f"diverges {div:.3g}{detail}" + (" — beyond rtol" if div > rtol else "")
    return scores, texts, getattr(diff, "first_divergent", None)


def html_data(view: GraphView, diff: Any = None) -> dict[str, Any]:
    """The JSON the page reads: nodes (hidden ones too; repeated strings as indexes into ``strings``),
    module types, runs of repeated blocks, columns, findings, diff."""
    everything = dict(view.nodes)
    fold_params(view)
    fold_asserts(view)
    place_plumbing(view)
    view.focus = focus_paths(view)
    index = {name: i for i, name in enumerate(everything)}
    values, texts, first_divergent = diff_scores(diff)
    strings: dict[str, int] = {}
    nodes = [_node(v, index, name not in view.nodes, strings) for name, v in everything.items()]
    return {
        "model": view.model_type,
        "strings": list(strings),
        "nodes": nodes,
        "modules": view.module_types,
        "folds": repeat_runs(view),
        "columns": [_jsonable(c.to_dict()) for c in view.columns if c.key not in ("node", "module", "op", "shape",
                                                                                    "dtype", "device")],
        "first_nonfinite": view.first_nonfinite,
        "first_nonfinite_grad": view.first_nonfinite_grad,
        "failed_message": view.failed_message,
        "calls": view.calls,
        "diff": values or None,
        "diff_text": texts or None,
        "diff_first": first_divergent,
        "diff_label": "divergence",
    }


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>@@TITLE@@ — fxdebug</title>
<style>
@@CSS@@
</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <span title="parameters and buffers are listed on the ops that read them"><b id="node-count"></b> graph nodes
    (<span id="op-count"></span> ops and values) in <b id="module-count"></b> modules</span>
  <span id="visible"></span>
  <label>search <input id="search" type="search" placeholder="node name or module path, Enter"></label>
  <label>colour by <select id="colour"><option value="">findings</option></select></label>
  <span id="scale"></span>
  <button id="fit" type="button">fit</button>
  <span id="findings"></span>
</header>
<div id="main">
  <svg id="canvas" xmlns="http://www.w3.org/2000/svg">
    <defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7"
      orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#666"/></marker></defs>
  </svg>
  <aside>
    <ul id="results"></ul>
    <div id="details"><p>Click a box to expand a module; click a node for its statistics, shapes, source line
    and pass provenance; click an open module's title to collapse it. Drag to pan, wheel to zoom.</p></div>
    <details><summary>licences</summary><pre id="licence">@@LICENCE@@</pre></details>
  </aside>
</div>
<script id="fxdebug-data" type="application/json">@@DATA@@</script>
<script>
/* @dagrejs/dagre 3.1.3, MIT licence (see "licences" in the side panel) */
@@DAGRE@@
</script>
<script>
@@VIEWER@@
</script>
</body>
</html>
"""


def _script(text: str) -> str:
    """JavaScript safe inside a ``<script>`` element, without its source-map comment."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("//# sourceMappingURL=")]
    return "\n".join(lines).replace("</script", "<\\/script")


def viewer_html(view: GraphView, diff: Any = None) -> str:
    """The whole page for ``view`` as one string."""
    with paused_gc():  # building 100k small dicts would trigger full collections over the whole graph, again and again
        data = json.dumps(html_data(view, diff), separators=(",", ":"), allow_nan=False)
    parts = {
        "TITLE": html.escape(view.model_type), "CSS": _asset("viewer.css"),
        "LICENCE": html.escape(_asset("dagre-LICENSE")), "DATA": data.replace("</", "<\\/"),
        "DAGRE": _script(_asset("dagre.min.js")), "VIEWER": _script(_asset("viewer.js")),
    }
    page = _PAGE
    for key in ("TITLE", "CSS", "LICENCE", "DATA", "DAGRE", "VIEWER"):  # data last-but-two: it may hold "@@"
        page = page.replace(f"@@{key}@@", parts[key], 1)
    return page


def write_html(view: GraphView, path: str | os.PathLike[str], diff: Any = None) -> str:
    """Write the viewer for ``view`` to ``path``; returns the path."""
    out = os.fspath(path)
    with open(out, "w", encoding="utf-8") as f:
        f.write(viewer_html(view, diff))
    return out
