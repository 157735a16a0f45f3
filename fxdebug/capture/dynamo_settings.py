"""The settings a live (Dynamo) call runs under, set around each call and put back after.

``dynamo_config`` — Dynamo's config entries a live capture needs (hook guards, recompile limits,
RNN capture), set through the ContextVars torch 2.13 keeps them in and reset by token (a
``setattr`` on the config module costs ~4 µs an entry); ``quiet_warnings`` — Dynamo's own warnings
ignored around the call with filter entries built once. Both fall back on the public path (``setattr``,
``warnings.catch_warnings``) where those internals are absent, chosen once.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import warnings
from typing import Any, Iterator

import torch

__all__ = ["dynamo_config", "quiet_warnings"]


class dynamo_config:  # noqa: N801 - used as a context manager, like torch's config.patch
    """The Dynamo settings a live capture runs under, set around each call and put back after.

    Hook guards on, so that a hook added after instrument is seen; a higher recompile limit, since
    every live module of one class shares that class's ``forward`` cache (a debugging session
    switches modes, keyword signatures and shapes more than a production loop); ``allow_rnn``, so
    that ``nn.LSTM``/``nn.GRU`` are captured (by default Dynamo runs an RNN module's frame eagerly:
    no graph, no rows); ``use_numpy_random_stream``, so that ``np.random`` draws in a forward come from
    numpy's own stream, eagerly at a graph break (by default Dynamo traces them into torch's generator:
    other masks than the model's, wav2vec2's SpecAugment among them, and numpy's stream left unadvanced).
    The same as
    ``torch._dynamo.config.patch(...)`` but without building a patch object per call (~20 µs).
    """

    SETTINGS = {"skip_nnmodule_hook_guards": False, "allow_rnn": True, "recompile_limit": 256,
                "accumulated_recompile_limit": 4096, "use_numpy_random_stream": True}
    # a module's first call (instrument()'s capture): static shapes without automatic-dynamic bookkeeping, about
    # a third less of Dynamo's tracing time on small models; a later shape change still makes dims dynamic (one
    # static recompile first, since this capture recorded no sizes)
    FIRST = {**SETTINGS, "automatic_dynamic_shapes": False}

    def __init__(self, first: bool = False) -> None:
        self._settings = self.FIRST if first else self.SETTINGS

    def __enter__(self) -> None:
        fast = _override_vars(self._settings)
        if fast is not None:  # torch keeps each override in a ContextVar: set it, and reset that exact state after
            self._tokens = [(var, var.set(value)) for var, value in fast]
            _mark_dirty(self._settings)
            return
        config = torch._dynamo.config
        self._tokens = []
        self._saved = {k: getattr(config, k) for k in self._settings}
        for k, v in self._settings.items():
            setattr(config, k, v)

    def __exit__(self, *exc: Any) -> None:
        if self._tokens:
            for var, token in reversed(self._tokens):
                var.reset(token)
            _mark_dirty(self._settings)
            return
        config = torch._dynamo.config
        for k, v in self._saved.items():
            setattr(config, k, v)


_VARS: dict[int, list[tuple[Any, Any]] | None] = {}


def _override_vars(settings: dict[str, Any]) -> list[tuple[Any, Any]] | None:
    """``[(ContextVar, value)]`` for Dynamo's config entries of ``settings``, where torch keeps a user's override of
    each in a ``ContextVar`` (torch 2.13: ``setattr`` on the config module costs ~4 µs an entry, ~37 µs a call for
    the four set and put back); ``None`` on a torch that keeps them otherwise (then ``setattr`` is used)."""
    key = id(settings)
    if key not in _VARS:
        table = getattr(torch._dynamo.config, "_config", None)
        pairs: list[tuple[Any, Any]] = []
        for name, value in settings.items():
            entry = table.get(name) if isinstance(table, dict) else None
            var = getattr(entry, "user_override", None)
            if isinstance(var, contextvars.ContextVar) and getattr(entry, "alias", None) is None:
                pairs.append((var, value))
        usable = len(pairs) == len(settings) and hasattr(torch._dynamo.config, "_hash_dirty_var") and hasattr(
            torch._dynamo.config, "_mark_get_dict_dirty")
        _VARS[key] = pairs if usable else None
    return _VARS[key]


def _mark_dirty(settings: dict[str, Any]) -> None:
    """What the config module's ``__setattr__`` does beside the override: its hash and dict caches see the change."""
    config = torch._dynamo.config
    config._hash_dirty_var.set(True)  # type: ignore[attr-defined]
    keys = getattr(config, "_get_dict_dirty_keys_var", None)
    cap = getattr(config, "_GET_DICT_DIRTY_KEYS_CAP", None)
    if keys is None or cap is None:
        for name in settings:
            config._mark_get_dict_dirty(name)  # type: ignore[attr-defined]
        return
    dirty = keys.get()
    if dirty is not None:  # as _mark_get_dict_dirty, for all names at once
        dirty.update(settings)
        if len(dirty) > cap:
            keys.set(None)


class quiet_warnings:  # noqa: N801 - a factory of context managers, as warnings.catch_warnings
    """Ignore Dynamo's own warnings (``patterns``, UserWarning) around a live call; other filters as they are.

    ``with q():`` is ``warnings.catch_warnings()`` with one ``filterwarnings("ignore", ...)`` per pattern,
    put back after, but the filter entries are built once: ~1 µs a call instead of ~8 (a live module's
    call pays it every time). On a Python without ``warnings._filters_mutated`` it is that plain code.
    """

    def __init__(self, *patterns: str) -> None:
        self.entries = [("ignore", re.compile(p, re.I), UserWarning, None, 0) for p in patterns]
        self.patterns = patterns

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        return _Quiet(self) if hasattr(warnings, "_filters_mutated") else self._plain()

    @contextlib.contextmanager
    def _plain(self) -> Iterator[None]:
        with warnings.catch_warnings():
            for p in self.patterns:
                warnings.filterwarnings("ignore", message=p, category=UserWarning)
            yield


class _Quiet:
    def __init__(self, quiet: quiet_warnings) -> None:
        self._entries = quiet.entries

    def __enter__(self) -> None:
        self._saved = warnings.filters
        warnings.filters = [*self._entries, *self._saved]
        warnings._filters_mutated()  # type: ignore[attr-defined]

    def __exit__(self, *exc: Any) -> None:
        warnings.filters = self._saved
        warnings._filters_mutated()  # type: ignore[attr-defined]
