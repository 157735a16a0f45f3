"""``Report.findings()``: what in a report deserves attention, as typed findings a person acts on.

Each finding names the node and module, the figure that triggered it, the rule (with its
threshold) and a suggested fix. Kinds, in the order they are listed:

==========================  ==================================================================
``CheckFailed``             a batch failed a check (shape, device, raise-mode NaN) in ``collect``
``NonFiniteOrigin``         the first node that turned finite inputs into NaN/Inf (forward), or
                            where a non-finite gradient entered (backward); when that first node
                            is a graph input (a placeholder) the data already carried it, and the
                            finding says to check the batch
*declared kinds*            a probe column declared with a ``FindingRule`` (``Column(finding=)``)
                            whose value reaches its threshold — ``StatCollector``'s dead fraction
                            gives ``dead_activations`` (threshold keyword ``dead=``)
``ExplodingGradients``      max |gradient| above ``exploding`` (default 1e3) over a run of nodes
``VanishingGradients``      max |gradient| below ``vanishing`` (default 1e-7) over a run of nodes,
                            e.g. "gradients vanish at and below layer1.1: max |g| 2e-9"
``HotSpot``                 any other probe column declared with the ``COLOR`` role whose value
                            reaches its declared threshold
==========================  ==================================================================

Gradient figures come from the first column declared with the ``GRADIENT`` role that the rows fill
(``ParamGrads``: parameter gradients, what ``plot_grad_flow`` reads), else from the gradient-phase
``min`` / ``max`` of node outputs (``StatCollector(grads=True)``). Thresholds are keyword
arguments of ``Report.findings`` (``FindingRules`` holds the gradient defaults; a declared rule's
``option`` names its own keyword).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

from fxdebug.errors import UsageError
from fxdebug.runtime.columns import COLOR, GRADIENT, GRADIENT_MEAN, ORIGIN, Column, FindingRule

__all__ = [
    "CheckFailed",
    "ExplodingGradients",
    "Finding",
    "FindingRules",
    "HotSpot",
    "NonFiniteOrigin",
    "VanishingGradients",
    "activation_row",
    "declared_rows",
    "find",
    "finding_class",
    "grad_figures",
]

_ACTIVATIONS = frozenset({
    "relu", "relu6", "leaky_relu", "leakyrelu", "rrelu", "prelu", "gelu", "silu", "swish", "elu", "selu", "celu",
    "hardswish", "hardsigmoid", "mish", "softplus", "hardtanh", "sigmoid", "tanh", "glu", "quick_gelu"})


def activation_row(row: dict[str, Any]) -> bool:
    """Whether ``row``'s op is an activation function (where a dead fraction means dead units).

    Reads the op label: ``ReLU`` (a module), ``F.relu`` / ``torch.relu`` / ``.relu_`` (calls),
    ``aten.relu.default`` (export graphs).
    """
    op = str(row.get("op") or "").lower()
    if op.startswith("aten."):
        op = op.split(".")[1] if op.count(".") >= 1 else op
    name = op.rsplit(".", 1)[-1].rstrip("_")
    return name in _ACTIVATIONS


@dataclass(frozen=True)
class FindingRules:
    """Thresholds of the findings (documented defaults; override per call of ``Report.findings``).

    Attributes:
        vanishing: a max |gradient| below this is vanishing (float32 updates of that size do
            not change weights of order 1e-1..1: ``1e-7 ~ eps * 1``).
        exploding: a max |gradient| above this is exploding (an SGD step at lr 1e-3 would move a
            weight by more than 1).
        max_findings: at most this many findings of one kind (the worst first).
        declared: thresholds of declared finding rules, by their ``option`` keyword (``dead``).
    """

    vanishing: float = 1e-7
    exploding: float = 1e3
    max_findings: int = 8
    declared: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """One thing a report says needs attention.

    Attributes:
        node: the node it is about (for a run of nodes: the one named in the message).
        module: that node's module path (``""`` for the root).
        figure: the number that triggered it (a fraction, a gradient magnitude, a call index).
        message: one sentence naming node, module and figure.
        fix: what to try.
        nodes: every node the finding covers (a run of vanishing layers), in graph order.
    """

    kind: ClassVar[str] = "finding"
    severity: ClassVar[str] = "warning"
    node: str | None
    module: str
    figure: float | None
    message: str
    fix: str
    nodes: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return f"{self.message} Fix: {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "severity": self.severity, "node": self.node, "module": self.module,
                "figure": self.figure, "message": self.message, "fix": self.fix, "nodes": list(self.nodes)}


class CheckFailed(Finding):
    kind = "check_failed"
    severity = "error"


class NonFiniteOrigin(Finding):
    kind = "nonfinite_origin"
    severity = "error"


class ExplodingGradients(Finding):
    kind = "exploding_gradients"


class VanishingGradients(Finding):
    kind = "vanishing_gradients"


class HotSpot(Finding):
    kind = "hot_spot"


_DECLARED: dict[tuple[str, str], type[Finding]] = {}


def finding_class(rule: FindingRule) -> type[Finding]:
    """The ``Finding`` subclass of a declared rule's kind (one class per kind and severity)."""
    key = (rule.kind, rule.severity)
    if key not in _DECLARED:
        name = "".join(w.capitalize() for w in rule.kind.split("_")) or "Declared"
        _DECLARED[key] = type(name, (Finding,), {"kind": rule.kind, "severity": rule.severity,
                                                 "__module__": __name__})
    return _DECLARED[key]


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0 or not math.isfinite(v):
        return str(v) if v else "0"
    return f"{v:.2g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.1e}"


