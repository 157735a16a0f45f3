"""``Report``: what the instrumentation saw, one row per observed node, in graph order.

Building a report is the one place fxdebug reads device values back to the host. Rows are plain
dicts (``node``, ``module``, ``op``, ``shape``, ``dtype``, ``device``, then whatever the probes
summarised). Which key means what comes from the probes' column declarations (``Column``,
``Probe.columns``): ``Report.columns`` lists them, and the NaN/Inf origin is derived from the
columns with the ``ORIGIN`` role:

* forward: the first node, in execution order, among those that saw non-finite values in the
  earliest call that saw any — its inputs were finite, so it is where the values went bad (a
  graph input, a placeholder, when the data itself carried NaN/Inf: the findings say so);
* backward: gradients flow in reverse, so among the nodes whose output gradient went non-finite
  in the earliest such call, the *last* in graph order is where the bad gradient entered:
  ``first_nonfinite_grad`` names it. The op whose backward computed that gradient is one of its
  users (``nonfinite_grad_from`` lists them): e.g. ``sqrt`` at 0 has a finite output gradient
  but sends Inf into its input, so the input's producer is reported and ``sqrt`` is among
  ``nonfinite_grad_from``.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, cast

from torch.fx import GraphModule, Node

from fxdebug.runtime.columns import NONFINITE, ORIGIN, Column, columns_with, resolve_columns
from fxdebug.graph.gc_pause import paused_gc
from fxdebug.graph.meta import is_instrumentation, module_path, op_label
from fxdebug.runtime.lower import observers_in
from fxdebug.runtime.kernel import runtime_notes

__all__ = ["Report", "build_report", "merge_reports"]


@dataclass
class Report:
    rows: list[dict[str, Any]]
    first_nonfinite: str | None = None
    first_nonfinite_grad: str | None = None
    nonfinite_grad_from: list[str] = field(default_factory=list)
    auto_leaves: dict[str, str] = field(default_factory=dict)
    frontend: str = "symbolic"
    notes: list[str] = field(default_factory=list)
    calls: int = 0
    columns: list[Column] = field(default_factory=lambda: resolve_columns(()))
    failure: Any = None  # the FxDebugError that stopped fxdebug.collect(), if one did
    nonfinite_params: list[str] = field(default_factory=list)  # non-finite weights of the forward origin's op

    # -- lookup ---------------------------------------------------------------------------------
    def row(self, node: str) -> dict[str, Any]:
        """The row of node ``node``; else, where no node has that name, the output row of module ``node``
        (the last row the module produced: an export or subtrees graph names nodes by op, ``linear``, where a
        live or symbolic one names a leaf module's row ``fc``). KeyError naming the known nodes otherwise."""
        for r in self.rows:
            if r["node"] == node:
                return r
        owned = [r for r in self.rows if r.get("module") == node and r.get("op") != "placeholder"]
        if owned:
            return owned[-1]
        raise KeyError(f"no row for node {node!r}; observed nodes: {[r['node'] for r in self.rows][:20]}")

    def __getitem__(self, node: str) -> dict[str, Any]:
        return self.row(node)

    def column(self, key: str) -> Column | None:
        """The declaration of row key ``key`` (``None`` for a key no probe declared)."""
        return next((c for c in self.columns if c.key == key), None)

    def columns_with(self, role: str, phase: str | None = None) -> list[Column]:
        """Declared columns holding ``role`` (``fxdebug.authoring.ORIGIN``, ``COLOR``, ...), of ``phase`` if given."""
        return columns_with(self.columns, role, phase)

    def nonfinite_in(self, row: dict[str, Any], phase: str | None = None) -> bool:
        """Whether ``row`` saw a non-finite value, by its ``NONFINITE`` and ``ORIGIN`` columns."""
        return any(row.get(c.key) for c in self.columns_with(NONFINITE, phase)) or any(
            row.get(c.key) is not None for c in self.columns_with(ORIGIN, phase))

    @property
    def nonfinite_nodes(self) -> list[str]:
        """Nodes whose output went non-finite in some forward call, in graph order."""
        return [r["node"] for r in self.rows if self.nonfinite_in(r, "forward")]

    def answer(self, name: str) -> Any:
        """The report-level reading a probe column declares (``Column(answers=name, reading=...)``),
        computed from the rows; ``None`` when no column answers ``name``."""
        col = next((c for c in self.columns if c.answers == name and c.reading is not None), None)
        return col.reading(self.rows) if col is not None and col.reading is not None else None

    @property
    def history(self) -> Any:
        """With ``Recorder`` / ``NaNCheck(history=N)``: the last N calls' per-node statistics."""
        return self.answer("history")

    @property
    def precision_origin(self) -> str | None:
        """With ``Shadow``: the node where the accumulated relative error grew most (``err_growth``)."""
        origin = self.answer("precision_origin")
        return None if origin is None else str(origin)

    @property
    def origin_samples(self) -> list[int] | None:
        """With ``NaNCheck(samples=True)``: the sorted batch indices (dim 0) at which the forward
        origin's output was non-finite in its first bad call (``None`` when not recorded)."""
        return cast("list[int] | None", self._answered("origin_samples"))

    @property
    def origin_tokens(self) -> list[tuple[int, int]] | None:
        """With ``NaNCheck(samples=True)`` and a ``(batch, sequence, ...)`` origin: its non-finite
        ``(batch, position)`` pairs in the first bad call (``None`` for other shapes)."""
        return cast("list[tuple[int, int]] | None", self._answered("origin_tokens"))

    def _answered(self, name: str) -> Any:
        answer = getattr(self, "answer", None)  # declared by the probe's column (answers=, reading=)
        return answer(name) if answer is not None else None

    @property
    def ok(self) -> bool:
        """No non-finite value seen, forward or backward."""
        return self.first_nonfinite is None and self.first_nonfinite_grad is None and not any(
            self.nonfinite_in(r) for r in self.rows)

    # -- export ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "frontend": self.frontend,
            "calls": self.calls,
            "first_nonfinite": self.first_nonfinite,
            "first_nonfinite_grad": self.first_nonfinite_grad,
            "nonfinite_grad_from": self.nonfinite_grad_from,
            "nonfinite_params": self.nonfinite_params,
            "auto_leaves": self.auto_leaves,
            "notes": self.notes,
            "failure": None if self.failure is None else {
                "error": type(self.failure).__name__, "node": getattr(self.failure, "node", None),
                "module": getattr(self.failure, "module", None), "message": str(self.failure)},
            "columns": [c.to_dict() for c in self.columns],
            "rows": self.rows,
        }

    def to_json(self, path: str | None = None, **kwargs: Any) -> str:
        text = json.dumps(_jsonable(self.to_dict()), indent=kwargs.pop("indent", 2), **kwargs)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def to_dataframe(self) -> Any:
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Report.to_dataframe() needs pandas: pip install 'fxdebug[report]' (or pip install pandas).") from None
        keys = [c.key for c in self.columns]
        present = {k for r in self.rows for k in r}
        order = [k for k in keys if k in present] + sorted(present - set(keys))
        df = pd.DataFrame(self.rows, columns=order)
        df.attrs["fxdebug_columns"] = {c.key: c.to_dict() for c in self.columns if c.key in present}
        return df

    def __str__(self) -> str:
        from fxdebug.report.table import format_report

        return format_report(self)

    # -- reading it (logic in report/findings.py, tensorboard.py, table.py) ----------------------
    def findings(self, **thresholds: Any) -> list[Any]:
        """Typed findings (failed checks, NaN/Inf origin, what declared finding rules flag — dead
        activations with ``StatCollector`` —, vanishing/exploding gradients, hot spots), each naming
        node, module, figure and fix; thresholds: ``vanishing=``, ``exploding=``, ``max_findings=``
        and each declared rule's keyword (``dead=``); see ``fxdebug.report.findings``."""
        from fxdebug.report.findings import find

        return find(self, **thresholds)

    def to_tensorboard(self, writer: Any, step: int = 0, **options: Any) -> int:
        """Per-node scalars and histograms to a TensorBoard ``SummaryWriter``, tags grouped by
        module path (see ``fxdebug.report.tensorboard``); returns the number of values written."""
        from fxdebug.report.tensorboard import to_tensorboard

        return to_tensorboard(self, writer, step, **options)

    def table(self, cols: Sequence[str] | None = None, *, width: int | None = None, max_rows: int = 400) -> str:
        """The text table with the columns ``cols`` (row keys, in that order; default: every shown
        column that fits ``width``, the terminal's width when printing to one)."""
        from fxdebug.report.table import format_report

        return format_report(self, max_rows, cols=cols, width=width)

    def scalars(self, prefix: str = "fxdebug/", top_k: int | None = None) -> dict[str, float]:
        """A flat ``{key: float}`` dict for any tracker (wandb, MLflow, accelerate, a Trainer's log):
        a few summaries plus per-node values, at most ``top_k`` of those (non-finite nodes first,
        then the largest); see ``fxdebug.report.scalars``."""
        from fxdebug.report.scalars import scalars

        return scalars(self, prefix=prefix, top_k=top_k)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """Notebook display: the text table and an HTML table (``fxdebug.report.notebook``)."""
        from fxdebug.report.notebook import report_mimebundle

        return report_mimebundle(self, include, exclude)

    def __repr__(self) -> str:
        return (f"Report({len(self.rows)} rows, calls={self.calls}, first_nonfinite={self.first_nonfinite!r}, "
                f"first_nonfinite_grad={self.first_nonfinite_grad!r})")


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _base_row(node: Node) -> dict[str, Any]:
    meta = node.meta.get("fxdebug", {})
    row = {
        "node": node.name,
        "module": module_path(node),
        "op": op_label(node),
        "shape": tuple(meta["shape"]) if "shape" in meta else None,
        "dtype": meta.get("dtype"),
        "device": meta.get("device"),
    }
    for key in ("added_by", "changed_by", "auto_leaf"):
        if key in meta:
            row[key] = meta[key]
    return row


