"""fxdebug: graph-level debugging for PyTorch models.

Trace a model into a torch.fx graph, run composable passes that observe (shapes, NaN/Inf,
statistics, devices) or transform it, read a per-node report, and draw the annotated graph::

    import fxdebug
    from fxdebug.passes import NaNCheck, StatCollector

    dbg = fxdebug.instrument(model, passes=[NaNCheck(), StatCollector()], example_inputs=(x,))
    y = dbg(x)
    print(dbg.report())
    dbg.render("model.svg")

Two public surfaces: ``fxdebug`` (this module; ``__all__`` is the user API, pinned by
tests/test_public_api.py) and ``fxdebug.authoring`` (the pass-author API: probes, columns, node
metadata, selection, rewriting). Built-in passes live in ``fxdebug.passes``; ``fxdebug.plot``,
``fxdebug.numerics`` and ``fxdebug.when`` are public subpackages. Every other module is private
implementation; a pass-author name (``Probe``, ``describe``, ``replace_pattern``, ...) is imported from
``fxdebug.authoring``, not from here.
"""

# Every public name is loaded on first use (PEP 562): ``import fxdebug`` costs ``import torch`` and
# little more, and the heavy parts (Dynamo's tracer, torch.export, the renderer, numerics) load when a
# name that needs them is first touched. Names and where they live, one table; type checkers read the
# same imports below (tests/test_startup.py checks the two agree and that each name resolves).
import sys as _sys
from types import ModuleType as _ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxdebug.numerics.collect import collect
    from fxdebug.runtime.columns import Column
    from fxdebug.authoring.context import PassContext
    from fxdebug.errors import ArgumentTypeError, DeviceMismatchError, DistributedError, FxDebugError, InplaceError, MissingInputsError, NonFiniteError, PassError, ShapeMismatchError, TraceError, UsageError, VerificationError
    from fxdebug.numerics.gradcheck import GradcheckResult, gradcheck
    from fxdebug import when
    from fxdebug.instrumented.networkx import to_networkx
    from fxdebug import authoring
    from fxdebug.api import instrument, render, trace
    from fxdebug.render.draw import RenderOptions
    from fxdebug.instrumented.base import Instrumented
    from fxdebug import numerics
    from fxdebug.numerics import diff, precision_plan, repro
    from fxdebug.numerics.align import Alignment, align
    from fxdebug.graph.module_outputs import outputs_of
    from fxdebug.authoring.pipeline import Pass, PassManager, PassResult, graph_pass, node_pass
    from fxdebug.report.report import Report
    from fxdebug import plot
    from fxdebug.numerics.sensitivity import Sensitivity, sensitivity
    from fxdebug.capture.symbolic import Inputs
    from fxdebug.capture.trace_info import LeafInfo, TraceInfo
    from fxdebug.instrumented.verify import Verification, verify
    from fxdebug.training.guard import guard

_LAZY: dict[str, str] = {
    "Alignment": "fxdebug.numerics.align",
    "ArgumentTypeError": "fxdebug.errors",
    "Column": "fxdebug.runtime.columns",
    "DeviceMismatchError": "fxdebug.errors",
    "DistributedError": "fxdebug.errors",
    "FxDebugError": "fxdebug.errors",
    "GradcheckResult": "fxdebug.numerics.gradcheck",
    "InplaceError": "fxdebug.errors",
    "Inputs": "fxdebug.capture.symbolic",
    "Instrumented": "fxdebug.instrumented.base",
    "LeafInfo": "fxdebug.capture.trace_info",
    "MissingInputsError": "fxdebug.errors",
    "NonFiniteError": "fxdebug.errors",
    "Pass": "fxdebug.authoring.pipeline",
    "PassContext": "fxdebug.authoring.context",
    "PassError": "fxdebug.errors",
    "PassManager": "fxdebug.authoring.pipeline",
    "PassResult": "fxdebug.authoring.pipeline",
    "RenderOptions": "fxdebug.render.draw",
    "Report": "fxdebug.report.report",
    "Sensitivity": "fxdebug.numerics.sensitivity",
    "ShapeMismatchError": "fxdebug.errors",
    "TraceError": "fxdebug.errors",
    "TraceInfo": "fxdebug.capture.trace_info",
    "UsageError": "fxdebug.errors",
    "Verification": "fxdebug.instrumented.verify",
    "VerificationError": "fxdebug.errors",
    "align": "fxdebug.numerics.align",
    "authoring": "fxdebug.authoring",
    "collect": "fxdebug.numerics.collect",
    "diff": "fxdebug.numerics",
    "gradcheck": "fxdebug.numerics.gradcheck",
    "graph_pass": "fxdebug.authoring.pipeline",
    "guard": "fxdebug.training.guard",
    "instrument": "fxdebug.api",
    "node_pass": "fxdebug.authoring.pipeline",
    "numerics": "fxdebug.numerics",
    "outputs_of": "fxdebug.graph.module_outputs",
    "plot": "fxdebug.plot",
    "precision_plan": "fxdebug.numerics",
    "render": "fxdebug.api",
    "repro": "fxdebug.numerics",
    "sensitivity": "fxdebug.numerics.sensitivity",
    "to_networkx": "fxdebug.instrumented.networkx",
    "trace": "fxdebug.api",
    "verify": "fxdebug.instrumented.verify",
    "when": "fxdebug.when",
}
_SUBMODULES = {name for name, where in _LAZY.items() if where == f"fxdebug.{name}"}


def __getattr__(name: str) -> Any:
    import importlib.util

    where = _LAZY.get(name)
    if where is None:  # a subpackage not imported yet (``fxdebug.api``): as an eager package would have it
        if name.startswith("_"):
            raise AttributeError(f"module 'fxdebug' has no attribute {name!r}")
        if importlib.util.find_spec(f"fxdebug.{name}") is None:
            from fxdebug import authoring  # a pass-author name asked of the root says where it lives

            hint = f"; it is a pass-authoring name: from fxdebug.authoring import {name}" if name in authoring.__all__ else ""
            raise AttributeError(f"module 'fxdebug' has no attribute {name!r}{hint}")
        return importlib.import_module(f"fxdebug.{name}")
    module = importlib.import_module(where)
    value = module if name in _SUBMODULES else getattr(module, name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


class _Package(_ModuleType):
    """This package's module type. The first import of a subpackage sets it as an attribute of the
    package (the import system's rule): ``fxdebug/render/`` would then hide the public ``render()``
    function. A public name is never replaced by a module that way; it resolves as ``_LAZY`` says."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, _ModuleType) and name in _LAZY and name not in _SUBMODULES:
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "Alignment",
    "ArgumentTypeError",
    "Column",
    "DeviceMismatchError",
    "DistributedError",
    "FxDebugError",
    "GradcheckResult",
    "InplaceError",
    "Inputs",
    "Instrumented",
    "LeafInfo",
    "MissingInputsError",
    "NonFiniteError",
    "Pass",
    "PassContext",
    "PassError",
    "PassManager",
    "PassResult",
    "RenderOptions",
    "Report",
    "Sensitivity",
    "ShapeMismatchError",
    "TraceError",
    "TraceInfo",
    "UsageError",
    "Verification",
    "VerificationError",
    "align",
    "authoring",
    "collect",
    "diff",
    "gradcheck",
    "graph_pass",
    "guard",
    "instrument",
    "node_pass",
    "numerics",
    "outputs_of",
    "plot",
    "precision_plan",
    "render",
    "repro",
    "sensitivity",
    "to_networkx",
    "trace",
    "verify",
    "when",
]