def _mod(row: dict[str, Any]) -> str:
    return row.get("module") or ""


def _where(row: dict[str, Any]) -> str:
    return f"node '{row['node']}' (module {_mod(row) or '<root>'}, {row.get('op')})"


# -- gradient figures -------------------------------------------------------------------------------
def _columns(report: Any, role: str) -> list[Column]:
    columns_with = getattr(report, "columns_with", None)
    return list(columns_with(role)) if columns_with is not None else []


def grad_figures(report: Any) -> tuple[str, list[tuple[dict[str, Any], float, float | None]]]:
    """``(what, [(row, max |g|, mean |g|), ...])`` in graph order.

    From the first ``GRADIENT`` column some row fills (``what`` is its label, e.g. ``"parameter
    gradients"``), with the ``GRADIENT_MEAN`` column of the same probe phase beside it; else from
    the gradient-phase ``min`` / ``max`` of node outputs (``what``: ``"gradients"``)."""
    rows = report.rows
    means = _columns(report, GRADIENT_MEAN)
    for col in _columns(report, GRADIENT):
        filled = [r for r in rows if _num(r.get(col.key)) is not None and col.applies(r)]
        if filled:
            mean = next((m for m in means if m.phase == col.phase), None)
            return col.label or col.key, [(r, float(r[col.key]), _num(r.get(mean.key)) if mean else None)
                                          for r in filled]
    out = []
    for r in rows:
        lo, hi = _num(r.get("grad_min")), _num(r.get("grad_max"))
        if lo is None or hi is None:
            continue
        out.append((r, max(abs(lo), abs(hi)), _num(r.get("grad_mean_abs"))))
    return "gradients", out


def _runs(items: list[tuple[dict[str, Any], float, float | None]], bad: Any) -> Iterator[list[tuple[dict[str, Any], float, float | None]]]:
    run: list[tuple[dict[str, Any], float, float | None]] = []
    for item in items:
        if bad(item[1]):
            run.append(item)
        elif run:
            yield run
            run = []
    if run:
        yield run