def build_report(gm: GraphModule, *, auto_leaves: dict[str, str] | None = None, frontend: str = "symbolic",
                 notes: Sequence[str] = (), calls: int = 0) -> Report:
    """Collect every observer's summary on ``gm`` into a ``Report`` (this syncs with the device).

    With the cyclic collector paused (``paused_gc``): a row, its columns and its summary are several objects per
    node, freed by none; the collector's sweeps over a large model's heap cost more than building them."""
    with paused_gc():
        return _build_report(gm, auto_leaves=auto_leaves, frontend=frontend, notes=notes, calls=calls)


def _build_report(gm: GraphModule, *, auto_leaves: dict[str, str] | None, frontend: str, notes: Sequence[str],
                  calls: int) -> Report:
    nodes = list(gm.graph.nodes)
    order = {n.name: i for i, n in enumerate(nodes)}
    observers: dict[str, Any] = {}
    declared: list[Column] = []
    observers.update(observers_in(gm))  # call_module observers, lowered op calls, batched calls
    rows = []
    by_name = {n.name: n for n in nodes}
    clocks = {id(o._clock): o._clock for o in observers.values() if o._clock is not None}
    if observers:
        with contextlib.ExitStack() as stack:
            for clock in clocks.values():
                stack.enter_context(clock.reading())  # one device-to-host copy of each state table
            for name in sorted(observers, key=lambda k: order.get(k, 0)):
                node = by_name.get(name)
                if node is None:
                    continue
                row = _base_row(node)
                obs = observers[name]
                declared.extend(obs.columns())
                row["calls"] = obs.calls or calls  # under torch.compile only the device clock counts
                row.update(obs.summary())
                rows.append(row)
    else:
        rows = [_base_row(n) for n in nodes if n.op in ("call_module", "call_function", "call_method") and not is_instrumentation(n)]
    columns = resolve_columns(declared)
    _follow_dtype(gm, rows)
    entered = _backward_origin(rows, columns)
    notes = list(notes) + _runtime_notes(clocks.values())
    origin = _forward_origin(rows, columns)
    return Report(
        rows=rows,
        first_nonfinite=origin,
        first_nonfinite_grad=entered,
        nonfinite_grad_from=_grad_producers(entered, by_name),
        nonfinite_params=_nonfinite_params(gm, by_name.get(origin) if origin is not None else None),
        auto_leaves=dict(auto_leaves or {}),
        frontend=frontend,
        notes=list(notes),
        calls=calls,
        columns=columns,
    )


