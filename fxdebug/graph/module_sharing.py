"""How an instrumented module shares the model's own objects instead of copying them.

Every capture builds a module over the user's model: the root's parameter and buffer dictionaries, its
non-persistent buffer names and its training flag are the model's (``share_root_state``), and its call-hook
dictionaries are the model's too (``CALL_HOOKS``), so that ``model.to(device)``, a ``load_state_dict``,
``model.train()`` or a hook added later is what the instrumented module sees. One copy of both, here, for
every frontend and the modules that put the model's hooks aside for a moment (export, the training session).
``submodule`` finds the module at a path through those shared dictionaries.
"""

from __future__ import annotations

from torch import nn

__all__ = ["CALL_HOOKS", "share_root_state", "submodule"]

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


def submodule(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)``, walking the ``_modules`` dictionaries first: a few dictionary look-ups where
    ``get_submodule`` takes two attribute look-ups per step through ``nn.Module.__getattr__`` (~5 us; a deep model's
    capture looks up some hundred thousand paths). Anything else on the way (a module held as a plain attribute,
    fxdebug's namespace) and a missing path go through ``get_submodule``, its ``AttributeError`` included."""
    mod: nn.Module = root
    if path:
        for name in path.split("."):
            found = mod.__dict__.get("_modules", {}).get(name)
            if found is None:
                return root.get_submodule(path)
            mod = found
    return mod