def _gradient_findings(report: Any, rules: FindingRules) -> list[Finding]:
    what, items = grad_figures(report)
    items = [it for it in items if math.isfinite(it[1])]  # non-finite gradients are the origin's business
    out: list[Finding] = []
    for run in _runs(items, lambda g: g > rules.exploding):
        worst = max(run, key=lambda it: it[1])
        top = run[0][0]  # gradients grow towards the input: the first of the run is where it ends up largest
        span = f"from {run[0][0]['node']} to {run[-1][0]['node']}" if len(run) > 1 else f"at {run[0][0]['node']}"
        out.append(ExplodingGradients(
            node=worst[0]["node"], module=_mod(worst[0]), figure=worst[1], nodes=tuple(it[0]["node"] for it in run),
            message=f"{what} explode {span} ({len(run)} node(s)): max |g| {_fmt(worst[1])} at {_where(worst[0])}, "
                    f"above {_fmt(rules.exploding)}; the first of the run is {top['node']}.",
            fix="clip gradients (torch.nn.utils.clip_grad_norm_), lower the learning rate or the loss scale, and "
                "check the initialisation and normalisation of these layers."))
    for run in _runs(items, lambda g: g < rules.vanishing):
        last = run[-1][0]  # closest to the loss: below it nothing learns
        worst = max(run, key=lambda it: it[1])
        below = "below" if run[0] is items[0] else "between"
        span = (f"at and below {_mod(last) or last['node']}" if below == "below" else
                f"from {run[0][0]['node']} to {last['node']}")
        out.append(VanishingGradients(
            node=last["node"], module=_mod(last), figure=worst[1], nodes=tuple(it[0]["node"] for it in run),
            message=f"{what} vanish {span}: max |g| {_fmt(worst[1])} over {len(run)} node(s) up to {_where(last)}, "
                    f"below {_fmt(rules.vanishing)}.",
            fix="look for a saturating activation, a dead ReLU or a detach/zero gradient scale right after "
                f"{last['node']}; add residual connections or normalisation, or re-initialise those layers."))
    return out


# -- the other kinds --------------------------------------------------------------------------------
_OP_FIX = {
    "log": "clamp its input first (x.clamp_min(eps)) or use log1p / log_softmax",
    "sqrt": "clamp its input to >= eps before sqrt (the gradient of sqrt at 0 is Inf)",
    "rsqrt": "add eps inside rsqrt",
    "div": "guard the denominator (x / (y + eps)) or check why it reaches 0",
    "truediv": "guard the denominator (x / (y + eps)) or check why it reaches 0",
    "exp": "subtract the max first (logsumexp / softmax do it) or compute in float32",
    "pow": "check for negative bases with fractional exponents and for overflow",
    "softmax": "use a large negative instead of -inf for masked rows (a fully masked row gives NaN)",
}


# the origin is a graph input (a placeholder): no op of the model made the NaN/Inf, it came in with the call
_INPUT_CARRIED = "is an input of the model's graph and already carried NaN/Inf when it came in (no op made it)"
_DATA_FIX = ("check the data, not the model: the batch itself holds NaN/Inf (torch.isfinite(batch).all()). Look at the "
             "data pipeline and its preprocessing (a division by a zero std, log of 0, a corrupt sample); "
             "NaNCheck(samples=True) names the rows (report().origin_samples); fxdebug.guard skips such steps.")
_BETWEEN_PARTS = (" This graph is one part of the model: the value may also come from the code that ran before it, "
                  "outside the capture (see report().notes).")


def _op_fix(row: dict[str, Any], phase: str, via: bool = True) -> str:
    op = str(row.get("op") or "").lower()
    for key, fix in _OP_FIX.items():
        if key in op:
            return fix + "."
    if phase == "backward" and not via:  # no observed op of the graph sent it: it came from the loss
        return ("the non-finite gradient came into the graph from outside it (the loss or the code that calls the "
                "model): check the loss for log(0), division by zero or an overflowing scale.")
    if phase == "backward":
        return ("check the backward of the ops that use this value (nonfinite_grad_from); clamp their inputs "
                "away from singular points.")
    return "check this op's inputs (min/max in the report); in half precision check for overflow."


def _graphs(gm: Any) -> list[Any]:
    """Every graph of ``gm``: its parts' (a live module has one per graph Dynamo handed over), else its own."""
    if gm is None:
        return []
    parts = getattr(gm, "parts", None)
    if callable(parts):
        return [p.graph for p in parts().values()]
    graph = getattr(gm, "graph", None)
    return [graph] if graph is not None else []