def merge_reports(parts: Mapping[str, Report], *, frontend: str = "symbolic", notes: Sequence[str] = ()) -> Report:
    """One report over a capture's parts (``Instrumented.parts()``), in execution order.

    Rows of the part at path ``p`` read ``p/node`` (module ``p.module``); the part ``""`` (a
    single-graph capture) keeps its names. The NaN/Inf origins are derived over all rows, by the
    same rules as for one graph. (A row per node copied: the cyclic collector paused, as in ``build_report``.)
    """
    with paused_gc():
        return _merge_reports(parts, frontend=frontend, notes=notes)


def _merge_reports(parts: Mapping[str, Report], *, frontend: str, notes: Sequence[str]) -> Report:
    rows: list[dict[str, Any]] = []
    all_notes, leaves = list(notes), {}
    grad_from: dict[str, list[str]] = {}
    for path, rep in parts.items():
        prefix = f"{path}/" if path else ""
        for row in rep.rows:
            rows.append(dict(row, node=prefix + row["node"], module=f"{path}.{row['module']}".strip("."))
                        if path else row)
        if rep.first_nonfinite_grad is not None:
            grad_from[prefix + rep.first_nonfinite_grad] = [prefix + n for n in rep.nonfinite_grad_from]
        all_notes.extend(f"{path}: {n}" if path else n for n in rep.notes)
        leaves.update({(f"{path}.{k}" if path else k): v for k, v in rep.auto_leaves.items()})
    columns = resolve_columns(c for rep in parts.values() for c in rep.columns)
    entered = _backward_origin(rows, columns)
    origin = _forward_origin(rows, columns)
    bad_params = next(([f"{path}.{p}".strip(".") for p in rep.nonfinite_params] for path, rep in parts.items()
                       if rep.first_nonfinite is not None
                       and (f"{path}/" if path else "") + rep.first_nonfinite == origin), [])
    return Report(
        rows=rows,
        nonfinite_params=bad_params,
        first_nonfinite=origin,
        first_nonfinite_grad=entered,
        nonfinite_grad_from=grad_from.get(entered, []) if entered is not None else [],
        auto_leaves=leaves,
        frontend=frontend,
        notes=all_notes,
        calls=max((rep.calls for rep in parts.values()), default=0),
        columns=columns,
    )


