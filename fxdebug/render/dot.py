"""How a ``GraphView`` looks in dot: labels, tooltips, colours, the legend, collapsing by depth.

Every op node shows its name, op, output shape and dtype and, where a report has them, mean/std,
min/max, the zero fraction and every ``COLOR`` column (a dead fraction); the tooltip (hover in a browser) holds every number at
full precision. Fill colours mark findings (``COLORS``), a legend lists the ones present.
Module hierarchy becomes nested clusters; with ``depth=k`` everything owned by a module at depth
``k`` or deeper is collapsed into one box per depth-``k`` module, showing its input/output
shapes and an aggregate (worst ``COLOR`` value, NaN/Inf inside, failures, passes that touched it).

Output is deterministic: nodes, clusters and edges are emitted in graph order, numbers with fixed
formatting, and nothing depends on time, ids or hash order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from fxdebug.runtime.columns import NONFINITE, Column

from fxdebug.render.view import GraphView, VisNode
from fxdebug.report.table import format_value

__all__ = ["AUTO_BUDGET", "COLORS", "Group", "auto_depth", "dot_lines", "drawn_cluster", "group_key", "group_label",
           "group_nodes", "group_style", "group_tooltip", "header", "legend_html", "node_label", "node_style",
           "node_tooltip", "shape_text", "short_op", "used_highlights"]

AUTO_BUDGET = 250
"""The default depth keeps at most this many boxes on screen, collapsing deeper modules."""

COLORS = {
    "origin": "#e41a1c",  # fill: the node that turned finite inputs into NaN/Inf
    "nonfinite": "#fbb4ae",  # fill: saw NaN/Inf (forward or gradient)
    "failed": "#ff7f00",  # fill: failed a shape or device check
    "hot": "#9e9e9e",  # fill: a COLOR column at or above its threshold (dead units, a time share...)
    "added": "#377eb8",  # border: added by a transform pass
    "changed": "#984ea3",  # border: changed by a transform pass
    "auto_leaf": "#4daf4a",  # border, dashed: auto-leafed module (not traced inside)
    "instrumentation": "#ffffcc",  # fill: fxdebug's own observers (show_instrumentation=True)
    "io": "#dbe9f6",  # fill: graph inputs and outputs
    "op": "#ffffff",  # fill: an ordinary op
    "group": "#f2f2f2",  # fill: a collapsed module
    "plumbing": "#fafafa",  # fill: mask/shape plumbing folded into one box
}

_LEGEND = [
    ("origin", "NaN/Inf origin", "fill"),
    ("nonfinite", "saw NaN/Inf", "fill"),
    ("failed", "failed a shape/device check", "fill"),
    ("hot", "hot spot (dead units, ...)", "fill"),
    ("added", "added by a pass", "border"),
    ("changed", "changed by a pass", "border"),
    ("auto_leaf", "auto-leaf (opaque module)", "border"),
    ("instrumentation", "fxdebug instrumentation", "fill"),
]


PLUMBING = "plumbing:"
"""Group keys starting with this hold one cluster's mask/shape plumbing (its path follows)."""


@dataclass
class Group:
    """A module collapsed into one box (or one cluster's mask/shape plumbing)."""

    path: str
    members: list[VisNode] = field(default_factory=list)

    @property
    def plumbing(self) -> bool:
        return self.path.startswith(PLUMBING)

    @property
    def id(self) -> str:
        return f"plumbing/{self.path[len(PLUMBING):]}" if self.plumbing else f"module/{self.path}"

    @property
    def cluster(self) -> str:
        return self.path[len(PLUMBING):] if self.plumbing else self.path.rpartition(".")[0]

    @property
    def origin(self) -> VisNode | None:
        return next((m for m in self.members if m.origin or m.grad_origin), None)

    @property
    def nonfinite(self) -> bool:
        return any(m.nonfinite for m in self.members)

    @property
    def failed(self) -> VisNode | None:
        return next((m for m in self.members if m.failed), None)

    @property
    def worst(self) -> VisNode | None:
        """The member with the largest ``COLOR`` value (the dead ReLU inside a block)."""
        colored = [(m.worst_color[2], i, m) for i, m in enumerate(self.members) if m.worst_color is not None]
        return max(colored, key=lambda t: (t[0], -t[1]))[2] if colored else None

    @property
    def passes(self) -> list[str]:
        out: list[str] = []
        for m in self.members:
            for p in ([m.added_by] if m.added_by else []) + m.changed_by:
                if p not in out:
                    out.append(p)
        return out


