"""Make a ``GraphView`` readable before it is drawn: fold what a reader does not need as boxes.

Four folds, each a small function over the view, applied in this order by ``fold_view``:

* **parameters and buffers** (``get_attr`` nodes) are not boxes: they are listed on the op that
  reads them (label and tooltip), so a transformer's hundred weight boxes stop widening the picture;
* **asserts** (export's ``_assert_tensor_metadata`` and friends, which have no users) become a note
  on the node they check;
* **plumbing** — mask building and shape arithmetic (integer/boolean results, sizes, and anything
  computed only from those, such as a float mask made from a boolean one) — moves into the deepest
  module cluster that consumes all of it, where it is drawn as one box per cluster instead of in
  full at the root;
* **repeated blocks** — consecutive siblings ``layer.0``, ``layer.1``, ... with the same ops wired
  the same way — fold onto the first one, labelled ``layer.0–11 ×12``. A block that holds a finding
  (the NaN/Inf origin, a failed check) is never folded: the run is split around it.

Last, a cluster with hundreds of nodes of its own (a long flat ``nn.Sequential``) is split into runs
of ``CHUNK`` nodes that collapse like modules (``chunk_long_clusters``).

The view keeps the folded nodes on their representative (``VisNode.folded``) so colours and
aggregates still see NaN/Inf in any folded block.
"""

from __future__ import annotations

from fxdebug.render.view import GraphView, VisNode

__all__ = ["CHUNK", "SIZE_OPS", "chunk_long_clusters", "fold_view", "focus_paths", "repeat_runs"]

SIZE_OPS = frozenset({"size", "sym_size", "sym_numel", "sym_stride", "dim", "numel"})
"""Ops (by name, without namespace or overload) whose result is a size: plumbing whatever they read."""

_FLOAT = ("float", "half", "bfloat", "complex")


def fold_view(view: GraphView) -> GraphView:
    """Apply every fold to ``view`` in place (and return it): see the module docstring."""
    fold_params(view)
    fold_asserts(view)
    place_plumbing(view)
    view.focus = focus_paths(view)
    fold_repeats(view)
    chunk_long_clusters(view)
    view.focus = focus_paths(view)
    return view


CHUNK = 100
"""A cluster with more than ``2 * CHUNK`` nodes of its own (a long flat ``nn.Sequential``) is split
into runs of ``CHUNK`` consecutive nodes, ``(nodes 1–100)``, each into runs of ``CHUNK // 10``; they
collapse like modules."""


