"""Ways of capturing a model as a graph, besides symbolic tracing (``fxdebug/tracing.py``).

* ``export`` — ``torch.export`` (non-strict): an aten-level graph with module paths kept.
* ``subtrees`` — the root's forward stays eager; its largest capturable submodules are captured.

``fxdebug.trace(frontend=...)`` chooses among them; nothing here is needed directly.
"""
