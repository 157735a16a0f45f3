"""What every frontend says about a capture: ``TraceInfo`` (and ``LeafInfo``, one module traced as a leaf).

Each frontend (symbolic, export, subtrees, and the live Dynamo capture) fills one ``TraceInfo``;
``Instrumented.trace_info`` and the report read it. It lives here, not in a frontend's module,
because it is every frontend's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LeafInfo", "TraceInfo"]


@dataclass(frozen=True)
class LeafInfo:
    """Why a module was traced as an opaque leaf."""

    path: str
    module_type: str
    reason: str
    location: str | None  # "model.py:41 `if x.sum() > 0:`"

    def __str__(self) -> str:
        where = f" at {self.location}" if self.location else ""
        return f"{self.path} ({self.module_type}): {self.reason}{where}"


@dataclass
class TraceInfo:
    """How a model was captured: which frontend, what became a leaf, how long it took, coverage."""

    frontend: str = "symbolic"
    auto_leaves: dict[str, LeafInfo] = field(default_factory=dict)
    user_leaves: tuple[str, ...] = ()
    concrete_args: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    constants: dict[str, Any] = field(default_factory=dict)  # tensors forward creates (torch.ones(4))
    # frontend "subtrees": fractions of parameters / executed aten ops under instrumentation,
    # {module path: why it stayed eager} ("" is the root), {module path: frontend that captured it}
    coverage: dict[str, float] = field(default_factory=dict)
    eager_modules: dict[str, str] = field(default_factory=dict)
    captured: dict[str, str] = field(default_factory=dict)
    # plain attributes forward read while being captured ((module path, name, value)): a graph may be
    # specialised to them (``if self.use_cache:``); the snapshot cache captures again when one changes
    # (fxdebug.instrumented.snapshot_cache)
    guards: list[tuple[str, str, Any]] = field(default_factory=list)
    # what a snapshot capture assumed about the model (its module tree, hooks, call signature), checked
    # before every call: fxdebug.capture.staleness.StalenessGuard
    staleness: Any = None
