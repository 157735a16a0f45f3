"""Plain Python state of a model's modules: read it, and put it back after example runs.

A forward may advance Python counters or flip flags (``self.calls += 1``); capturing runs the
forward, so the capture saves these values first and restores them after, leaving the model as
it found it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"training"}


def user_attributes(module: nn.Module) -> dict[str, Any]:
    """The attributes a forward may rebind (``self.calls``, ``self.config``): not torch's internals."""
    return {k: v for k, v in module.__dict__.items()
            if k not in _MODULE_INTERNALS and not k.startswith("_fxdebug") and not isinstance(v, nn.Module)}


def saved_plain_state(root: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Plain values (numbers, strings, None) of every module's own attributes, to put back later."""
    return [(m, {k: v for k, v in user_attributes(m).items() if isinstance(v, _PLAIN)}) for m in root.modules()]


def restore_plain_state(saved: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Undo what example runs did to Python counters and flags (``self.calls += 1``)."""
    for module, values in saved:
        for k, v in values.items():
            if module.__dict__.get(k, v) is not v or k not in module.__dict__:
                module.__dict__[k] = v


