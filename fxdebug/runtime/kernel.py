"""``torch.ops.fxdebug.observe``: the one op an instrumented graph calls per observed node.

The schema and the CPU kernel live in C++ (fxdebug/csrc/observe.cpp), built on first use with
``torch.utils.cpp_extension.load`` (JIT, cached under torch's extension directory, so only the
first process on a machine compiles). The graph calls the op straight into the dispatcher — no
Python per call on CPU. Devices without a native kernel (CUDA, ...) get the pure-torch
implementation (``fallback.py``) under ``CompositeExplicitAutograd``; if the C++ build fails
(no compiler), the same op name is defined from Python with that implementation everywhere, and
``backend()`` says so (the report adds a note). The fake implementation (shapes only) is what
``torch.compile`` and ``torch.export`` trace, so the op is one node there, with no graph break.

Choosing the kernel: ``FXDEBUG_KERNEL=cpp`` (the default on CPU), ``triton`` (the Triton kernel,
``triton_kernel.py``; on CPU tensors only with ``TRITON_INTERPRET=1``, which is how CI checks it)
or ``torch`` (the pure-torch path, ``fallback.py``, everywhere). On CUDA the Triton kernel is the
default when triton imports, else the pure-torch path. ``active(device_type)`` says which kernel
observes tensors of a device type (the report's notes say it too); ``use(name)`` switches the CPU
(and CUDA) kernel for a block of code, in process (tests and benchmarks).

Under torch.compile the op is one extern call per observed node by default. With
``FXDEBUG_COMPILE_STATS=inline`` (or inside ``fused_compile()``) its ``Functionalize`` kernel
(``functional.py``) expresses it as aten reductions that Inductor fuses into the producing
kernels instead — correct and extern-free, but measured slower on CPU so far (docs/performance.md).

``FXDEBUG_NO_KERNEL=1`` skips the build (forces the fallback); ``FXDEBUG_VERBOSE_BUILD=1`` shows
the compiler's output. The build's name is keyed by a hash of the C++ source, the compiler flags
and the torch installation (its path, version and build), so checkouts with different sources,
torch builds or environments never rebuild over each other's cache; a build says so on stderr (it takes tens of seconds, once per machine).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from fxdebug.errors import UsageError
from fxdebug.runtime.fallback import observe_many_torch, observe_torch

__all__ = ["KERNELS", "active", "any_nonfinite_op", "backend", "copy_plan_class", "fallback_reason", "fused_compile", "load", "observe_grad_many_op", "observe_grad_op",
           "observe_many_op", "observe_op", "requested", "runtime_notes", "tick_op", "use"]

KERNELS = ("cpp", "triton", "torch")

_SCHEMA = "observe(Tensor x, Tensor(a!) table, int row, int chan_off, int channels, int channel_dim) -> ()"
_SCHEMA_MANY = "observe_many(Tensor[] xs, Tensor(a!) table, int[] args) -> ()"
_SCHEMA_GRAD = "observe_grad(Tensor x, Tensor(a!) table, int row, int chan_off, int channels, int channel_dim) -> ()"
_SCHEMA_GRAD_MANY = "observe_grad_many(Tensor[] xs, Tensor(a!) table, int[] args) -> ()"
_SOURCES = [Path(__file__).resolve().parent.parent / "csrc" / "observe.cpp"]
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"backend": None, "why": None, "libs": [], "cuda": "torch", "cuda_why": None}


class _Library(Protocol):
    """What this module uses of ``torch.library.Library`` (whose methods torch leaves unannotated)."""

    def define(self, schema: str, alias_analysis: str = "", *, tags: tuple[Any, ...] = ()) -> str: ...

    def impl(self, op_name: str, fn: Callable[..., Any], dispatch_key: str = "") -> None: ...

    def _destroy(self) -> None: ...


def _library(ns: str, kind: str) -> torch.library.Library:
    """A ``torch.library.Library`` for namespace ``ns`` (``"FRAGMENT"`` or ``"IMPL"``)."""
    make: Callable[[str, str], torch.library.Library] = torch.library.Library
    return make(ns, kind)



def _cflags() -> tuple[str, list[str]]:
    """Optimisation flags safe for this machine, and a build name that keeps caches apart."""
    flags = ["-O3", "-fopenmp-simd", "-fno-math-errno"]
    name = "fxdebug_observe"
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


def build_name() -> tuple[str, list[str]]:
    """The extension's cache name: keyed by a hash of the sources, the flags and the torch installation
    (two checkouts, two torch builds, or two environments with one torch version never rebuild over each
    other), and its flags."""
    name, flags = _cflags()
    h = hashlib.sha256()
    for src in _SOURCES:
        h.update(src.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(_torch_installation().encode())
    return f"{name}_{h.hexdigest()[:12]}", flags


def _torch_installation() -> str:
    """The torch the kernel builds against: where it is installed, its version and its build (git commit,
    CUDA/ROCm, C++ ABI) and the Python it runs under. Two environments with the same torch version (a venv
    and a conda env) have their own build folders instead of rebuilding the kernel over each other's."""
    where = os.path.realpath(os.path.dirname(torch.__file__))
    build = (torch.__version__, getattr(torch.version, "git_version", ""), getattr(torch.version, "cuda", None),
             getattr(torch.version, "hip", None), getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
             sys.version_info[:2])
    return f"{where}|{build!r}"


