"""What the command line needs besides argument parsing: loading a ``TARGET``, making inputs,
reading data files, a progress indicator, and turning a report into findings a person acts on.

Every failure here is a ``CliError`` whose message is one sentence saying what was tried, what
went wrong, and what to do; ``fxdebug.cli.main`` prints it and exits with status 2.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from typing import Any, Sequence, TextIO

import torch
from torch import nn

from fxdebug.errors import UsageError

__all__ = ["CliError", "Progress", "findings", "load_data", "load_target", "parse_shape", "random_inputs"]


class CliError(UsageError):
    """A command-line problem: an unloadable target, a bad ``--input``, an unreadable data file."""


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` (or ``1x3x224x224``) → ``(1, 3, 224, 224)``."""
    parts = re.split(r"[,x]", text.replace(" ", ""))
    shape = tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else ()
    if not shape or any(d <= 0 for d in shape):
        raise CliError(f"--input {text!r} is not a shape: write positive sizes separated by commas, e.g. 1,3,224,224.")
    return shape


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64}


def random_inputs(shapes: Sequence[tuple[int, ...]], dtype: str = "float32", *, high: int = 2,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """One random tensor per shape: standard normal for float dtypes, ``randint(0, high)`` for int64."""
    dt = _DTYPES[dtype]
    if dt == torch.int64:
        return tuple(torch.randint(0, high, s, generator=generator) for s in shapes)
    return tuple(torch.randn(s, generator=generator).to(dt) for s in shapes)


def _import_module(spec: str) -> Any:
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise CliError(f"cannot load target file {spec!r}: no such file. Give a path to a .py file, e.g. models/net.py:Net.")
        name = "_fxdebug_target_" + "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0])
        sys.path.insert(0, os.path.dirname(path))  # let the file import its siblings
        mod_spec = importlib.util.spec_from_file_location(name, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception as exc:
            raise CliError(f"cannot import {spec!r}: running the file raised {type(exc).__name__}: {exc}.") from exc
        return module
    try:
        return importlib.import_module(spec)
    except Exception as exc:
        raise CliError(
            f"cannot import module {spec!r}: {type(exc).__name__}: {exc}. Check the spelling, run from the directory "
            "that contains the package (or install it), or give a file path instead: path/to/file.py:attr."
        ) from exc


def _module_names(module: Any) -> list[str]:
    names = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_"):
            continue
        if isinstance(value, nn.Module) or (isinstance(value, type) and issubclass(value, nn.Module)
                                            and value.__module__ == module.__name__):
            names.append(name)
    return names


def load_target(target: str) -> nn.Module:
    """The ``nn.Module`` named by ``pkg.module:attr`` or ``path/to/file.py:attr``.

    ``attr`` may be a dotted path; it may name a module instance, an ``nn.Module`` class (built
    with no arguments), or a zero-argument factory returning a module. The model is put in
    ``eval()`` mode so batch statistics of random inputs do not disturb it.
    """
    spec, sep, attr = target.rpartition(":")
    if not sep or not spec or not attr or (len(spec) == 1 and spec.isalpha()):
        raise CliError(f"TARGET {target!r} must look like 'pkg.module:attr' or 'path/to/file.py:attr' "
                       "(attr names an nn.Module instance, class, or zero-argument factory).")
    module = _import_module(spec)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            known = _module_names(module)
            hint = f" It defines these modules: {', '.join(known)}." if known else " It defines no nn.Module."
            raise CliError(f"{spec!r} has no attribute {attr!r}.{hint}")
        obj = getattr(obj, part)
    model = _instantiate(obj, target)
    return model.eval()


def _instantiate(obj: Any, target: str) -> nn.Module:
    if isinstance(obj, nn.Module):
        return obj
    if isinstance(obj, type) and not issubclass(obj, nn.Module):
        raise CliError(f"{target!r} is the class {obj.__name__}, which is not a torch.nn.Module subclass.")
    if not callable(obj):
        raise CliError(f"{target!r} is a {type(obj).__name__}, not an nn.Module instance, class, or zero-argument factory.")
    try:
        required = [p.name for p in inspect.signature(obj).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        required = []
    if required:
        raise CliError(f"{target!r} needs arguments ({', '.join(required)}) to build the model; point TARGET at a "
                       "module instance or a zero-argument factory function instead.")
    try:
        model = obj()
    except Exception as exc:
        raise CliError(f"building the model from {target!r} raised {type(exc).__name__}: {exc}.") from exc
    if not isinstance(model, nn.Module):
        raise CliError(f"{target!r} returned a {type(model).__name__}, not an nn.Module.")
    return model


def load_data(path: str) -> list[tuple[Any, ...] | dict[str, Any]]:
    """Batches from a ``torch.save`` file: a tensor (one batch), a list of tensors (one batch each),
    a list of tuples (positional inputs per batch), or a dict / list of dicts (keyword inputs)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CliError(f"--data {path!r}: no such file.") from None
    except Exception as exc:
        raise CliError(f"--data {path!r} could not be read with torch.load: {type(exc).__name__}: {exc}.") from exc
    if isinstance(data, torch.Tensor) or isinstance(data, dict):
        data = [data]
    if not isinstance(data, (list, tuple)) or not data:
        raise CliError(f"--data {path!r} holds a {type(data).__name__}; save a tensor, a list of tensors, "
                       "or a list of input tuples.")
    return [b if isinstance(b, dict) else (tuple(b) if isinstance(b, (list, tuple)) else (b,)) for b in data]


def check_batches(model: nn.Module, batches: list[Any], path: str) -> None:
    """Every ``--data`` batch must bind to the model's forward; else it is the data's fault (exit 2)."""
    from fxdebug.capture.symbolic import normalize_inputs
    from fxdebug.graph.usage import check_example_inputs

    for i, batch in enumerate(batches):
        try:
            check_example_inputs(model, normalize_inputs(batch if isinstance(batch, dict) else tuple(batch)))
        except UsageError as exc:
            raise CliError(f"--data {path!r}: batch {i + 1} of {len(batches)} does not fit the model: {exc}") from None


class Progress:
    """A one-line progress bar on ``stream`` (stderr), redrawn in place on a terminal."""

    def __init__(self, total: int, label: str = "batches", stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, done: int) -> None:
        filled = self.width * done // self.total
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {self.label}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def findings(report: Any, gm: Any = None) -> list[str]:
    """Sentences for what deserves attention in ``report``: the typed ``Report.findings()`` (NaN/Inf
    origin with its input's minimum, failed checks, vanishing/exploding gradients, dead channels),
    each with its fix, plus the list of nodes that saw NaN/Inf."""
    from fxdebug.report.findings import find

    out = [str(f) for f in find(report, gm=gm)]
    bad = [r["node"] for r in report.rows if report.nonfinite_in(r, "forward")]
    if bad:
        out.insert(min(len(out), 1 + (report.first_nonfinite_grad is not None)),
                   f"{len(bad)} node(s) saw NaN/Inf: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}.")
    return out