def _runtime_notes(clocks: Any) -> list[str]:
    """Which observation kernel computed the fused statistics, per device type (and why, when the
    native kernel was not in use)."""
    return runtime_notes(c.table.device.type for c in clocks if c.table is not None)


def _first_calls(rows: list[dict[str, Any]], columns: list[Column], phase: str) -> list[tuple[int, int]]:
    """``(earliest call, row index)`` of every row that an ``ORIGIN`` column of ``phase`` marks."""
    keys = [c.key for c in columns_with(columns, ORIGIN, phase)]
    seen = []
    for i, r in enumerate(rows):
        calls = [r[k] for k in keys if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if calls:
            seen.append((min(calls), i))
    return seen


def _forward_origin(rows: list[dict[str, Any]], columns: list[Column]) -> str | None:
    seen = _first_calls(rows, columns, "forward")
    if not seen:
        return None
    return str(rows[min(seen)[1]]["node"])


def _backward_origin(rows: list[dict[str, Any]], columns: list[Column]) -> str | None:
    seen = _first_calls(rows, columns, "grad")
    if not seen:
        return None
    earliest = min(c for c, _ in seen)
    return str(rows[max(i for c, i in seen if c == earliest)]["node"])


def _follow_dtype(gm: GraphModule, rows: list[dict[str, Any]]) -> None:
    """The dtype column as the model is now: shapes and dtypes were learnt when instrumenting, and
    after ``dbg.to(torch.float64)`` (or ``.half()``) the floating rows still said the old dtype.
    When every floating parameter has one dtype now and the rows' floating dtype was another
    single one, those rows take the new dtype. The parameters are those the graph reads (``_read_parameters``)."""
    then = {r["dtype"] for r in rows if isinstance(r.get("dtype"), str) and ("float" in r["dtype"] or "bfloat" in r["dtype"])}
    if len(then) != 1:
        return
    now = {str(p.dtype).replace("torch.", "") for p in _read_parameters(gm) if p.is_floating_point()}
    if len(now) != 1 or now == then:
        return
    old, new = then.pop(), now.pop()
    for r in rows:
        if r.get("dtype") == old:
            r["dtype"] = new


def _read_parameters(gm: GraphModule) -> list[Any]:
    """The parameters ``gm``'s graph reads: its ``get_attr`` targets and its module calls' parameters. A live part
    shares the whole model's modules but reads one block of it: ``gm.parameters()`` for each part's report made a
    report of a model captured as a part per block quadratic in its depth."""
    out: dict[int, Any] = {}
    modules: set[int] = set()
    for node in gm.graph.nodes:
        if node.op not in ("get_attr", "call_module") or is_instrumentation(node):
            continue
        target = str(node.target)
        try:
            if node.op == "get_attr":
                p = gm.get_parameter(target)
                out.setdefault(id(p), p)
                continue
            module = gm.get_submodule(target)
        except AttributeError:  # a buffer, a constant, a target that is not there any more
            continue
        if id(module) not in modules:
            modules.add(id(module))
            out.update((id(p), p) for p in module.parameters())
    return list(out.values())


def _nonfinite_params(gm: GraphModule, node: Node | None) -> list[str]:
    """Parameters and attributes ``node``'s op reads that hold NaN/Inf (read with the report): when
    the weights went bad, the origin's inputs were finite but its weights were not."""
    import torch

    if node is None:
        return []
    found: dict[str, None] = {}

    def check(name: str, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta" \
                and not bool(torch.isfinite(t.detach()).all()):
            found[name] = None

    def owned(path: str, recurse: bool) -> None:
        try:
            mod = gm.get_submodule(path)
        except AttributeError:
            return
        for n, p in mod.named_parameters(recurse=recurse):
            check(f"{path}.{n}".strip("."), p)

    if node.op == "call_module":
        owned(str(node.target), True)
    else:
        for a in node.all_input_nodes:
            if a.op == "get_attr":
                try:
                    check(str(a.target), gm.get_parameter(str(a.target)))
                except AttributeError:
                    with contextlib.suppress(AttributeError):
                        check(str(a.target), gm.get_buffer(str(a.target)))
        path = module_path(node)
        if path:
            owned(path, False)
    return list(found)


def _grad_producers(entered: str | None, by_name: dict[str, Node]) -> list[str]:
    """The users of ``entered``: one of their backward computations produced the bad gradient."""
    node = by_name.get(entered) if entered is not None else None
    if node is None:
        return []
    return [u.name for u in node.users if not is_instrumentation(u) and u.op != "output"]
