"""Every error fxdebug raises, in one place.

The hierarchy::

    FxDebugError (Exception)
    ├── TraceError          (FxDebugError, RuntimeError)   a model could not be captured
    ├── PassError           (FxDebugError, RuntimeError)   a pass failed or left a broken graph
    ├── ShapeMismatchError  (FxDebugError, ValueError)     a tensor's shape is not what the graph expects
    ├── NonFiniteError      (FxDebugError, FloatingPointError)   NaN/Inf appeared (raise mode)
    ├── DeviceMismatchError (FxDebugError, RuntimeError)   an op's inputs sit on different devices
    ├── InplaceError        (FxDebugError, RuntimeError)   an in-place op would overwrite a tensor saved for backward
    ├── DistributedError    (FxDebugError, RuntimeError)   a rank failed or timed out in a cross-rank fxdebug call
    ├── VerificationError   (FxDebugError, AssertionError) the instrumented module computes differently from the model
    └── UsageError          (FxDebugError, ValueError)     fxdebug was called with a value it cannot use
        ├── ArgumentTypeError  (UsageError, TypeError)     ... the wrong kind of thing (not a module, a class)
        └── MissingInputsError (UsageError)                ... an operation needs example inputs, none were given

One class per meaning: a bad option value is a ``UsageError`` (so a ``ValueError``); a wrong type
is an ``ArgumentTypeError`` (also a ``TypeError``); "this needs example inputs" is always a
``MissingInputsError``, whichever step needed them (a frontend, a pass's ``requires``, a run).

Each subclass also inherits the builtin a user would already catch, so ``except ValueError``
keeps working around code that now runs under fxdebug. Context is carried as keyword-only
attributes (``node``, ``module``, ``op``, ``pass_name``) so tools can read it without parsing
the message; the message itself is a plain sentence: what was attempted, what was found, and
what to do about it.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "DeviceMismatchError",
    "DistributedError",
    "FxDebugError",
    "InplaceError",
    "MissingInputsError",
    "NonFiniteError",
    "PassError",
    "ShapeMismatchError",
    "TraceError",
    "UsageError",
    "VerificationError",
]


class FxDebugError(Exception):
    """Root of every fxdebug error.

    Attributes:
        node: name of the graph node involved, or ``None``.
        module: dotted path of the module that owns that node (``""`` is the root), or ``None``.
        op: a short description of the operation (``"Conv2d"``, ``"torch.log"``), or ``None``.
        pass_name: the pass that was running, or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        module: str | None = None,
        op: str | None = None,
        pass_name: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.node = node
        self.module = module
        self.op = op
        self.pass_name = pass_name

    def __reduce__(self):  # keep keyword context through pickling (multiprocessing, torch.save)
        return (_rebuild, (type(self), self.message, self.node, self.module, self.op, self.pass_name))


def _rebuild(cls, message, node, module, op, pass_name):
    return cls(message, node=node, module=module, op=op, pass_name=pass_name)


class TraceError(FxDebugError, RuntimeError):
    """The model (or its root forward) could not be captured as a graph."""


class PassError(FxDebugError, RuntimeError):
    """A pass raised, was not a pass, or left the graph invalid."""


class ShapeMismatchError(FxDebugError, ValueError):
    """A node produced, or was fed, a tensor whose shape differs from what the graph expects."""


class NonFiniteError(FxDebugError, FloatingPointError):
    """A node turned finite inputs into NaN or Inf (``NaNCheck(mode="raise")``)."""


class DeviceMismatchError(FxDebugError, RuntimeError):
    """An op's tensor inputs (parameters included) sit on different devices."""


class InplaceError(FxDebugError, RuntimeError):
    """An in-place op would overwrite a tensor autograd saved for backward (``InplaceCheck``).

    ``node`` is the op that modifies the tensor; ``saved_by`` the node whose backward needs it.
    """

    def __init__(self, message: str, *, saved_by: str | None = None, **context: str | None) -> None:
        super().__init__(message, **context)
        self.saved_by = saved_by

    def __reduce__(self):
        return (_rebuild_inplace, (self.message, self.node, self.module, self.op, self.pass_name, self.saved_by))


def _rebuild_inplace(message, node, module, op, pass_name, saved_by):
    return InplaceError(message, node=node, module=module, op=op, pass_name=pass_name, saved_by=saved_by)


class VerificationError(FxDebugError, AssertionError):
    """``fxdebug.verify`` found outputs, gradients or buffers that differ from the model's.

    ``node`` is the first node where the two runs part (when it could be located); ``result``
    the full ``fxdebug.instrumented.verify.Verification``.
    """

    def __init__(self, message: str, *, result: object = None, **context: str | None) -> None:
        super().__init__(message, **context)
        self.result = result


class DistributedError(FxDebugError, RuntimeError):
    """A cross-rank call (``report(all_ranks=True)``) could not complete: a rank failed, hung or timed out."""


class UsageError(FxDebugError, ValueError):
    """fxdebug was called with a value it cannot use: a bad option, a selection matching nothing."""


class ArgumentTypeError(UsageError, TypeError):
    """fxdebug was called with the wrong kind of thing: not a module, a class instead of an instance."""


class MissingInputsError(UsageError):
    """An operation needs example inputs (to learn shapes, to run the model) and none were given.

    ``pass_name`` is set when a pass's ``requires`` asked for them.
    """