def _built(name: str) -> bool:
    from torch.utils import cpp_extension

    root = Path(cpp_extension._get_build_directory(name, verbose=False))
    return any(root.glob(f"{name}*.so"))


def _staged_sources(name: str) -> list[str]:
    """The sources copied into the build's own directory (named by their hash), so every checkout
    builds from the same paths: ninja sees one unchanged build, not a new one per checkout."""
    from torch.utils import cpp_extension

    root = Path(cpp_extension._get_build_directory(name, verbose=False)) / "src"
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for src in _SOURCES:
        dest = root / src.name
        data = src.read_bytes()
        if not dest.exists() or dest.read_bytes() != data:
            tmp = dest.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)
        out.append(str(dest))
    return out


def _build() -> None:
    from torch.utils import cpp_extension

    name, flags = build_name()
    if not _built(name):
        print(f"fxdebug: building the C++ observation kernel ({name}; once per source and torch version, "
              "~20-60 s)...", file=sys.stderr, flush=True)
    cpp_extension.load(name=name, sources=_staged_sources(name), extra_cflags=flags, is_python_module=False,
                       verbose=bool(os.environ.get("FXDEBUG_VERBOSE_BUILD")))


def requested() -> str | None:
    """The kernel ``FXDEBUG_KERNEL`` asks for (``None``: the default per device)."""
    value = os.environ.get("FXDEBUG_KERNEL", "").strip().lower()
    if not value:
        return None
    value = {"c++": "cpp", "native": "cpp", "python": "torch", "fallback": "torch"}.get(value, value)
    if value not in KERNELS:
        raise UsageError(f"FXDEBUG_KERNEL={os.environ['FXDEBUG_KERNEL']!r} names no observation kernel; "
                         f"expected one of {', '.join(KERNELS)} (or unset it for the default: cpp on CPU, triton on CUDA)")
    return value


def _triton_problem(device_type: str) -> str | None:
    """Why the Triton kernel cannot observe tensors of ``device_type`` here (``None``: it can)."""
    from fxdebug.runtime import triton_kernel

    if not triton_kernel.available():
        return f"triton does not import ({triton_kernel.why_unavailable()})"
    if device_type == "cpu" and not triton_kernel.interpreting():
        return "Triton runs on CPU tensors only under its interpreter: set TRITON_INTERPRET=1 before triton is imported"
    return None


def _impls(name: str, device_type: str) -> tuple[Any, Any]:
    if name == "triton":
        from fxdebug.runtime.triton_kernel import observe_many_triton, observe_triton

        return observe_triton, observe_many_triton
    return observe_torch, observe_many_torch


