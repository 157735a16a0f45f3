"""Derived layers keep their tensors out of the checkpoint.

A fused conv's weights (conv ⊗ batch-norm) and a baked pruned layer's zeroed weights are
*derived* from the model's own parameters. They are real ``nn.Parameter`` s (so the copy trains
and moves with ``.to(device)``), but saving them would add ``fxdebug.*`` keys to
``dbg.state_dict()``, and ``model.load_state_dict(dbg.state_dict())`` would fail. These hooks
drop them on save and do not ask for them on load: the checkpoint holds the model's keys only.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["mark_derived"]


def _drop_saved(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    onnx = sys.modules.get("torch.onnx")
    if onnx is not None and onnx.is_in_onnx_export():  # the TorchScript exporter finds the parameters by state_dict():
        return  # hidden ones would be traced as constants ("Cannot insert a Tensor that requires grad") (issue 35 B14)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]


def _not_missing(module: nn.Module, incompatible: Any) -> None:
    own = {name for name, _ in module.named_parameters()} | {name for name, _ in module.named_buffers()}
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                    if not ("fxdebug" in k.split(".") and k.rsplit(".", 1)[-1] in
                                            {n.rsplit(".", 1)[-1] for n in own})]


def mark_derived(module: nn.Module) -> nn.Module:
    """Keep ``module``'s parameters and buffers out of ``state_dict()`` and ``load_state_dict``."""
    module.register_state_dict_post_hook(_drop_saved)
    module.register_load_state_dict_post_hook(_not_missing)
    return module