def chunk_long_clusters(view: GraphView, size: int = CHUNK) -> None:
    """Give the nodes of an oversized cluster a run of their own to be drawn (and collapsed) in."""
    members: dict[str, list[VisNode]] = {}
    for v in view.nodes.values():
        if v.kind not in ("placeholder", "output"):
            members.setdefault(v.cluster, []).append(v)
    for cluster, nodes in members.items():
        if len(nodes) <= 2 * size:
            continue
        sub = max(2, size // 10)
        for start in range(0, len(nodes), size):
            run = nodes[start:start + size]
            outer = f"(nodes {start + 1}–{start + len(run)})"
            for first in range(0, len(run), sub):  # runs of runs: an open run is short too
                inner = f"(nodes {start + first + 1}–{start + first + len(run[first:first + sub])})"
                for v in run[first:first + sub]:
                    v.placed = ".".join(p for p in (cluster, outer, inner) if p)


def _base_op(label: str) -> str:
    """``aten.unsqueeze.default`` → ``unsqueeze``; ``.view`` → ``view``; ``torch.arange`` → ``arange``."""
    parts = [p for p in label.split(".") if p]
    if label.startswith("aten.") and len(parts) >= 2:
        return parts[1]
    return parts[-1] if parts else label


def _drop(view: GraphView, names: set[str]) -> None:
    view.nodes = {k: v for k, v in view.nodes.items() if k not in names}
    for v in view.nodes.values():
        v.inputs = [i for i in v.inputs if i not in names]


def _users(view: GraphView) -> dict[str, list[VisNode]]:
    users: dict[str, list[VisNode]] = {k: [] for k in view.nodes}
    for v in view.nodes.values():
        for i in v.inputs:
            users.setdefault(i, []).append(v)
    return users


def fold_params(view: GraphView) -> None:
    """Parameters, buffers and constants go onto the ops that read them instead of being boxes."""
    users = _users(view)
    gone = set()
    for v in view.nodes.values():
        if v.kind != "get_attr" or any(u.kind == "output" for u in users[v.name]):
            continue  # a parameter the model returns stays a box; an unread one (a tied weight) just goes
        for u in users[v.name]:
            u.params.append((v.target, v.shape, v.dtype))
        gone.add(v.name)
    _drop(view, gone)


def fold_asserts(view: GraphView) -> None:
    """Checks with no users (export's metadata asserts) become notes on the node they check."""
    users = _users(view)
    gone = set()
    for v in view.nodes.values():
        if v.kind in ("placeholder", "output") or users[v.name] or "assert" not in v.label:
            continue
        for i in v.inputs:
            view.nodes[i].notes.append(f"checked by {v.name} ({v.label})")
        gone.add(v.name)
    _drop(view, gone)


def _is_float(v: VisNode) -> bool:
    return v.dtype is not None and any(f in str(v.dtype) for f in _FLOAT)


def _mark_plumbing(view: GraphView) -> None:
    for v in view.nodes.values():  # graph order: inputs are marked before their users
        if v.kind == "placeholder":
            v.plumbing = v.shape is not None and v.dtype is not None and not _is_float(v)
            continue
        if v.kind in ("output", "call_module"):
            continue
        if any(dtype is not None and any(f in str(dtype) for f in _FLOAT) for _, _, dtype in v.params):
            continue  # reads a weight: compute, not plumbing
        v.plumbing = (
            (v.dtype is not None and not _is_float(v))
            or _base_op(v.label) in SIZE_OPS
            or all(view.nodes[i].plumbing for i in v.inputs)  # built only from plumbing (or from nothing)
        )


def _common(paths: list[str]) -> str:
    split = [p.split(".") if p else [] for p in paths]
    out: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return ".".join(out)


def _inside(path: str, outer: str) -> bool:
    return not outer or path == outer or path.startswith(outer + ".")


def place_plumbing(view: GraphView) -> None:
    """Move plumbing into the deepest cluster that consumes all of it (users first, so chains move)."""
    _mark_plumbing(view)
    users = _users(view)
    # plumbing nothing reads (Dynamo keeps an unused ``torch.arange`` in its graph): dead code, not drawn
    _drop(view, {v.name for v in view.nodes.values() if v.plumbing and v.kind not in ("placeholder", "output")
                 and not users[v.name] and not (v.origin or v.grad_origin or v.failed)})
    users = _users(view)
    for v in reversed(list(view.nodes.values())):
        if not v.plumbing or v.kind == "placeholder" or not users[v.name]:
            continue
        if any(u.kind == "output" for u in users[v.name]):
            continue
        target = _common([u.cluster for u in users[v.name]])
        if target != v.cluster and _inside(target, v.cluster) and len(target) > len(v.cluster):
            v.placed = target


def focus_paths(view: GraphView) -> set[str]:
    """Module paths (and their ancestors) that hold a finding: drawn expanded and never folded."""
    out: set[str] = set()
    for v in view.nodes.values():
        if v.origin or v.grad_origin or v.failed:
            parts = v.module.split(".") if v.module else []
            out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
            if v.placed:
                parts = v.placed.split(".")
                out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def _blocks(view: GraphView) -> dict[str, list[VisNode]]:
    """Nodes per numbered module path (``layer.3``), every depth, in graph order."""
    out: dict[str, list[VisNode]] = {}
    for v in view.nodes.values():
        if v.kind in ("placeholder", "output") or not v.where:
            continue
        parts = v.where.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                out.setdefault(".".join(parts[: i + 1]), []).append(v)
    return out


def _signature(path: str, members: list[VisNode]) -> tuple[object, ...]:
    index = {m.name: i for i, m in enumerate(members)}
    cut = len(path)
    return tuple((m.where[cut:], m.label, m.kind, tuple(index.get(i, -1) for i in m.inputs)) for m in members)


def _runs(view: GraphView, blocks: dict[str, list[VisNode]]) -> list[list[str]]:
    """Runs of at least two consecutive, identical sibling blocks, none of them holding a finding."""
    siblings: dict[str, list[int]] = {}
    for path in blocks:
        parent, _, last = path.rpartition(".")
        siblings.setdefault(parent, []).append(int(last))
    runs: list[list[str]] = []
    for parent, idx in siblings.items():
        idx.sort()
        prefix = parent + "." if parent else ""
        run: list[str] = []
        prev_sig: object = None
        prev_i = None
        for i in idx:
            path = f"{prefix}{i}"
            sig = None if path in view.focus else _signature(path, blocks[path])
            if sig is not None and sig == prev_sig and prev_i == i - 1:
                run.append(path)
            else:
                if len(run) > 1:
                    runs.append(run)
                run = [path] if sig is not None else []
            prev_sig, prev_i = sig, i
        if len(run) > 1:
            runs.append(run)
    # Outer runs first; a run inside a block that an outer run folds away disappears with it.
    runs.sort(key=lambda r: r[0].count("."))
    return runs


def repeat_runs(view: GraphView) -> list[list[str]]:
    """The runs ``fold_repeats`` would fold (module paths of identical sibling blocks, outer runs
    first), without folding them: the HTML viewer draws each run as one box that opens into its blocks."""
    return _runs(view, _blocks(view))


def fold_repeats(view: GraphView) -> None:
    """Fold each run of identical sibling blocks onto its first block, labelled ``first–last ×N``."""
    folded_paths: set[str] = set()
    for run in _runs(view, _blocks(view)):
        if any(_inside(run[0], p) and run[0] != p for p in folded_paths):
            continue  # inside a block already folded away
        blocks = _blocks(view)
        if any(p not in blocks for p in run):
            continue
        rep = blocks[run[0]]
        mapping: dict[str, str] = {}
        for path in run[1:]:
            for r, m in zip(rep, blocks[path]):
                mapping[m.name] = r.name
                r.folded.append(m)
                r.folded.extend(m.folded)
        gone = set(mapping)
        for v in view.nodes.values():
            if v.name in gone:
                continue
            new: list[str] = []
            for i in v.inputs:  # readers of a folded block read the representative's node
                src = mapping.get(i, i)
                if src != v.name and src not in new:
                    new.append(src)
            v.inputs = new
        view.nodes = {k: v for k, v in view.nodes.items() if k not in gone}
        last = run[-1].rpartition(".")[2]
        view.folds[run[0]] = f"{run[0]}–{last} ×{len(run)}"
        folded_paths.update(run[1:])