def load() -> str:
    """Make ``torch.ops.fxdebug.observe`` available; returns the CPU backend: ``"c++"`` or ``"torch"``."""
    loaded: str | None = _STATE["backend"]
    if loaded is not None:
        return loaded
    with _LOCK:
        loaded = _STATE["backend"]
        if loaded is not None:
            return loaded
        want = requested()
        have = _defined()
        if not have and want not in (None, "cpp"):
            _STATE["why"] = f"FXDEBUG_KERNEL={want}"
        elif not have and not os.environ.get("FXDEBUG_NO_KERNEL"):
            try:
                _build()
                have = _defined()
            except Exception as exc:  # no compiler, no headers, a read-only cache...: fall back, and say so
                _STATE["why"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}"
        elif not have:
            _STATE["why"] = "FXDEBUG_NO_KERNEL is set"
        fragment = _library("fxdebug", "FRAGMENT")
        _STATE["libs"].append(fragment)
        lib: _Library = fragment
        if not have:
            flex = (torch.Tag.flexible_layout,)  # any strides in; as the C++ definitions (observe.cpp)
            lib.define(_SCHEMA, tags=flex)
            lib.define(_SCHEMA_MANY, tags=flex)
            lib.impl("observe", _below_autograd, "Autograd")
            lib.impl("observe_many", _many_below_autograd, "Autograd")
            lib.define(_SCHEMA_GRAD, tags=flex)
            lib.define(_SCHEMA_GRAD_MANY, tags=flex)
            lib.impl("observe_grad", _observe_grad_py, "CompositeImplicitAutograd")
            lib.impl("observe_grad_many", _observe_grad_many_py, "CompositeImplicitAutograd")
        lib.impl("observe", observe_torch, "CompositeExplicitAutograd")
        lib.impl("observe_many", observe_many_torch, "CompositeExplicitAutograd")
        torch.library.register_fake("fxdebug::observe", _fake, lib=fragment)
        torch.library.register_fake("fxdebug::observe_many", _fake_many, lib=fragment)
        if _has_tick():
            torch.library.register_fake("fxdebug::tick", _fake_tick, lib=fragment)
        if _has_any_nonfinite():
            torch.library.register_fake("fxdebug::any_nonfinite", _fake_any_nonfinite, lib=fragment)
        mode = os.environ.get("FXDEBUG_COMPILE_STATS", "extern").strip().lower() or "extern"
        if mode not in ("extern", "inline"):
            raise UsageError(f"FXDEBUG_COMPILE_STATS={mode!r}: expected 'extern' (default) or 'inline'")
        if mode == "inline":
            _STATE["fused_lib"] = _register_fused()
        cpu = "c++" if have else "torch"
        if want in ("triton", "torch"):
            problem = _triton_problem("cpu") if want == "triton" else None
            if problem is None:
                cpu = want
                one, many = _impls(want, "cpu")
                with _quiet_override():
                    lib.impl("observe", one, "CPU")
                    lib.impl("observe_many", many, "CPU")
            else:
                _STATE["why"] = f"FXDEBUG_KERNEL=triton: {problem}"
        elif want == "cpp" and not have:
            _STATE["why"] = f"FXDEBUG_KERNEL=cpp, but the build failed: {_STATE['why']}"
        if want != "torch" and torch.cuda.is_available():
            problem = _triton_problem("cuda")
            if problem is None:
                one, many = _impls("triton", "cuda")
                lib.impl("observe", one, "CUDA")
                lib.impl("observe_many", many, "CUDA")
                _STATE["cuda"] = "triton"
            else:
                _STATE["cuda_why"] = problem
        _STATE["backend"] = cpu
    return str(_STATE["backend"])


def _register_fused() -> _Library:
    """Register the op's ``Functionalize`` kernel (functional.py): under torch.compile / export the
    op becomes aten reductions that Inductor fuses into the producer's kernel."""
    from fxdebug.runtime.functional import observe_functional, observe_many_functional

    lib: _Library = _library("fxdebug", "IMPL")
    lib.impl("observe", observe_functional, "Functionalize")
    lib.impl("observe_many", observe_many_functional, "Functionalize")
    return lib


