"""Counting host synchronisations: the ops through which a device value reaches Python.

Tests that promise "no host sync" run the code under ``CountSyncs`` and assert ``syncs == 0``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.is_nonzero.default)


class CountSyncs(TorchDispatchMode):
    """Counts every op in ``SYNC_OPS`` dispatched while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SYNC_OPS:
            self.syncs += 1
        return func(*args, **(kwargs or {}))
