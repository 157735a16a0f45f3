"""One host read per model call for the device flags that decide whether something fires.

A check that must act on the host when a device value says so (``NaNCheck(on_nonfinite=...)``: the recorder's
"did any watched node go non-finite in this call" flag) reads that flag once per graph. A live capture runs a
call as several graphs (a graph break, a region per block under regional capture): one read per graph was one
host sync per block per call. Inside ``one_read_per_call()`` (the live module's call) such checks hand their flag
over instead (``defer``); at the end of the call every flag is read in one transfer and the checks whose flag is
set fire, in the order they ran. Outside it (a snapshot's single graph) ``defer`` returns ``False`` and the check
reads its flag itself, as before.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["defer", "one_read_per_call"]

_LOCAL = threading.local()


def defer(flag: Tensor, fire: Callable[[], None]) -> bool:
    """Hand ``flag`` (a 0-d bool tensor) and what to do when it is set to the current call; ``False`` when no call
    collects flags (the caller reads it now)."""
    pending: list[tuple[Tensor, Callable[[], None]]] | None = getattr(_LOCAL, "pending", None)
    if pending is None:
        return False
    pending.append((flag, fire))
    return True


class one_read_per_call:  # noqa: N801 - a context manager, used as a function
    """Collect the deferred flags of one call and read them together when it ends (not when it raised: the
    exception is what the user sees first). A class, not a generator: it is entered at every live call."""

    __slots__ = ("outer", "pending")

    def __enter__(self) -> None:
        self.outer = getattr(_LOCAL, "pending", None)
        self.pending: list[tuple[Tensor, Callable[[], None]]] = []
        _LOCAL.pending = self.pending

    def __exit__(self, kind: Any, *exc: Any) -> None:
        _LOCAL.pending = self.outer
        pending = self.pending
        if not pending or kind is not None:
            return
        if self.outer is not None:  # a call inside a call (a live module calling another): the outer call reads them
            self.outer.extend(pending)
            return
        _read(pending)


def _read(pending: list[tuple[Tensor, Callable[[], None]]]) -> None:
    by_device: dict[torch.device, list[int]] = {}
    for i, (flag, _) in enumerate(pending):
        by_device.setdefault(flag.device, []).append(i)
    fired = [False] * len(pending)
    for indices in by_device.values():
        flags = torch.stack([pending[i][0].reshape(()) for i in indices])
        if not bool(flags.any()):  # the one read per device and call (the usual answer: nothing fired)
            continue
        for i, value in zip(indices, flags.tolist()):  # something fired: which (a second read, once)
            fired[i] = bool(value)
    for (_, fire), hit in zip(pending, fired):
        if hit:
            fire()