def _input_mins(gm: Any, name: str, report: Any) -> str:
    """``"; its input 'x' has min -0.3"`` from the rows of ``name``'s inputs, when the graph is known."""
    node = next((n for g in _graphs(gm) for n in g.nodes if n.name == name), None)
    if node is None:
        return ""
    parts = []
    for a in node.all_input_nodes:
        if _has(report, a.name) and _num(report.row(a.name).get("min")) is not None:
            parts.append(f"'{a.name}' has min {_fmt(float(report.row(a.name)['min']))}")
    return ("; its input " + ", ".join(parts)) if parts else ""


def _nonfinite_findings(report: Any, gm: Any = None) -> list[Finding]:
    out: list[Finding] = []
    for phase, name in (("forward", getattr(report, "first_nonfinite", None)),
                        ("backward", getattr(report, "first_nonfinite_grad", None))):
        if name is None:
            continue
        try:
            row = report.row(name)
        except KeyError:
            row = {"node": name, "module": "", "op": "?"}
        origins = [c.key for c in _columns(report, ORIGIN) if c.phase == ("forward" if phase == "forward" else "grad")]
        firsts = [v for v in (_num(row.get(k)) for k in origins) if v is not None]
        first = min(firsts) if firsts else None
        via = list(getattr(report, "nonfinite_grad_from", []) or []) if phase == "backward" else []
        bad_params = list(getattr(report, "nonfinite_params", None) or []) if phase == "forward" else []
        data = phase == "forward" and not bad_params and row.get("op") == "placeholder"  # a graph input: it came in so
        text = (f"NaN/Inf origin (forward): {_where(row)} " + (
                    f"made NaN/Inf from its non-finite parameter(s) {', '.join(bad_params)} (the weights went bad)"
                    if bad_params else _INPUT_CARRIED if data else "turned finite inputs into NaN/Inf")
                if phase == "forward" else
                f"NaN/Inf origin (backward): a non-finite gradient entered at {_where(row)}"
                + (f", from the backward of {', '.join(via)}" if via else ""))
        if first is not None:
            text += f", first in call {int(first)}"
        if phase == "forward" and not bad_params and not data:
            text += _input_mins(gm, name, report)
        fix = _op_fix(report.row(via[0]) if via and _has(report, via[0]) else row, phase, bool(via))
        if data:
            fix = _DATA_FIX + (_BETWEEN_PARTS if "/" in name else "")
        if bad_params:
            fix = ("the weights were already NaN/Inf before this call: an earlier optimizer step or a loaded checkpoint "
                   "made them so. Lower the learning rate or clip gradients, skip non-finite steps (fxdebug.guard), "
                   "or reload a good checkpoint.")
        out.append(NonFiniteOrigin(node=name, module=_mod(row), figure=first, message=text + ".", fix=fix))
    return out


def _has(report: Any, node: str) -> bool:
    try:
        report.row(node)
    except KeyError:
        return False
    return True


