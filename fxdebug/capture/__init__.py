"""Ways of capturing a model; each implements the ``Frontend`` protocol (``base.py``).

* ``graphs`` — ``SymbolicFrontend`` (``torch.fx``, via ``fxdebug/tracing.py``) and
  ``ExportFrontend`` (``torch.export``, via ``export.py``): one graph, one part.
* ``subtrees`` — the root's forward stays eager; its largest capturable submodules are the parts.

Every frontend returns an ``Instrumented`` module; ``fxdebug.trace(frontend=...)`` (``api.py``)
chooses among them. Nothing here is needed directly.
"""
