"""The pass-author API: everything a pass needs, in one documented place.

``fxdebug`` itself exports what a *user* of fxdebug calls (``trace``, ``instrument``, ``render``,
``Report``, the errors, ``Pass`` / ``PassContext`` / ``PassResult`` to write a pass at all).
This module exports the toolkit a *pass author* works with, and nothing else; the built-in passes
in ``fxdebug.passes`` are written only against it (and ``fxdebug``), so a user's pass can do
whatever a built-in pass does::

    from fxdebug.authoring import PassContext, PassResult, Probe, graph_pass

Groups:

* writing a pass — ``Pass``, ``graph_pass``, ``node_pass``, ``PassResult``, ``PassManager``,
  ``Options`` (the one rule for a pass's constructor options: flags, choices, numbers, iterables),
  ``PassContext`` (inputs, ``tensor_spec``, ``nodes``, ``insert_after`` / ``insert_before``,
  ``replace_with_module``, ``observe``), ``TensorSpec``, ``KNOWN_REQUIREMENTS`` for ``requires=``;
* selecting nodes — ``Where``, ``matches``, ``outputs_of``;
* observing — ``Probe``, ``Reductions``, ``ObservationContext``, ``Observer``, ``FusedProbe``,
  ``FusedStats``, ``SAMPLE``, ``systematic_sample``; report columns ``Column`` with the roles
  ``VALUE``, ``HIDDEN``, ``NONFINITE``, ``ORIGIN``, ``COLOR``, ``GRADIENT``, ``GRADIENT_MEAN``,
  finding rules ``FindingRule`` and the row filter ``activation_row`` (``Column(only=...)``);
* node facts — ``node_meta`` / ``NodeMeta`` (typed ``node.meta["fxdebug"]``), the node roles
  ``INSTRUMENTATION``, ``CLOCK``, ``GUARD``, ``graph_record`` / ``GraphRecord``, ``fx_meta`` (raw
  dict), ``describe`` and ``node_identity``, ``module_path``, ``module_type``, ``op_label``, ``source_line``,
  ``is_instrumentation``;
* op classification — ``get_module``, ``get_attr``, ``is_conv``, ``is_linear``, ``is_batchnorm``, ``is_relu``,
  ``is_view``, ``is_inplace``, ``is_kind``, ``register_kind``;
* rewriting — ``find_pattern``, ``replace_pattern``, ``Match``, ``Replacement``, ``node_values``,
  ``keep_state``.

Every other module of the ``fxdebug`` package is private implementation: import from ``fxdebug``,
``fxdebug.authoring``, ``fxdebug.passes``, ``fxdebug.plot``, ``fxdebug.numerics`` and
``fxdebug.when`` only. The names here are not attributes of ``fxdebug`` (beyond the few a user needs
to write a pass at all, and ``Column``): ``fxdebug.__all__`` is the user API.
"""

from __future__ import annotations

from fxdebug.runtime.columns import COLOR, GRADIENT, GRADIENT_MEAN, HIDDEN, NONFINITE, ORIGIN, VALUE, Column, FindingRule
from fxdebug.report.findings import activation_row
from fxdebug.authoring.context import KNOWN_REQUIREMENTS, PassContext, TensorSpec
from fxdebug.graph.meta import CLOCK, GUARD, INSTRUMENTATION, GraphRecord, NodeMeta, describe, fx_meta, graph_record, is_instrumentation, module_path, module_type, node_identity, node_meta, op_label, source_line
from fxdebug.graph.module_outputs import outputs_of
from fxdebug.runtime.observer import SAMPLE, FusedProbe, FusedStats, ObservationContext, Observer, Probe, Reductions, systematic_sample
from fxdebug.graph.classify import get_attr, get_module, is_batchnorm, is_conv, is_inplace, is_kind, is_linear, is_relu, is_view, register_kind
from fxdebug.authoring.options import Options
from fxdebug.authoring.pipeline import Pass, PassManager, PassResult, graph_pass, node_pass
from fxdebug.authoring.rewrite import Match, Replacement, find_pattern, keep_state, node_values, replace_pattern
from fxdebug.graph.select import Where, matches

__all__ = [
    "CLOCK",
    "COLOR",
    "Column",
    "FindingRule",
    "FusedProbe",
    "FusedStats",
    "GRADIENT",
    "GRADIENT_MEAN",
    "GUARD",
    "GraphRecord",
    "HIDDEN",
    "INSTRUMENTATION",
    "KNOWN_REQUIREMENTS",
    "Match",
    "NONFINITE",
    "NodeMeta",
    "ORIGIN",
    "ObservationContext",
    "Observer",
    "Options",
    "Pass",
    "PassContext",
    "PassManager",
    "PassResult",
    "Probe",
    "Reductions",
    "Replacement",
    "SAMPLE",
    "TensorSpec",
    "VALUE",
    "Where",
    "activation_row",
    "describe",
    "find_pattern",
    "fx_meta",
    "get_attr",
    "get_module",
    "graph_pass",
    "graph_record",
    "is_batchnorm",
    "is_conv",
    "is_inplace",
    "is_instrumentation",
    "is_kind",
    "is_linear",
    "is_relu",
    "is_view",
    "keep_state",
    "matches",
    "module_path",
    "module_type",
    "node_identity",
    "node_meta",
    "node_pass",
    "node_values",
    "op_label",
    "outputs_of",
    "register_kind",
    "replace_pattern",
    "source_line",
    "systematic_sample",
]