@contextlib.contextmanager
def fused_compile() -> Iterator[None]:
    """Inside the block, graphs that torch.compile traces get the statistics as fusible aten
    reductions instead of one extern call per observed node (``FXDEBUG_COMPILE_STATS=inline``
    does it for the whole process). Turn inductor's FX graph cache off when switching: it does
    not key on this registration."""
    load()
    if _STATE.get("fused_lib") is not None:
        yield
        return
    lib = _register_fused()
    try:
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def _quiet_override() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        yield


def active(device_type: str = "cpu") -> str:
    """The kernel that observes tensors of ``device_type``: ``"c++"``, ``"triton"`` or ``"torch"``."""
    load()
    if device_type == "cpu":
        return str(_STATE["backend"])
    if device_type == "cuda":
        return str(_STATE["cuda"])
    return "torch"


@contextlib.contextmanager
def use(name: str) -> Iterator[str]:
    """Observe CPU (and CUDA) tensors with kernel ``name`` inside the block, then restore the
    previous choice. ``"cpp"`` needs the C++ kernel built; ``"triton"`` on CPU needs
    ``TRITON_INTERPRET=1``. Yields the kernel's name as ``active()`` spells it."""
    if name not in KERNELS:
        raise UsageError(f"no observation kernel named {name!r}; expected one of {', '.join(KERNELS)}")
    load()
    if name == "cpp":  # the C++ kernel is registered below any Python override: it is there or not
        if _STATE["backend"] != "c++":
            raise UsageError(f"the C++ observation kernel is not the CPU kernel in this process ({_STATE['why']}); "
                             "unset FXDEBUG_KERNEL / FXDEBUG_NO_KERNEL to use it")
        yield "c++"
        return
    if name == "triton":
        problem = _triton_problem("cpu")
        if problem is not None:
            raise UsageError(f"the Triton observation kernel cannot run on CPU here: {problem}")
    previous = {k: _STATE[k] for k in ("backend", "cuda")}
    lib: _Library = _library("fxdebug", "IMPL")
    try:
        one, many = _impls(name, "cpu")
        with _quiet_override():
            for key in ("CPU",) + (("CUDA",) if torch.cuda.is_available() else ()):
                lib.impl("observe", one, key)
                lib.impl("observe_many", many, key)
        _STATE["backend"] = _STATE["cuda"] = name
        yield name
    finally:
        lib._destroy()  # the dispatcher falls back to the kernels registered before
        _STATE.update(previous)


def runtime_notes(device_types: Any) -> list[str]:
    """The report's notes about the kernels that observed tensors on ``device_types``."""
    notes = []
    for dt in sorted(set(device_types)):
        if dt == "meta":
            continue
        kernel = active(dt)
        how = " (interpreter)" if kernel == "triton" and dt == "cpu" else ""
        why = _STATE["why"] if dt == "cpu" else (_STATE["cuda_why"] if dt == "cuda" else None)
        line = f"runtime: observation kernel {kernel}{how} on {dt}"
        if kernel == "torch" and why:
            line += f" (the native kernel is not in use: {why}; the pure-torch path computed the same statistics, " \
                    "more slowly)"
        notes.append(line)
    return notes


def _defined() -> bool:
    try:
        torch.ops.fxdebug.observe.default  # noqa: B018
        torch.ops.fxdebug.observe_many.default  # noqa: B018
        torch.ops.fxdebug.observe_grad.default  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _has_tick() -> bool:
    try:
        torch.ops.fxdebug.tick.default  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _fake_tick(table: Any) -> None:
    return None


def tick_op() -> Any:
    """The clock's tick, ``fxdebug::tick(table)`` (slot 0 of the state table += 1, one store on CPU),
    as the dispatcher's own callable (no ``OpOverload.__call__`` frame); ``None`` where the C++
    build is absent (``FXDEBUG_NO_KERNEL=1``, no compiler): the clock then adds to a view of slot 0."""
    load()
    if not _has_tick():
        return None
    return torch.ops.fxdebug.tick.default._op