def group_key(v: VisNode, depth: int | None, focus: frozenset[str] | set[str] = frozenset()) -> str | None:
    """The module a node collapses into at ``depth``, or ``None`` if it is drawn on its own.

    Modules in ``focus`` (those holding a finding) are never collapsed: their children collapse one
    level deeper instead, so the path down to the NaN origin or a failed check is drawn open.
    """
    if v.kind == "output" or (v.kind == "placeholder" and v.placed is None):
        return None  # a graph's own inputs stay in view; a captured part's inputs collapse with the part
    # A leaf module's call sits in its parent's cluster: it never collapses into a box of its own.
    home = v.where if v.kind != "call_module" or v.placed is not None else v.cluster
    if depth is not None and home:
        parts = home.split(".")
        for k in range(depth, len(parts) + 1):
            key = ".".join(parts[:k])
            if key not in focus:
                return key
    if v.kind == "placeholder":
        return None
    if v.plumbing and not (v.origin or v.grad_origin or v.failed):
        return PLUMBING + v.cluster  # mask/shape plumbing drawn as one box per cluster
    return None


def group_nodes(view: GraphView, depth: int | None) -> tuple[dict[str, Group], dict[str, str]]:
    """``(groups by path, node name → drawn item id)``; single-member groups stay plain nodes."""
    groups: dict[str, Group] = {}
    keys = {v.name: group_key(v, depth, view.focus) for v in view.nodes.values()}
    for v in view.nodes.values():
        key = keys[v.name]
        if key is not None:
            groups.setdefault(key, Group(key)).members.append(v)
    groups = {k: g for k, g in groups.items() if len(g.members) > 1}
    item_of = {}
    for v in view.nodes.values():
        key = keys[v.name]
        item_of[v.name] = groups[key].id if key in groups else v.name
    return groups, item_of


def drawn_cluster(v: VisNode, depth: int | None, focus: frozenset[str] | set[str] = frozenset()) -> str:
    """The cluster a node drawn on its own sits in (a lone member of a collapsed module: its parent)."""
    key = group_key(v, depth, focus)
    return key.rpartition(".")[0] if key is not None and not key.startswith(PLUMBING) else v.cluster


def auto_depth(view: GraphView, budget: int = AUTO_BUDGET) -> int | None:
    """The deepest module depth whose collapsed picture has at most ``budget`` boxes.

    ``None`` (no collapsing) when the whole graph fits; 1 when even that does not fit.
    """
    if len(view.nodes) <= budget:
        return None
    deepest = view.max_module_depth()
    for k in range(deepest, 0, -1):
        _, item_of = group_nodes(view, k)
        if len(set(item_of.values())) <= budget:
            return k
    return 1


# -- text ------------------------------------------------------------------------------------------
def _esc(text: str) -> str:
    """Make ``text`` safe inside a quoted dot string (the escString of labels and tooltips)."""
    return str(text).replace("\\", "\\\\").replace('"', "'")


def dot_lines(lines: Iterable[str]) -> str:
    """Lines of a label or tooltip, escaped and joined as dot wants them."""
    return "\\n".join(_esc(s) for s in lines)


def shape_text(shape: Any) -> str:
    """``(1, 3, 8, 8)``; ``?`` when unknown."""
    return format_value(tuple(shape)) if shape is not None else "?"


def _pct(v: Any) -> str:
    return f"{100 * float(v):.0f}%"


