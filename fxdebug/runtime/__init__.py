"""fxdebug's observation runtime: the fused ``fxdebug::observe`` op, its state table, and the
lowering that makes the instrumented graph call it directly.

* ``ops``: loads the op (C++ CPU kernel, pure-torch fallback elsewhere, fake impl for compile).
* ``slots``: the layout of the per-graph float64 state table (clock, one row per node and phase,
  per-channel maxima).
* ``lower``: after the passes ran, every observer whose probes all read fused statistics becomes
  one ``call_function`` to the op (plus a gradient tap where gradients are watched).
"""

from __future__ import annotations

from fxdebug.runtime.kernel import backend, fallback_reason, load, observe_op

__all__ = ["backend", "fallback_reason", "load", "observe_op"]
