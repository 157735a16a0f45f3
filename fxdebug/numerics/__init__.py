"""Numerics debugging: precision shadow, precision plans, run diffs, flight recorder, repros.

* ``add_shadow`` (the ``Shadow`` pass): every node also runs in float64; ``local_err``,
  ``acc_err`` and ``err_growth`` per node, ``Report.precision_origin``.
* ``precision_plan`` / ``keep_float`` (the ``Precision`` pass): the few nodes to keep in fp32.
* ``diff``: two reports of one model aligned node by node; the first that diverges.
* ``align``: two different implementations matched op by op by value; the first op where they part.
* ``add_recorder`` (the ``Recorder`` pass, ``NaNCheck(history=N)``): the last N calls' per-node
  statistics in a device ring buffer; ``Report.history``.
* ``repro``: a standalone plain-torch script reproducing the first non-finite value or failure.
"""

from __future__ import annotations

from fxdebug.numerics.align import AlignRow, Alignment, Divergence, align
from fxdebug.numerics.diff import Diff, diff
from fxdebug.numerics.precision import KeepFloat, PrecisionPlan, cast_back, keep_float, precision_plan
from fxdebug.numerics.recorder import CallRecord, History, add_recorder, history_of
from fxdebug.numerics.repro import Repro, repro
from fxdebug.numerics.shadow import ShadowOp, ShadowProbe, add_shadow, as_shadow, precision_origin

__all__ = ["AlignRow", "Alignment", "CallRecord", "Diff", "Divergence", "History", "KeepFloat", "PrecisionPlan", "Repro", "ShadowOp", "ShadowProbe", "add_recorder", "add_shadow", "align", "as_shadow", "cast_back", "diff", "history_of",
           "keep_float", "precision_origin", "precision_plan", "repro"]
