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
implementation. Pass-author names are still attributes here for older code.
"""

from fxdebug.numerics.collect import collect
from fxdebug.runtime.columns import COLOR, HIDDEN, NONFINITE, ORIGIN, VALUE, Column
from fxdebug.authoring.context import PassContext, TensorSpec
from fxdebug.errors import ArgumentTypeError, DeviceMismatchError, DistributedError, FxDebugError, InplaceError, MissingInputsError, NonFiniteError, PassError, ShapeMismatchError, TraceError, UsageError, VerificationError
from fxdebug.numerics.gradcheck import GradcheckResult, gradcheck
from fxdebug import when
from fxdebug.instrumented.networkx import to_networkx
from fxdebug import authoring
from fxdebug.api import instrument, render, trace
from fxdebug.render.draw import RenderOptions
from fxdebug.instrumented.module import Instrumented
from fxdebug import numerics
from fxdebug.numerics import diff, precision_plan, repro
from fxdebug.numerics.align import Alignment, align
from fxdebug.graph.module_outputs import outputs_of
from fxdebug.graph.meta import describe, fx_meta, is_instrumentation, module_path, module_type, op_label, source_line
from fxdebug.runtime.observer import SAMPLE, FusedProbe, FusedStats, ObservationContext, Observer, Probe, Reductions, systematic_sample
from fxdebug.graph.classify import get_module, is_batchnorm, is_conv, is_inplace, is_kind, is_linear, is_relu, is_view, register_kind
from fxdebug.authoring.pipeline import Pass, PassManager, PassResult, graph_pass, node_pass
from fxdebug.report.report import Report
from fxdebug import plot
from fxdebug.numerics.sensitivity import Sensitivity, sensitivity
from fxdebug.authoring.rewrite import Match, Replacement, find_pattern, keep_state, node_values, replace_pattern
from fxdebug.graph.select import Where, matches
from fxdebug.capture.symbolic import Inputs, LeafInfo, TraceInfo
from fxdebug.instrumented.verify import Verification, verify
from fxdebug.training.guard import guard

__version__ = "0.1.0"

__all__ = [
    "Alignment",
    "ArgumentTypeError",
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