class _Fields(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return ""


def _threshold(col: Column, rules: FindingRules) -> float | None:
    rule = col.finding
    if rule is not None and rule.option is not None and rule.option in rules.declared:
        return rules.declared[rule.option]
    return None if col.threshold is None else float(col.threshold)


def declared_rows(report: Any, col: Column, threshold: float | None = None) -> list[dict[str, Any]]:
    """Rows ``col`` applies to whose value reaches ``threshold`` (default: the column's), worst first."""
    limit = col.threshold if threshold is None else threshold
    if limit is None:
        return []
    hit = [r for r in report.rows if col.applies(r) and (_num(r.get(col.key)) or 0.0) >= limit
           and _num(r.get(col.key)) is not None]
    return sorted(hit, key=lambda r: -float(r[col.key]))


def _declared_findings(report: Any, rules: FindingRules) -> list[Finding]:
    out: list[Finding] = []
    columns = getattr(report, "columns", None) or []
    for col in columns:
        rule = col.finding
        limit = _threshold(col, rules)
        if rule is None or limit is None:
            continue
        cls = finding_class(rule)
        for r in declared_rows(report, col, limit):
            value = float(r[col.key])
            fields = _Fields(r)
            fields.update(where=_where(r), node=r["node"], value=_fmt(value), pct=f"{100 * value:.0f}%",
                          threshold=_fmt(limit), threshold_pct=f"{100 * limit:.0f}%", option=rule.option or "")
            out.append(cls(node=r["node"], module=_mod(r), figure=value, nodes=(r["node"],),
                           message=rule.message.format_map(fields), fix=rule.fix.format_map(fields)))
    return out


def _hot_spots(report: Any) -> list[Finding]:
    out: list[Finding] = []
    for col in _columns(report, COLOR):
        if col.finding is not None or col.threshold is None:
            continue  # a declared rule judges it (above)
        for r in report.rows:
            v = _num(r.get(col.key)) if col.applies(r) else None
            if v is not None and v >= col.threshold:
                label = col.label or col.key
                out.append(HotSpot(node=r["node"], module=_mod(r), figure=v, nodes=(r["node"],),
                                   message=f"{label} {_fmt(v)} at {_where(r)} reaches its threshold {_fmt(col.threshold)}"
                                           + (f" ({col.doc})" if col.doc else "") + ".",
                                   fix=f"look at {r['node']} first: the {label} column marks the nodes that "
                                       "stand out (see the probe that declares it)."))
    return out


def _failure(report: Any) -> list[Finding]:
    exc = getattr(report, "failure", None)
    if exc is None:
        return []
    message = getattr(exc, "message", None) or str(exc)
    kind = type(exc).__name__
    fix = {"ShapeMismatchError": "fix the layer's size or the input shape as the message says.",
           "DeviceMismatchError": "move the model and the batch to one device (model.to(device), batch.to(device)).",
           "NonFiniteError": "see the NaN/Inf origin; run NaNCheck(mode='record') to see the whole picture."}.get(
        kind, "see the message.")
    node = getattr(exc, "node", None)
    module = getattr(exc, "module", None) or ""
    return [CheckFailed(node=node, module=module, figure=None, nodes=(node,) if node else (),
                        message=f"{kind}: {message}", fix=fix)]


def find(report: Any, *, vanishing: float | None = None, exploding: float | None = None,
         max_findings: int | None = None, gm: Any = None, **thresholds: float) -> list[Finding]:
    """The findings of ``report`` (see the module docstring); thresholds default to ``FindingRules``
    and to the declared columns' own thresholds; ``thresholds`` are declared rules' ``option``
    keywords (``dead=0.9`` for ``StatCollector``'s dead fraction).

    ``gm``: the instrumented module, when at hand: the NaN/Inf origin then also names its inputs'
    minimum (``log`` of an input whose min is -0.3)."""
    base = FindingRules()
    options = sorted({c.finding.option for c in (getattr(report, "columns", None) or [])
                      if c.finding is not None and c.finding.option})
    unknown = sorted(set(thresholds) - set(options))
    if unknown:
        raise UsageError(f"findings({', '.join(f'{k}=' for k in unknown)}...): no such threshold; the thresholds are "
                         f"{', '.join(['vanishing', 'exploding', 'max_findings', *options])} (declared rules add "
                         "theirs: Column(finding=FindingRule(option=...))).")
    rules = FindingRules(
        vanishing=base.vanishing if vanishing is None else vanishing,
        exploding=base.exploding if exploding is None else exploding,
        max_findings=base.max_findings if max_findings is None else max_findings,
        declared={k: float(v) for k, v in thresholds.items()},
    )
    if not 0 < rules.vanishing < rules.exploding:
        raise UsageError(f"findings(vanishing={rules.vanishing}, exploding={rules.exploding}): need 0 < vanishing < exploding.")
    groups = [_failure(report), _nonfinite_findings(report, gm), _declared_findings(report, rules),
              _gradient_findings(report, rules), _hot_spots(report)]  # causes (dead units) before symptoms
    out: list[Finding] = []
    for group in groups:
        by_kind: dict[str, int] = {}
        for f in group:
            by_kind[f.kind] = by_kind.get(f.kind, 0) + 1
            if by_kind[f.kind] <= rules.max_findings:
                out.append(f)
    return out
