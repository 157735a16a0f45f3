"""``torch.ops.fxdebug.observe``: the one op an instrumented graph calls per observed node.

The schema and the CPU kernel live in C++ (fxdebug/csrc/observe.cpp), built on first use with
``torch.utils.cpp_extension.load`` (JIT, cached under torch's extension directory, so only the
first process on a machine compiles). The graph calls the op straight into the dispatcher — no
Python per call on CPU. Devices without a native kernel (CUDA, ...) get the pure-torch
implementation (``fallback.py``) under ``CompositeExplicitAutograd``; if the C++ build fails
(no compiler), the same op name is defined from Python with that implementation everywhere, and
``backend()`` says so (the report adds a note). The fake implementation (shapes only) is what
``torch.compile`` and ``torch.export`` trace, so the op is one node there, with no graph break.

``FXDEBUG_NO_KERNEL=1`` skips the build (forces the fallback); ``FXDEBUG_VERBOSE_BUILD=1`` shows
the compiler's output.
"""

from __future__ import annotations

import os
import platform
import threading
from pathlib import Path
from typing import Any

import torch

from fxdebug.runtime.fallback import observe_torch

__all__ = ["backend", "fallback_reason", "load", "observe_many_op", "observe_op"]

_SCHEMA = "observe(Tensor x, Tensor(a!) table, int row, int chan_off, int channels, int channel_dim) -> ()"
_SCHEMA_MANY = "observe_many(Tensor[] xs, Tensor(a!) table, int[] args) -> ()"
_SOURCES = [Path(__file__).resolve().parent.parent / "csrc" / "observe.cpp"]
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"backend": None, "why": None, "libs": []}


def _cflags() -> tuple[str, list[str]]:
    """Optimisation flags safe for this machine, and a build name that keeps caches apart."""
    flags = ["-O3", "-fopenmp-simd", "-fno-math-errno"]
    name = "fxdebug_observe_v2"
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            cpu = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpu = ""
        if " avx512f " in cpu and " avx512vl " in cpu and " avx512bw " in cpu and " fma " in cpu:
            flags += ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mprefer-vector-width=512"]
            name += "_avx512"
        elif " avx2 " in cpu and " fma " in cpu:
            flags += ["-mavx2", "-mfma"]
            name += "_avx2"
    return name, flags


def _build() -> None:
    from torch.utils import cpp_extension

    name, flags = _cflags()
    cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES], extra_cflags=flags, is_python_module=False,
                       verbose=bool(os.environ.get("FXDEBUG_VERBOSE_BUILD")))


def load() -> str:
    """Make ``torch.ops.fxdebug.observe`` available; returns the CPU backend: ``"c++"`` or ``"torch"``."""
    if _STATE["backend"] is not None:
        return _STATE["backend"]
    with _LOCK:
        if _STATE["backend"] is not None:
            return _STATE["backend"]
        have = _defined()
        if not have and not os.environ.get("FXDEBUG_NO_KERNEL"):
            try:
                _build()
                have = _defined()
            except Exception as exc:  # no compiler, no headers, a read-only cache...: fall back, and say so
                _STATE["why"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}"
        elif not have:
            _STATE["why"] = "FXDEBUG_NO_KERNEL is set"
        lib = torch.library.Library("fxdebug", "FRAGMENT")
        _STATE["libs"].append(lib)
        if not have:
            lib.define(_SCHEMA)
            lib.define(_SCHEMA_MANY)
            lib.impl("observe", _below_autograd, "Autograd")
            lib.impl("observe_many", _many_below_autograd, "Autograd")
        lib.impl("observe", observe_torch, "CompositeExplicitAutograd")
        lib.impl("observe_many", observe_many_torch, "CompositeExplicitAutograd")
        torch.library.register_fake("fxdebug::observe", _fake, lib=lib)
        torch.library.register_fake("fxdebug::observe_many", _fake_many, lib=lib)
        _STATE["backend"] = "c++" if have else "torch"
    return str(_STATE["backend"])


def _defined() -> bool:
    try:
        torch.ops.fxdebug.observe.default  # noqa: B018
        torch.ops.fxdebug.observe_many.default  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _fake(x: Any, table: Any, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    return None


def _fake_many(xs: Any, table: Any, args: Any) -> None:
    return None


def observe_many_torch(xs: Any, table: Any, args: Any) -> None:
    for i, x in enumerate(xs):
        observe_torch(x, table, *args[4 * i: 4 * i + 4])


def _many_below_autograd(xs: Any, table: Any, args: Any) -> None:
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fxdebug.observe_many.default(xs, table, args)


def _below_autograd(x: Any, table: Any, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fxdebug.observe.default(x, table, row, chan_off, channels, channel_dim)


def backend() -> str:
    """``"c++"`` when the native CPU kernel is loaded, ``"torch"`` for the pure-torch fallback."""
    return load()


def fallback_reason() -> str | None:
    """Why the native kernel is not in use (``None`` when it is)."""
    load()
    return _STATE["why"]


def observe_op() -> Any:
    """The op overload the graph calls (loading it first)."""
    load()
    return torch.ops.fxdebug.observe.default


def observe_many_op() -> Any:
    """The batched op: several small tensors in one call."""
    load()
    return torch.ops.fxdebug.observe_many.default