def _has_any_nonfinite() -> bool:
    try:
        torch.ops.fxdebug.any_nonfinite.default  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _fake_any_nonfinite(xs: Any, flag: Any) -> None:
    return None


def any_nonfinite_op() -> Any:
    """The guard's gradient check, ``fxdebug::any_nonfinite(xs, flag)``: sets ``flag`` (one element,
    floating, on the CPU) to 1.0 when any element of the CPU tensors ``xs`` is NaN or +/-Inf (exact:
    a bit test on the exponent), else leaves it; reads each tensor once and writes none (the amp op
    ``_amp_foreach_non_finite_check_and_unscale_`` multiplies and writes back every element). As the
    dispatcher's own callable; ``None`` where the C++ build is absent (``FXDEBUG_NO_KERNEL=1``, no
    compiler): the caller then uses the amp op. CPU only (other devices: the amp op)."""
    load()
    if not _has_any_nonfinite():
        return None
    return torch.ops.fxdebug.any_nonfinite.default._op


def copy_plan_class() -> Any:
    """``torch.classes.fxdebug.CopyPlan(live, copies)`` (the guard's conditional copies on the CPU:
    ``save(flag)`` copies ``live`` into ``copies`` and ``restore(flag)`` back, byte for byte, only when
    the 0-d float32 CPU ``flag`` is non-zero; a good step reads the flag and returns without touching
    a tensor), or ``None`` where the C++ build is absent."""
    load()
    if not _has_any_nonfinite():
        return None
    try:
        return torch.classes.fxdebug.CopyPlan
    except (AttributeError, RuntimeError):
        return None


def _fake(x: Any, table: Any, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    return None


def _fake_many(xs: Any, table: Any, args: Any) -> None:
    return None


def _many_below_autograd(xs: Any, table: Any, args: Any) -> None:
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.fxdebug.observe_many.default(xs, table, args)


def _below_autograd(x: Any, table: Any, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.fxdebug.observe.default(x, table, row, chan_off, channels, channel_dim)


def backend() -> str:
    """``"c++"`` when the native CPU kernel is loaded, ``"torch"`` for the pure-torch fallback."""
    return load()


def fallback_reason() -> str | None:
    """Why the native kernel is not in use (``None`` when it is)."""
    load()
    why: str | None = _STATE["why"]
    return why


def observe_op() -> Any:
    """The op overload the graph calls (loading it first)."""
    load()
    return torch.ops.fxdebug.observe.default


def observe_many_op() -> Any:
    """The batched op: several small tensors in one call."""
    load()
    return torch.ops.fxdebug.observe_many.default


def observe_grad_op() -> Any:
    """The gradient tap: ``observe_grad(x, table, row, chan_off, channels, channel_dim)`` makes the
    backward observe the gradient flowing into ``x`` (a C++ hook calling ``observe``: no Python in
    the backward where the C++ kernel is built); a no-op without autograd."""
    load()
    return torch.ops.fxdebug.observe_grad.default


def observe_grad_many_op() -> Any:
    """Several gradient taps in one call (4 ints per tensor, as ``observe_many``)."""
    load()
    return torch.ops.fxdebug.observe_grad_many.default


def _observe_grad_py(x: Any, table: Any, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    """``observe_grad`` where the C++ extension is not built: a Python tensor hook whose body is the op
    itself (``functools.partial``, state bound by keyword: no Python frame of ours in the backward)."""
    if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
        hook = functools.partial(torch.ops.fxdebug.observe.default, table=table, row=row, chan_off=chan_off,
                                 channels=channels, channel_dim=channel_dim)
        x.register_hook(hook)


def _observe_grad_many_py(xs: Any, table: Any, args: Any) -> None:
    if torch.is_grad_enabled():
        for i, x in enumerate(xs):
            _observe_grad_py(x, table, *args[4 * i: 4 * i + 4])
