"""How an instrumented module shares the model's own objects instead of copying them.

Every capture builds a module over the user's model: the root's parameter and buffer dictionaries, its
non-persistent buffer names and its training flag are the model's (``share_root_state``), and its call-hook
dictionaries are the model's too (``CALL_HOOKS``), so that ``model.to(device)``, a ``load_state_dict``,
``model.train()`` or a hook added later is what the instrumented module sees. One copy of both, here, for
every frontend and the modules that put the model's hooks aside for a moment (export, the training session).
"""

from __future__ import annotations

from torch import nn

__all__ = ["CALL_HOOKS", "share_root_state"]

# An nn.Module's own call-hook dictionaries (module.py's _call_impl reads them around forward): forward,
# forward-pre, their with-kwargs and always-called sets, backward and backward-pre.
CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


def share_root_state(module: nn.Module, model: nn.Module) -> None:
    """``module``'s own parameters, buffers, non-persistent buffer names and training flag become ``model``'s.

    The dictionaries are shared, not copied: ``model.to(device)`` replaces Parameter objects in place in that
    dict, and the instrumented module must see the new ones. fxdebug registers nothing at the root (its state
    lives under the ``fxdebug`` namespace module), so sharing is safe."""
    module._parameters = model._parameters
    module._buffers = model._buffers
    module._non_persistent_buffers_set = model._non_persistent_buffers_set
    module.training = model.training
