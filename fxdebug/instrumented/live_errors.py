"""Errors of a live (Dynamo) capture, typed and located: the model's own forward failing before anything
was captured, Dynamo itself failing, and an op of a captured graph failing (named by node, module and
shapes, as every other fxdebug error is)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxdebug.authoring.context import PassContext
from fxdebug.capture.base import TraceOptions
from fxdebug.capture.graphs import SymbolicFrontend
from fxdebug.errors import FxDebugError, TraceError
from fxdebug.graph.inputs import Inputs
from fxdebug.instrumented.module import InstrumentedGraphModule, raise_op_failure


def _diagnose_part(part: InstrumentedGraphModule, keep: list[int], args: tuple[Any, ...], exc: Exception) -> None:
    """An op of a captured graph failed: name the node (a typed error), as an ``InstrumentedGraphModule`` call does."""
    raise_op_failure(part, exc)


def _user_line(exc: BaseException) -> str:
    """``file.py:42 `line``` of the innermost frame of ``exc``'s traceback outside torch and fxdebug."""
    import os
    import traceback

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fxdebug/
    skip = (os.path.dirname(torch.__file__ or "") + os.sep, here + os.sep)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not frame.filename.startswith(skip) and not frame.filename.startswith("<"):
            line = f" `{frame.line.strip()}`" if frame.line else ""
            return f"{os.path.basename(frame.filename)}:{frame.lineno}{line}"
    return ""


def _first_call_failed(model: nn.Module, exc: Exception, examples: bool) -> TraceError:
    """The model's forward raised before anything was captured: a ``TraceError`` naming it and where."""
    name = type(model).__name__
    where = _user_line(exc)
    when = "on the example inputs" if examples else "at its first call (the live capture runs the model then)"
    msg = str(exc).strip().rstrip(".") or type(exc).__name__
    return TraceError(
        f"{name}'s own forward raised {type(exc).__name__} {when}: {msg}"
        + (f" (at {where})" if where else "") + ". Nothing was captured: fxdebug can only capture a model that runs: "
        "fix the forward or the inputs (the original exception is this error's __cause__).",
        module="", op=name)


def _dynamo_failed(model: nn.Module, exc: Exception) -> TraceError:
    """TorchDynamo itself failed (not the model): a ``TraceError`` with its reason and what to do."""
    name = type(model).__name__
    reason = " ".join(str(exc).split())[:600].rstrip(".") or type(exc).__name__
    where = _user_line(exc)
    return TraceError(
        f"TorchDynamo could not capture {name}'s forward ({type(exc).__name__}"
        + (f" at {where}" if where else "") + f"): {reason}. Use a snapshot frontend "
        "(frontend='symbolic' or 'export'), or FXDEBUG_AUTO=snapshot to make that the default.",
        module="", op="dynamo")


def _diagnosed(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception) -> Exception:
    """The typed error naming the node, module and shapes, found by running a symbolic capture; else ``exc``.

    Dynamo reports a failing op by its fake tensors; the symbolic graph's shape run names the node
    the way every other fxdebug error does (``ShapeMismatchError`` for a shape problem).
    """
    try:
        captured = SymbolicFrontend().capture(model, (args, kwargs), TraceOptions())
        PassContext(Inputs(*args, **kwargs)).specs(InstrumentedGraphModule.from_capture(model, captured))
    except FxDebugError as err:
        return err
    except Exception:
        return exc
    return exc
