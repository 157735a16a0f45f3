"""fxdebug's built-in passes, shipped as ``fxdebug.passes``.

Every pass here is written only against fxdebug's public pass-authoring API, ``fxdebug.authoring``
(``Pass``, ``PassContext``, ``Probe``, ``PassResult``, the op classifiers, the rewrite helpers), and
the user API's errors — the same API users get for their own passes (tests/test_public_api.py). Names are imported lazily so that importing one pass does
not import them all.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ShapeAssert": "shape_assert",
    "NaNCheck": "nan_check",
    "StatCollector": "stat_collector",
    "DeviceCheck": "device_check",
    "Capture": "capture",
    "SwapActivation": "swap_activation",
    "Fuse": "fuse",
    "PruneMasks": "prune",
    "Shadow": "shadow",
    "Precision": "precision",
    "Recorder": "recorder",
    "InplaceCheck": "inplace_check",
    "Breakpoint": "breakpoint",
    "GradientCentralize": "gradient_centralize",
    "GradientScale": "gradient_tools",
    "Freeze": "gradient_tools",
    "Profile": "profile",
    "ParamGrads": "param_grads",
    "ParamUpdates": "param_updates",
    "Histograms": "histograms",
    "ExpertLoad": "moe",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxdebug.passes' has no attribute {name!r}; available: {', '.join(__all__)}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
