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

from .collect import collect
from .columns import COLOR, HIDDEN, NONFINITE, ORIGIN, VALUE, Column
from .context import PassContext, TensorSpec
from .errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DistributedError,
    FxDebugError,
    InplaceError,
    MissingInputsError,
    NonFiniteError,
    PassError,
    ShapeMismatchError,
    TraceError,
    UsageError,
    VerificationError,
)
from .gradcheck import GradcheckResult, gradcheck
from . import when
from .graph_nx import to_networkx
from . import authoring
from .api import instrument, render, trace
from .instrumented import Instrumented
from . import numerics
from .numerics import diff, precision_plan, repro
from .module_outputs import outputs_of
from .meta import describe, fx_meta, is_instrumentation, module_path, module_type, op_label, source_line
from .observe import SAMPLE, FusedProbe, FusedStats, ObservationContext, Observer, Probe, Reductions, systematic_sample
from .ops import get_module, is_batchnorm, is_conv, is_inplace, is_kind, is_linear, is_relu, is_view, register_kind
from .passes_api import Pass, PassManager, PassResult, graph_pass, node_pass
from .report import Report
from . import plot
from .sensitivity import Sensitivity, sensitivity
from .rewrite import Match, Replacement, find_pattern, keep_state, node_values, replace_pattern
from .select import Where, matches
from .tracing import Inputs, LeafInfo, TraceInfo
from .verify import Verification, verify

__version__ = "0.1.0"

__all__ = [
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
    "Report",
    "Sensitivity",
    "ShapeMismatchError",
    "TraceError",
    "TraceInfo",
    "UsageError",
    "Verification",
    "VerificationError",
    "authoring",
    "collect",
    "diff",
    "gradcheck",
    "graph_pass",
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
