"""``fxdebug.plot``: matplotlib figures of a report.

* ``gradient_flow(report, path)`` — mean and max |gradient| per layer in execution order, on a log
  scale, with the vanishing and exploding bands of ``Report.findings``;
* ``activations(report, path)`` — each node's activation range (min..max, mean ± std) with the
  dead fraction of activation nodes;
* ``feature_maps(...)`` — captured feature maps as image grids (see its docstring).

matplotlib is imported only when a figure is drawn (``pip install 'fxdebug[plot]'``); the file
type follows the suffix of ``path`` (``.png``, ``.svg``, ``.pdf``).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "activations": "flow",
    "gradient_flow": "flow",
    "feature_maps": "feature_maps",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxdebug.plot' has no attribute {name!r}; available: {', '.join(__all__)}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
