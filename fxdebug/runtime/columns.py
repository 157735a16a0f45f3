"""Probe column declarations: what a probe reports, and what each number means to fxdebug.

A probe's ``summary()`` returns plain numbers keyed by column name. On its own a key is just a
key; a ``Column`` tells every output what to do with it: the report derives the NaN/Inf origin
from columns with the ``ORIGIN`` role, the text table and DataFrame order and format columns by
their declarations and leave ``HIDDEN`` ones out of the table, the picture colours nodes by
``COLOR`` columns, and CLI findings list nodes whose ``NONFINITE`` column is non-zero. No output
knows the built-in passes' keys by name, so a user's probe gets the same treatment::

    class Spikes(fxdebug.authoring.Probe):
        key = "spikes"
        columns = (fxdebug.Column("spike_calls", roles=fxdebug.authoring.NONFINITE),
                   fxdebug.Column("spike_first_call", roles=fxdebug.authoring.ORIGIN),)

Columns of the gradient phase are declared once with ``phase="grad"`` (or ``"both"``): their row
key is the name with ``grad_`` in front, the prefix the observer gives gradient summaries.

Beyond roles, a column may declare what the outputs should do with it, so none of them needs to
know which pass made it: ``only=`` (the rows where the number means something: a dead fraction
only after activations), ``merge=`` (how ``report(all_ranks=True)`` merges the ranks' values),
``finding=`` (a ``FindingRule``: ``Report.findings()`` turns values at the threshold into typed
findings) and ``answers=`` (a ``Report`` attribute, such as ``history``, computed from the rows by
``reading=``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

__all__ = [
    "BASE_COLUMNS",
    "COLOR",
    "Column",
    "FindingRule",
    "GRADIENT",
    "GRADIENT_MEAN",
    "HIDDEN",
    "MERGES",
    "NONFINITE",
    "ORIGIN",
    "ROLES",
    "VALUE",
    "columns_with",
    "resolve_columns",
]

VALUE = "value"
"""An ordinary number: shown in the table, the DataFrame, JSON and the picture's node label."""
HIDDEN = "hidden"
"""Kept in ``Report.rows``, JSON and the DataFrame, left out of the text table and node labels."""
ORIGIN = "origin"
"""The index of the earliest forward call in which the node saw a non-finite value (``None``:
never). The report takes the first node of the earliest such call as ``first_nonfinite`` (for
``phase="grad"``: the last in graph order, since gradients flow backwards)."""
NONFINITE = "nonfinite"
"""A count of calls (or values) that were non-finite; non-zero marks the node bad
(``Report.nonfinite_nodes``, ``Report.ok``, CLI findings, the picture's red)."""
COLOR = "color"
"""A number in [0, 1] the picture colours the node by; at or above ``threshold`` it is a hot spot
(CLI findings name it)."""
GRADIENT = "gradient"
"""The largest |gradient| seen at the node. The vanishing/exploding findings and
``plot.gradient_flow`` read the first ``GRADIENT`` column some row fills (its ``label`` names the
figure in messages: ``"parameter gradients"``)."""
GRADIENT_MEAN = "gradient_mean"
"""The mean |gradient| beside a ``GRADIENT`` column (drawn by ``plot.gradient_flow``)."""
ROLES = (VALUE, HIDDEN, ORIGIN, NONFINITE, COLOR, GRADIENT, GRADIENT_MEAN)
MERGES = ("sum", "min", "max", "same")
"""Named merge rules: ``sum`` (counts), ``min`` / ``max`` (extremes, call indices), ``same`` (a
fact every rank agrees on; left out with a note when they differ). A callable ``merge`` gets the
ranks' rows of one node (each a dict, with ``chan_max`` where the runtime kept per-channel maxima)
and returns the merged value, or ``None`` for "cannot tell"."""


@dataclass(frozen=True)
class FindingRule:
    """How ``Report.findings()`` reads a column: a value at or above the column's ``threshold``
    (on a row the column ``only`` applies to) is a finding of ``kind``.

    Args:
        kind: the finding's kind (``"dead_activations"``); its class is made once per kind.
        message: a sentence, formatted with ``where`` (node, module, op), ``node``, ``value``,
            ``pct`` (the value as a percentage), ``threshold``, ``threshold_pct``, ``option`` and
            every key of the row (absent keys read as empty).
        fix: what to try (formatted the same way).
        option: the keyword of ``Report.findings`` that overrides the threshold (``dead=0.9``).
        severity: ``"warning"`` or ``"error"``.
    """

    kind: str
    message: str
    fix: str
    option: str | None = None
    severity: str = "warning"
_PHASES = ("forward", "grad", "both")


