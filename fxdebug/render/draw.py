"""``fxdebug.render``: the annotated graph as an SVG (graphviz), with its ``.dot`` source beside it.

The picture reads only ``node.meta["fxdebug"]`` and the ``Report`` (see ``render.view``), so any
pass — built-in or a user's — shows up in it. How it looks (labels, tooltips, colours, the legend,
collapse by module depth) lives in ``render.dot``; this module resolves what to draw, assembles the
dot source with nested module clusters, and runs graphviz's ``dot``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from torch import nn
from torch.fx import GraphModule

from fxdebug.errors import ArgumentTypeError, FxDebugError, UsageError
from fxdebug.graph.inputs import normalize_inputs
from fxdebug.graph.shapes import learn_specs
from fxdebug.render.dot import (AUTO_BUDGET, COLORS, auto_depth, dot_lines, drawn_cluster, group_label, group_nodes,
                                group_style, group_tooltip, header, legend_html, node_label, node_style, node_tooltip,
                                shape_text, used_highlights)
from fxdebug.render.fold import fold_view
from fxdebug.render.html import diff_scores, write_html
from fxdebug.render.joined import JoinedParts, joined_view
from fxdebug.render.parts import part_chain, parts_view
from fxdebug.render.view import GraphView, build_view

__all__ = ["COLORS", "FIT_PT", "RenderOptions", "build_dot", "fit_source", "render", "svg_size"]

INSTALL_HINT = (
    "Install graphviz so that `dot` is on PATH: `apt-get install -y graphviz` (Debian/Ubuntu), "
    "`brew install graphviz` (macOS), or `conda install -c conda-forge graphviz`"
)
DOT_TIMEOUT_S = 600
FIT_PT = 2500.0
"""The automatic depth keeps the picture's long side at most this many points (about a screen)."""
_SIZE = re.compile(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"')
_FORMATS = ("svg", "png", "pdf", "html")


@dataclass(frozen=True)
class RenderOptions:
    """How ``render`` draws; every field may also be given to ``render`` as a keyword.

    Attributes:
        depth: collapse every module at this depth (``"layer1"`` is depth 1, ``"layer1.0"``
            depth 2) into one box with its in/out shapes and an aggregate. ``None`` picks the
            deepest level whose picture fits a screen (``FIT_PT`` points on its long side, measured
            on graphviz's layout; no collapse when the whole graph fits); pass a large number to
            never collapse. Modules holding the NaN/Inf origin or a failed check are drawn open.
        show_instrumentation: draw fxdebug's observer nodes instead of folding them into the
            node they watch.
        failed: an error carrying ``.node`` (e.g. a ``ShapeMismatchError`` or
            ``DeviceMismatchError`` from a run) or a node name: that node is highlighted as
            having failed a check, with the message in its tooltip. Passes can mark nodes
            themselves with ``node_meta(n).failed = "<message>"``.
        report: a ``Report`` to draw instead of the module's own (e.g. one loaded or merged).
        fold: fold what a reader does not need as boxes (``render.fold``): parameters onto the ops
            reading them, mask/shape plumbing into the cluster consuming it, and runs of identical
            repeated blocks into one block labelled ``layer.0–11 ×12``. ``False`` draws every node.
        diff: a ``fxdebug.diff(report_a, report_b)`` result (or ``{node: number}``) for the graph of
            report A; an object with ``for_graph(gm)`` (``fxdebug.align``'s ``Alignment``) gives the
            one for the graph drawn. The viewer opens coloured by it (a heat map of divergence / (10 rtol)) with the
            first divergent node one click away; the SVG highlights that node and lists every node's
            divergence in its tooltip.
        parts: the captured parts (``Instrumented.parts()``, which ``Instrumented.render`` passes);
            several are drawn as one picture joined by the data between them.
    """

    depth: int | None = None
    show_instrumentation: bool = False
    failed: Any = None
    report: Any = None
    fold: bool = True
    diff: Any = None
    parts: Mapping[str, GraphModule] | None = None


def render(model_or_gm: nn.Module, path: str | os.PathLike[str], example_inputs: Any = None,
           options: RenderOptions | None = None, **changes: Any) -> str:
    """Draw the annotated graph of ``model_or_gm`` to ``path`` (SVG; ``.png``/``.pdf`` also work;
    ``.html`` writes the interactive viewer, one self-contained file that opens offline).

    Args:
        model_or_gm: an ``Instrumented`` module (its report is drawn), any ``GraphModule``, or a
            plain ``nn.Module`` (traced here).
        path: where the picture goes; the dot source is written beside it as ``<stem>.dot``.
        example_inputs: run once to learn shapes when the graph does not know them yet.
        options: a ``RenderOptions``; ``changes`` are its fields as keywords (``depth=2``),
            applied on top.

    Returns the path of the picture. Raises ``FxDebugError`` (after writing the ``.dot``) when
    graphviz's ``dot`` is not installed, saying how to install it.
    """
    known = {f.name for f in fields(RenderOptions)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise UsageError(f"render() has no option {', '.join(map(repr, unknown))}; the options are "
                         f"{', '.join(sorted(known))} (fxdebug.render.RenderOptions).")
    opts = replace(options or RenderOptions(), **changes)
    if callable(getattr(opts.diff, "for_graph", None)) and isinstance(model_or_gm, GraphModule):
        opts = replace(opts, diff=opts.diff.for_graph(model_or_gm))  # a diff that depends on the graph drawn
    depth = opts.depth
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise UsageError(f"depth must be a positive int (1 = top-level modules) or None for automatic; got {depth!r}.")
    out_path = os.fspath(path)
    folder = os.path.dirname(out_path)
    if folder and not os.path.isdir(folder):
        raise UsageError(f"cannot write the picture to {out_path!r}: the directory {folder!r} does not exist. "
                         f"Create it first (os.makedirs({folder!r})) or pick another path.")
    parent = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(parent):
        raise UsageError(f"cannot write the picture to {out_path!r}: the directory {os.path.dirname(out_path)!r} does "
                         f"not exist. Create it first (os.makedirs({os.path.dirname(out_path)!r})) or pick another path.")
    stem, ext = os.path.splitext(out_path)
    fmt = ext.lstrip(".").lower() or "svg"
    if fmt in ("html", "htm"):
        gm = _resolve(model_or_gm, example_inputs)
        return write_html(_view(gm, opts), out_path, diff=opts.diff)
    if fmt not in _FORMATS:
        raise UsageError(f"render() writes {', '.join(_FORMATS)}; {out_path!r} ends in {ext!r}. Use e.g. 'model.svg'.")
    if not ext:
        out_path += ".svg"
    gm = _resolve(model_or_gm, example_inputs)
    view = _view(gm, opts)
    if opts.diff is not None:
        mark_diff(view, opts.diff)
    if opts.fold:
        fold_view(view)
    dot_path = stem + ".dot"
    if depth is None:
        source = fit_source(view, dot_path, out_path)
    else:
        source = build_dot(view, depth)
    with open(dot_path, "w", encoding="utf-8") as f:
        f.write(source)
    run_dot(dot_path, out_path, fmt)
    return out_path


def mark_diff(view: GraphView, diff: Any) -> None:
    """Put a ``fxdebug.diff`` result on the picture: each node's divergence in its tooltip, the
    first divergent node highlighted as a failed check (and so drawn open)."""
    _, texts, first = diff_scores(diff)
    for name, text in texts.items():
        v = view.nodes.get(name)
        if v is not None:
            v.notes.append(text)
    if first in view.nodes:
        view.nodes[first].failed = f"first divergent node: {texts.get(first, '')}".rstrip(": ")
        view.failed_message = view.failed_message or f"first divergent node: {first} ({texts.get(first, '')})"


def svg_size(svg: str) -> tuple[float, float]:
    """``(width, height)`` in points from the header of an SVG graphviz wrote."""
    m = _SIZE.search(svg[:4000])
    if m is None:
        raise FxDebugError("graphviz wrote an SVG without a width/height in points; cannot measure the picture.")
    return float(m.group(1)), float(m.group(2))


def fit_source(view: GraphView, dot_path: str, out_path: str, fit_pt: float = FIT_PT) -> str:
    """The dot source at the deepest module depth whose picture is at most ``fit_pt`` on its long side.

    Depths are tried from "nothing collapsed" down to 1, skipping those with more than
    ``AUTO_BUDGET`` boxes without laying them out; each candidate is laid out by ``dot`` and measured.
    When none fits, the smallest picture wins.
    """
    deepest = view.max_module_depth()
    best: tuple[float, str] | None = None
    candidates: list[int | None] = [None, *range(deepest, 0, -1)]
    fallback = auto_depth(view)
    for depth in candidates:
        _, item_of = group_nodes(view, depth)
        if len(set(item_of.values())) > AUTO_BUDGET and depth != 1:
            continue
        source = build_dot(view, depth)
        width, height = svg_size(_dot_text(source, dot_path, out_path))
        long_side = max(width, height)
        if long_side <= fit_pt:
            return source
        if best is None or long_side < best[0]:
            best = (long_side, source)
    return best[1] if best is not None else build_dot(view, fallback)


def _dot_text(source: str, dot_path: str, out_path: str) -> str:
    """Lay ``source`` out with ``dot`` and return the SVG text (to measure it)."""
    exe = shutil.which("dot")
    if exe is None:
        with open(dot_path, "w", encoding="utf-8") as f:
            f.write(source)
        run_dot(dot_path, out_path)  # raises the install hint
    try:
        proc = subprocess.run([str(exe), "-Tsvg"], input=source, capture_output=True, text=True, timeout=DOT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FxDebugError(f"graphviz took more than {DOT_TIMEOUT_S} s laying out {out_path!r}; pass a smaller "
                           "depth= to draw fewer boxes.") from None
    if proc.returncode != 0:
        raise FxDebugError(f"graphviz failed to lay out {out_path!r} (exit {proc.returncode}): {proc.stderr.strip()[:500]}")
    return proc.stdout


def _view(gm: GraphModule, opts: RenderOptions) -> GraphView:
    """The view of ``gm``: its graph, or every captured part joined by the data between them."""
    if isinstance(opts.parts, JoinedParts):  # a live capture's graphs, joined by what fed which
        return joined_view(opts.parts, opts.report, failed=opts.failed, show_instrumentation=opts.show_instrumentation)
    if opts.parts is not None and list(opts.parts) != [""]:
        return parts_view(gm, opts.report, failed=opts.failed, show_instrumentation=opts.show_instrumentation)
    return build_view(gm, opts.report, show_instrumentation=opts.show_instrumentation, failed=opts.failed)


def _resolve(obj: Any, example_inputs: Any) -> GraphModule:
    """The graph to draw, its shapes learnt from ``example_inputs`` when given.

    A plain module is traced by ``fxdebug.render`` (``api.py``) before it gets here, and an
    ``Instrumented`` module passes its own report; this module only draws graphs.
    """
    if not isinstance(obj, GraphModule):
        hint = " (it is a class: instantiate it first)" if isinstance(obj, type) else ""
        raise ArgumentTypeError(f"render() needs an nn.Module or a GraphModule; got {type(obj).__name__}{hint}.")
    inputs = normalize_inputs(example_inputs) if example_inputs is not None else None
    if inputs is not None:
        learn_specs(obj, inputs)  # writes shape/dtype/device into node meta
    return obj


def run_dot(dot_path: str, out_path: str, fmt: str = "svg") -> None:
    """Run graphviz's ``dot`` on ``dot_path``; a clear ``FxDebugError`` if it is missing or fails."""
    exe = shutil.which("dot")
    if exe is None:
        raise FxDebugError(
            f"cannot draw {out_path!r}: graphviz's `dot` program was not found on PATH. The graph source "
            f"was written to {dot_path!r}. {INSTALL_HINT}; then run `dot -T{fmt} {dot_path} -o {out_path}` "
            "or render again."
        )
    try:
        proc = subprocess.run([exe, f"-T{fmt}", dot_path, "-o", out_path], capture_output=True, text=True,
                              timeout=DOT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FxDebugError(f"graphviz took more than {DOT_TIMEOUT_S} s on {dot_path!r}; collapse modules with a "
                           "smaller depth= to draw fewer boxes.") from None
    if proc.returncode != 0:
        raise FxDebugError(f"graphviz failed to draw {dot_path!r} (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[:500]}")


def build_dot(view: GraphView, depth: int | None = None) -> str:
    """The dot source of ``view``, collapsing modules at ``depth`` (``None``: no collapsing)."""
    import graphviz

    groups, item_of = group_nodes(view, depth)
    by_id = {gr.id: gr for gr in groups.values()}
    g = graphviz.Digraph(
        "fxdebug",
        graph_attr={"rankdir": "TB", "fontname": "Helvetica", "fontsize": "11", "labelloc": "t",
                    "labeljust": "l", "nodesep": "0.25", "ranksep": "0.35",
                    "label": dot_lines(header(view, depth)), "tooltip": view.model_type},
        node_attr={"fontname": "Helvetica", "fontsize": "9", "margin": "0.08,0.04", "height": "0.3"},
        edge_attr={"arrowsize": "0.6", "color": "#555555", "fontname": "Helvetica", "fontsize": "8"},
    )
    edges, in_shapes, out_shapes = _edges(view, item_of)
    contents: dict[str, list[tuple[str, Any]]] = {}
    emitted: set[str] = set()
    for v in view.nodes.values():
        item = item_of[v.name]
        if item in emitted:
            continue
        emitted.add(item)
        if item == v.name:
            contents.setdefault(drawn_cluster(v, depth, view.focus), []).append(("node", v))
        else:
            grp = by_id[item]
            contents.setdefault(grp.cluster, []).append(("group", grp))
    children: dict[str, list[str]] = {}
    for path in list(contents):
        parts = path.split(".") if path else []
        for i in range(len(parts)):
            parent, child = ".".join(parts[:i]), ".".join(parts[: i + 1])
            if child not in children.setdefault(parent, []):
                children[parent].append(child)
    counter = iter(range(1 << 30))

    def emit(sub: Any, path: str, heading: str | None = None) -> None:
        for kind, obj in contents.get(path, []):
            if kind == "node":
                label = node_label(obj, view.columns)
                if heading is not None:
                    label = [heading, *label]
                sub.node(obj.name, label=dot_lines(label), tooltip=dot_lines(node_tooltip(obj)),
                         id=f"node/{obj.name}", **node_style(obj))
            else:
                sub.node(obj.id, label=dot_lines(group_label(obj, view, in_shapes[obj.id], out_shapes[obj.id])),
                         tooltip=dot_lines(group_tooltip(obj)), id=obj.id, **group_style(obj))
        for child in children.get(path, []):
            typ = view.module_types.get(child)
            title = view.display(child) + (f" : {typ}" if typ else "")
            if not children.get(child) and len(contents.get(child, [])) == 1 and contents[child][0][0] == "node":
                emit(sub, child, heading=f"[{child.rpartition('.')[2]}" + (f" : {typ}]" if typ else "]"))  # a cluster around one box says no more than a heading
                continue
            with sub.subgraph(name=f"cluster_{next(counter)}") as c:
                c.attr(label=dot_lines([title]), id=f"cluster/{child}",
                       style="rounded,dashed", color="#9a9a9a", fontsize="9", tooltip=dot_lines([child]))
                emit(c, child)

    emit(g, "")
    for (a, b), tip in edges.items():
        g.edge(a, b, tooltip=dot_lines([tip]))
    for a, b in part_chain(view, item_of):  # parts with no edge between them: stacked in execution order
        if (a, b) not in edges:
            g.edge(a, b, style="invis")
    keys = used_highlights(view)
    if keys:
        g.node("fxdebug/legend", label=legend_html(keys), shape="plaintext", id="legend")
    return str(g.source)


def _edges(view: GraphView, item_of: dict[str, str]) -> tuple[dict[tuple[str, str], str], dict[str, list[str]],
                                                               dict[str, list[str]]]:
    """Deduplicated edges between drawn items, and each group's input/output shapes."""
    edges: dict[tuple[str, str], str] = {}
    in_shapes: dict[str, list[str]] = {}
    out_shapes: dict[str, list[str]] = {}
    for v in view.nodes.values():
        dst = item_of[v.name]
        for src_name in v.inputs:
            src = item_of.get(src_name)
            if src is None or src == dst:
                continue
            shape = shape_text(view.nodes[src_name].shape)
            if dst != v.name:
                _add(in_shapes.setdefault(dst, []), shape)
            if src != src_name:
                _add(out_shapes.setdefault(src, []), shape)
            edges.setdefault((src, dst), f"{src_name} → {v.name}: {shape}")
    for item in set(item_of.values()):
        in_shapes.setdefault(item, [])
        out_shapes.setdefault(item, [])
    return edges, in_shapes, out_shapes


def _add(items: list[str], value: str) -> None:
    if value not in items:
        items.append(value)