def _full(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return format_value(v) if isinstance(v, (tuple, list)) and all(isinstance(d, int) for d in v) else str(v)


def node_label(v: VisNode, columns: Sequence[Column] = ()) -> list[str]:
    """The lines drawn inside a node's box (``columns``: the report's, for NaN/Inf counts)."""
    if v.kind == "placeholder":
        head = f"input {v.target.lstrip('*')}"
    elif v.kind == "output":
        head = "output"
    else:
        head = f"{shown_name(v)} : {short_op(v.label)}"
    lines = [head]
    if v.shape is not None:
        lines.append(f"{shape_text(v.shape)} {v.dtype or ''}".rstrip())
    if v.params:
        lines.append(_params_line(v.params))
    s = v.stats
    if "mean" in s or "std" in s:
        lines.append(f"mean {format_value(s.get('mean'))}  std {format_value(s.get('std'))}")
    if "min" in s or "max" in s:
        lines.append(f"min {format_value(s.get('min'))}  max {format_value(s.get('max'))}")
    fracs = [f"zero {_pct(s['zero_frac'])}"] if isinstance(s.get("zero_frac"), (int, float)) else []
    fracs += [("hot: " if key in v.hot else "") + f"{label} {_pct(value)}" for key, label, value in v.colors]
    if fracs:
        lines.append("  ".join(fracs))
    if v.origin:
        lines.append("NaN/Inf ORIGIN")
    elif v.grad_origin:
        lines.append("NaN/Inf gradient ORIGIN")
    for col in columns:
        if col.has(NONFINITE) and s.get(col.key):
            what = "NaN/Inf grad" if col.phase == "grad" else "NaN/Inf"
            lines.append(f"{what} in {s[col.key]} call(s)" if col.key.endswith("_calls") else f"{col.label or col.key}: {s[col.key]}")
    if v.failed:
        lines.append("FAILED check")
    if v.changed_by:
        lines.append(f"~ changed by {', '.join(v.changed_by)}")
    elif v.added_by:
        lines.append(f"+ added by {v.added_by}")
    if v.auto_leaf:
        lines.append("auto-leaf (not traced inside)")
    return lines


def shown_name(v: VisNode) -> str:
    """A node's name as drawn: inside its module's cluster the module path it starts with is implied
    (``encoder_block_0_layer_0_SelfAttention_q`` in cluster ``encoder.block.0.layer.0.SelfAttention``
    is drawn ``…_q``); the full name stays in the box's title and tooltip."""
    prefix = v.module.replace(".", "_") + "_" if v.module else ""
    if prefix and v.name.startswith(prefix) and len(v.name) > len(prefix):
        return "…_" + v.name[len(prefix):]
    return v.name


def short_op(label: str) -> str:
    """``aten.embedding.default`` → ``aten.embedding``: the overload is in the tooltip."""
    parts = label.split(".")
    if label.startswith("aten.") and len(parts) == 3:
        return ".".join(parts[:2])
    return label


def _params_line(params: list[tuple[str, Any, Any]], limit: int = 2) -> str:
    """``weight (32, 32), bias (32)``: the parameters an op reads, by their last name."""
    items = [f"{t.rpartition('.')[2]} {shape_text(s) if s is not None else ''}".rstrip() for t, s, _ in params[:limit]]
    more = f" +{len(params) - limit}" if len(params) > limit else ""
    return ", ".join(items) + more


def node_tooltip(v: VisNode) -> list[str]:
    """Everything known about a node, numbers at full precision."""
    lines = [f"node: {v.name}", f"op: {v.label} ({v.kind})", f"module: {v.module or '<root>'}"
             + (f" ({v.module_type})" if v.module_type else "")]
    if v.shape is not None:
        lines.append(f"shape: {shape_text(v.shape)}  dtype: {v.dtype}  device: {v.device}")
    for target, shape, dtype in v.params:
        lines.append(f"reads {target}: {shape_text(shape) if shape is not None else '?'} {dtype or ''}".rstrip())
    for key in sorted(v.stats):
        lines.append(f"{key}: {_full(v.stats[key])}")
    if v.folded:
        lines.append(f"folded with the same op in {len(v.folded)} repeated block(s): "
                     + ", ".join(f.name for f in v.folded[:12]) + (" ..." if len(v.folded) > 12 else ""))
    if v.placed is not None:
        lines.append(f"drawn in {v.placed}, which consumes it (mask/shape plumbing)")
    if v.probes:
        lines.append(f"observed by: {', '.join(v.probes)}")
    if v.added_by:
        lines.append(f"added by pass: {v.added_by}")
    if v.changed_by:
        lines.append(f"changed by pass: {', '.join(v.changed_by)}")
    if v.auto_leaf:
        lines.append(f"auto-leaf: {v.auto_leaf}")
    if v.failed:
        lines.append(f"FAILED: {v.failed}")
    lines.extend(f"note: {n}" for n in v.notes)
    if v.source:
        lines.append(f"source: {v.source}")
    return lines


def group_label(g: Group, view: GraphView, in_shapes: list[str], out_shapes: list[str]) -> list[str]:
    if g.plumbing:
        ops = sorted({short_op(m.label) for m in g.members})
        return ["mask/shape plumbing", f"{len(g.members)} ops: " + ", ".join(ops[:4]) + (" ..." if len(ops) > 4 else "")]
    typ = view.module_types.get(g.path)
    lines = [f"{view.display(g.path)}" + (f" : {typ}" if typ else ""), f"{len(g.members)} ops (collapsed)"]
    if in_shapes:
        lines.append(f"in {', '.join(in_shapes[:3])}" + (" ..." if len(in_shapes) > 3 else ""))
    if out_shapes:
        lines.append(f"out {', '.join(out_shapes[:3])}" + (" ..." if len(out_shapes) > 3 else ""))
    worst = g.worst
    if worst is not None and worst.worst_color is not None:
        _, label, value = worst.worst_color
        lines.append(f"worst {label} {_pct(value)} ({worst.name})")
    origin = g.origin
    if origin is not None:
        lines.append(f"NaN/Inf ORIGIN inside: {origin.name}")
    elif g.nonfinite:
        lines.append("NaN/Inf inside")
    failed = g.failed
    if failed is not None:
        lines.append(f"FAILED check: {failed.name}")
    if g.passes:
        lines.append(f"passes: {', '.join(g.passes)}")
    return lines


# -- style -----------------------------------------------------------------------------------------
def _fill(origin: bool, failed: bool, nonfinite: bool, hot: bool, default: str) -> str:
    if origin:
        return COLORS["origin"]
    if failed:
        return COLORS["failed"]
    if nonfinite:
        return COLORS["nonfinite"]
    if hot:
        return COLORS["hot"]
    return default


def node_style(v: VisNode) -> dict[str, str]:
    default = COLORS["io"] if v.kind in ("placeholder", "output") else COLORS["op"]
    if v.role in ("instrumentation", "clock"):
        default = COLORS["instrumentation"]
    attrs = {
        "shape": {"placeholder": "oval", "output": "oval", "get_attr": "cylinder"}.get(v.kind, "box"),
        "style": "rounded,filled" if v.kind not in ("placeholder", "output", "get_attr") else "filled",
        "fillcolor": _fill(v.origin or v.grad_origin, bool(v.failed), v.nonfinite, v.hot_spot, default),
        "color": "#333333",
    }
    if v.origin or v.grad_origin or v.failed:
        attrs["penwidth"] = "3"
    if attrs["fillcolor"] == COLORS["origin"]:
        attrs["fontcolor"] = "white"
    if v.changed_by:  # a replacement is also new to the graph; "changed" is what it means to a user
        attrs["color"], attrs["penwidth"] = COLORS["changed"], "2.5"
    elif v.added_by:
        attrs["color"], attrs["penwidth"] = COLORS["added"], "2.5"
    elif v.auto_leaf:
        attrs["color"], attrs["penwidth"] = COLORS["auto_leaf"], "2.5"
        attrs["style"] += ",dashed"
    if v.role in ("instrumentation", "clock"):
        attrs["style"] += ",dotted"
    return attrs


def group_style(g: Group) -> dict[str, str]:
    worst = g.worst
    if g.plumbing:
        return {"shape": "note", "style": "filled", "fillcolor": COLORS["plumbing"], "color": "#999999",
                "fontcolor": "#555555"}
    attrs = {
        "shape": "box3d",
        "style": "filled",
        "fillcolor": _fill(g.origin is not None, g.failed is not None, g.nonfinite,
                           worst is not None and worst.hot_spot, COLORS["group"]),
        "color": "#333333",
    }
    if g.origin is not None or g.failed is not None:
        attrs["penwidth"] = "3"
    return attrs


def used_highlights(view: GraphView) -> list[str]:
    """Legend keys for the findings present in ``view``, in legend order."""
    present: set[str] = set()
    for v in view.nodes.values():
        present.update(k for k, on in (
            ("origin", v.origin or v.grad_origin), ("nonfinite", v.nonfinite), ("failed", bool(v.failed)),
            ("hot", v.hot_spot), ("added", bool(v.added_by) and not v.changed_by), ("changed", bool(v.changed_by)),
            ("auto_leaf", bool(v.auto_leaf)), ("instrumentation", v.role in ("instrumentation", "clock"))) if on)
    return [k for k, _, _ in _LEGEND if k in present]


def legend_html(keys: list[str]) -> str:
    rows = ['<TR><TD COLSPAN="2"><B>legend</B></TD></TR>']
    for key, text, how in _LEGEND:
        if key not in keys:
            continue
        cell = (f'<TD BGCOLOR="{COLORS[key]}" WIDTH="18"> </TD>' if how == "fill"
                else f'<TD BORDER="3" COLOR="{COLORS[key]}" WIDTH="18"> </TD>')
        rows.append(f"<TR>{cell}<TD ALIGN=\"LEFT\">{text}</TD></TR>")
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2" CELLPADDING="3">' + "".join(rows) + "</TABLE>>"


def header(view: GraphView, depth: int | None) -> list[str]:
    ops = sum(1 for v in view.nodes.values() if v.kind not in ("placeholder", "output", "get_attr"))
    lines = [f"{view.model_type} — {ops} ops" + (f", {view.calls} call(s) observed" if view.calls else "")
             + (f", collapsed below module depth {depth}" if depth is not None else "")]
    if view.first_nonfinite:
        lines.append(f"NaN/Inf origin: {view.first_nonfinite}")
    if view.first_nonfinite_grad:
        lines.append(f"NaN/Inf gradient origin: {view.first_nonfinite_grad}")
    hot = [v.name for v in view.nodes.values() if v.hot_spot]
    if hot:
        lines.append(f"hot spots: {', '.join(hot[:6])}" + (" ..." if len(hot) > 6 else ""))
    if view.failed_message:
        text = view.failed_message
        lines.append("FAILED: " + (text if len(text) <= 160 else text[:157] + "..."))
    return lines


def group_tooltip(g: Group) -> list[str]:
    if g.plumbing:
        lines = [f"mask/shape plumbing consumed in {g.cluster or '<root>'} ({len(g.members)} ops, folded)"]
    else:
        lines = [f"module: {g.path} ({len(g.members)} ops, collapsed)"]
    worst = g.worst
    if worst is not None and worst.worst_color is not None:
        key, _, value = worst.worst_color
        lines.append(f"worst {key}: {value!r} at {worst.name}")
    if g.nonfinite:
        lines.append("NaN/Inf seen in: " + ", ".join(m.name for m in g.members if m.nonfinite))
    failed = g.failed
    if failed is not None:
        lines.append(f"FAILED: {failed.name}: {failed.failed}")
    for m in g.members[:60]:
        lines.append(f"{m.name} : {m.label} {shape_text(m.shape) if m.shape is not None else ''}".rstrip())
    if len(g.members) > 60:
        lines.append(f"... {len(g.members) - 60} more")
    return lines