@dataclass(frozen=True)
class Column:
    """One report column a probe declares.

    Args:
        name: the key the probe's ``summary()`` returns (without ``grad_`` for the grad phase).
        roles: one role or several (``VALUE``, ``HIDDEN``, ``ORIGIN``, ``NONFINITE``, ``COLOR``).
        format: how the table writes a value: a format spec (``".1%"``), a ``"{:...}"`` template
            or a callable; ``None`` uses the table's default for numbers.
        phase: ``"forward"``, ``"grad"`` (row key ``grad_<name>``) or ``"both"``.
        doc: one line saying what the number is (shown by viewers as a tooltip).
        threshold: for ``COLOR``: the value at or above which the node is a hot spot.
        label: a short human name for viewers and messages (defaults to the row key).
        only: the rows where the value means something (``row -> bool``); tables, pictures,
            TensorBoard and findings leave it out elsewhere (the rows keep it).
        merge: how ranks merge it: one of ``MERGES`` or a callable (see ``MERGES``); ``None``:
            by role (``NONFINITE`` sums, ``ORIGIN`` takes the earliest), else ``"same"``.
        finding: a ``FindingRule`` turning values at ``threshold`` into findings (instead of
            the generic hot-spot finding of ``COLOR`` columns).
        answers: the ``Report`` attribute this column answers (``"history"``,
            ``"precision_origin"``), computed by ``reading(rows)``.
    """

    name: str
    roles: frozenset[str] | str | Iterable[str] = frozenset({VALUE})
    format: str | Callable[[Any], str] | None = None
    phase: str = "forward"
    doc: str = ""
    threshold: float | None = None
    label: str | None = None
    only: Callable[[dict[str, Any]], bool] | None = field(default=None, compare=False)
    merge: str | Callable[[list[dict[str, Any]]], Any] | None = field(default=None, compare=False)
    finding: FindingRule | None = None
    answers: str | None = None
    reading: Callable[[Sequence[dict[str, Any]]], Any] | None = field(default=None, compare=False)
    _key: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        roles = frozenset({self.roles} if isinstance(self.roles, str) else self.roles) or frozenset({VALUE})
        unknown = roles - set(ROLES)
        if unknown:
            raise ValueError(f"Column({self.name!r}): unknown role(s) {sorted(unknown)}; roles are {', '.join(ROLES)}.")
        if self.phase not in _PHASES:
            raise ValueError(f"Column({self.name!r}, phase={self.phase!r}): phase is one of {', '.join(_PHASES)}.")
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"Column(name={self.name!r}): a column needs a non-empty string name.")
        if isinstance(self.merge, str) and self.merge not in MERGES:
            raise ValueError(f"Column({self.name!r}, merge={self.merge!r}): a merge rule is one of "
                             f"{', '.join(MERGES)} or a callable.")
        if (self.answers is None) != (self.reading is None):
            raise ValueError(f"Column({self.name!r}): answers= and reading= go together (the Report attribute and "
                             "the function computing it from the rows).")
        object.__setattr__(self, "roles", roles)

    @property
    def key(self) -> str:
        """The row key (``grad_<name>`` for a resolved grad-phase column)."""
        return self._key or self.name

    def has(self, role: str) -> bool:
        return role in self.roles

    def applies(self, row: dict[str, Any]) -> bool:
        """Whether ``row``'s value of this column means something (see ``only``)."""
        return self.only is None or bool(self.only(row))

    @property
    def merge_rule(self) -> str | Callable[[list[dict[str, Any]]], Any]:
        """The declared merge rule, or the one its roles imply."""
        if self.merge is not None:
            return self.merge
        if self.has(NONFINITE):
            return "sum"
        if self.has(ORIGIN):
            return "min"
        return "same"

    @property
    def shown(self) -> bool:
        """Whether the text table and node labels show it."""
        return HIDDEN not in self.roles

    def keys(self) -> list[tuple[str, str]]:
        """``[(row key, phase), ...]`` this declaration covers."""
        phases = ("forward", "grad") if self.phase == "both" else (self.phase,)
        return [(self.name if p == "forward" else f"grad_{self.name}", p) for p in phases]

    def format_value(self, v: Any) -> str | None:
        """``v`` written by this column's ``format``; ``None`` when it has none (or it does not apply)."""
        fmt = self.format
        if fmt is None or v is None or isinstance(v, bool):
            return None
        try:
            if callable(fmt):
                return str(fmt(v))
            return fmt.format(v) if "{" in fmt else format(v, fmt)
        except (TypeError, ValueError):
            return None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "roles": sorted(self.roles), "phase": self.phase,
                "doc": self.doc, "threshold": self.threshold, "label": self.label or self.key,
                "format": self.format if isinstance(self.format, str) else None,
                "merge": self.merge_rule if isinstance(self.merge_rule, str) else "custom",
                "finding": self.finding.kind if self.finding is not None else None, "answers": self.answers}


BASE_COLUMNS: tuple[Column, ...] = (
    Column("node", doc="the graph node"),
    Column("module", doc="module path of the node"),
    Column("op", doc="what the node computes"),
    Column("shape", doc="output shape seen by the example run"),
    Column("dtype", doc="output dtype"),
    Column("device", roles=HIDDEN, doc="output device"),
    Column("calls", doc="forward calls the node was observed in"),
    Column("added_by", roles=HIDDEN, doc="pass that added the node"),
    Column("changed_by", roles=HIDDEN, doc="passes that changed the node"),
    Column("auto_leaf", roles=HIDDEN, doc="why the node's module was kept as a leaf"),
)
"""Columns every report row has, whatever the probes (``calls`` is filled by the report)."""


def resolve_columns(declared: Iterable[Column]) -> list[Column]:
    """Base columns, then the declared ones with their row keys, forward before grad, deduplicated
    by row key (the first declaration of a key wins)."""
    seen = {c.key for c in BASE_COLUMNS}
    fwd: list[Column] = []
    grad: list[Column] = []
    for col in declared:
        for key, phase in col.keys():
            if key in seen:
                continue
            seen.add(key)
            (fwd if phase == "forward" else grad).append(replace(col, phase=phase, _key=key))
    return [*BASE_COLUMNS, *fwd, *grad]


def columns_with(columns: Sequence[Column], role: str, phase: str | None = None) -> list[Column]:
    """The columns holding ``role`` (and of ``phase``, when given)."""
    return [c for c in columns if c.has(role) and (phase is None or c.phase == phase)]
