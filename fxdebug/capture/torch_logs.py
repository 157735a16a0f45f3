"""torch's own error logs during a capture, caught and said once in fxdebug's words.

When a meta kernel fails under fake tensors (Dynamo's and torch.export's shape propagation), torch
logs the whole traceback at ERROR through its own handlers (``E... fake_tensor.py:3090] failed while
attempting to run meta for ...``), once per attempt: dozens of lines on the user's terminal for one
detection model, before (or instead of) the one typed error fxdebug raises. ``torch_errors_caught``
swaps, for the duration of a capture, the handlers of the loggers torch writes those records to for one
that keeps ERROR records and passes the rest on to the original handlers; ``summary`` turns what it
kept into one sentence (a note when the capture went on, or part of the typed error when it did not).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

__all__ = ["LOGGERS", "summary", "torch_errors_caught"]

LOGGERS = ("torch._subclasses.fake_tensor", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
           "torch._export", "torch.export")


class _Keeper(logging.Handler):
    """Keeps ERROR (and worse) records; hands every other record to the handlers it replaced."""

    def __init__(self, passed: list[logging.Handler]) -> None:
        super().__init__(logging.DEBUG)
        self.passed = passed
        self.kept: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.kept.append(record)
            return
        for handler in self.passed:
            if record.levelno >= handler.level:
                handler.handle(record)


@contextlib.contextmanager
def torch_errors_caught() -> Iterator[list[logging.LogRecord]]:
    """Within the block, torch's ERROR records on ``LOGGERS`` are kept in the yielded list, not printed.

    A logger that propagates (no handler of its own, as without ``torch._logging``'s set-up) gets the
    keeper too and stops propagating for the block, so its records reach no handler above it either.
    """
    kept: list[logging.LogRecord] = []
    saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []
    for name in LOGGERS:
        log = logging.getLogger(name)
        keeper = _Keeper(list(log.handlers))
        keeper.kept = kept
        saved.append((log, log.handlers, log.propagate))
        log.handlers = [keeper]
        log.propagate = False
    try:
        yield kept
    finally:
        for log, handlers, propagate in saved:
            log.handlers = handlers
            log.propagate = propagate


def summary(kept: list[logging.LogRecord]) -> str | None:
    """One sentence for what torch logged (``None`` when nothing): how many records, the first one and its error."""
    if not kept:
        return None
    first = kept[0]
    try:
        message = first.getMessage()
    except Exception:  # noqa: BLE001 - a record whose arguments do not format: its template
        message = str(first.msg)
    error = ""
    if first.exc_info and first.exc_info[1] is not None:
        exc = first.exc_info[1]
        text = (str(exc).strip().splitlines() or [""])[0][:200]
        error = f" ({type(exc).__name__}: {text})" if text else f" ({type(exc).__name__})"
    more = f"; {len(kept) - 1} more like it" if len(kept) > 1 else ""
    return (f"torch: while capturing, torch logged an internal error, not shown: '{message}'{error}{more}. "
            "It is torch's shape propagation (fake tensors) failing on an op; fxdebug's own message says what it did")
