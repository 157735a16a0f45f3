"""The Triton implementation of ``fxdebug::observe`` / ``observe_many`` (GPUs; CPU under the interpreter).

Same state layout and rules as the C++ kernel (fxdebug/csrc/observe.cpp, runtime/slots.py):

* one launch per call, whatever the tensor's size: a 2-D grid ``(blocks, members)`` where each
  member is one observed tensor (``observe`` has one, ``observe_many`` up to ``MAX_MEMBERS``
  small tensors: one launch for the whole batch);
* each program reads one block of its tensor once and computes sum, sum of squares, sum of |x|,
  zero / NaN / Inf counts, min and max (NaN ignored there, counted instead) and, with channels,
  the max of every channel the block touches. Sums run in float32 lanes and are added in float64;
  a block whose float sums are not finite (a NaN/Inf, or finite values that overflowed) is redone
  in float64, so counts are exact and 1e36**2 never looks non-finite. float64 inputs run in
  float64 throughout;
* partials go to a per-device scratch row with float64 atomics; the program that finishes last
  (an atomic counter) folds the scratch into the table row — calls, counts, sums, NaN-sticky
  min/max, the per-call L2 norm, bad calls and the first bad call (read from the table's clock,
  ``table[0]``, on the device) — and resets the scratch for the next call. Nothing is read back to
  the host: no sync.

Calls on one device must be stream-ordered (the scratch is shared per device, as a stream
serialises kernels); concurrent observation from several CUDA streams is not supported.

On CPU tensors the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1`` or not: an
interpreted copy of the kernel is used for CPU tensors), which is how CI checks it against the
C++ kernel (tests/test_triton_kernel.py). It is slow there: a check, not a CPU backend.
"""

import contextlib
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fxdebug.runtime.slots import K

__all__ = ["MAX_MEMBERS", "available", "interpreting", "observe_many_triton", "observe_triton", "why_unavailable"]

MAX_MEMBERS = 16  # tensors per launch (observe_many's batches hold at most 16)
S = 16  # scratch slots per member: sum, sumsq, abs, zeros, nan, inf, min, max, done-counter
_SUM, _SUMSQ, _ABS, _ZEROS, _NAN, _INF, _MIN, _MAX, _DONE = range(9)

try:  # triton is optional: without it the kernel is simply unavailable
    import triton  # (untyped, or absent: pyproject.toml's mypy overrides ignore it either way)
    import triton.language as tl

    _IMPORT_ERROR: Optional[str] = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

    class tl:  # type: ignore[no-redef]  # noqa: N801 - lets the kernel's annotations evaluate without triton
        constexpr = None


def available() -> bool:
    return triton is not None


def why_unavailable() -> Optional[str]:
    return _IMPORT_ERROR


def _observe_kernel(xs, table_ptr, scratch_ptr, ns, nfs, rows, chan_offs, cscr, cs, inners, modes, nblocks,  # noqa: C901
                    N: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr):
    """Grid (max blocks, N). ``modes[j]``: 0 no channels, 1 channels, 2 channel count mismatch
    (counted as a call, no channel maxima). ``ns[j] == 0``: empty or non-floating tensor (a call
    is counted, nothing else). ``cscr[j]``: where member j's channel partials (max, NaN flag)
    start in the scratch."""
    pid = tl.program_id(0)
    member = tl.program_id(1)
    for j in tl.static_range(N):
        if member == j:
            n = ns[j]
            nb = nblocks[j]
            if pid < nb:
                sc = scratch_ptr + j * 16
                if n > 0:
                    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                    mask = offs < n
                    raw = tl.load(xs[j] + offs, mask=mask, other=0.0)
                    if raw.dtype == tl.float64:
                        v = raw
                        s = tl.sum(v, 0)
                        sq = tl.sum(v * v, 0)
                        ab = tl.sum(tl.abs(v), 0)
                    else:
                        v32 = raw.to(tl.float32)
                        s32 = tl.sum(v32, 0)
                        sq32 = tl.sum(v32 * v32, 0)
                        ab32 = tl.sum(tl.abs(v32), 0)
                        v = v32.to(tl.float64)
                        s = s32.to(tl.float64)
                        sq = sq32.to(tl.float64)
                        ab = ab32.to(tl.float64)
                        # A NaN/Inf in the block, or float sums that overflowed: redo the block wide.
                        if (ab32 != ab32) | (sq32 != sq32) | (ab32 == float("inf")) | (sq32 == float("inf")):
                            s = tl.sum(v, 0)
                            sq = tl.sum(v * v, 0)
                            ab = tl.sum(tl.abs(v), 0)
                    isnan = (v != v) & mask
                    zeros = tl.sum(((v == 0.0) & mask).to(tl.float64), 0)
                    nans = tl.sum(isnan.to(tl.float64), 0)
                    infs = tl.sum(((tl.abs(v) == float("inf")) & mask).to(tl.float64), 0)
                    ok = mask & (v == v)
                    lo = tl.min(tl.where(ok, v, float("inf")), 0)
                    hi = tl.max(tl.where(ok, v, float("-inf")), 0)
                    tl.atomic_add(sc + 0, s)
                    tl.atomic_add(sc + 1, sq)
                    tl.atomic_add(sc + 2, ab)
                    tl.atomic_add(sc + 3, zeros)
                    tl.atomic_add(sc + 4, nans)
                    tl.atomic_add(sc + 5, infs)
                    tl.atomic_min(sc + 6, lo)
                    tl.atomic_max(sc + 7, hi)
                    if modes[j] == 1:
                        ch = (offs // inners[j]) % cs[j]
                        cptr = scratch_ptr + cscr[j] + ch * 2
                        tl.atomic_max(cptr, tl.where(ok, v, float("-inf")), mask=ok)
                        tl.atomic_max(cptr + 1, tl.where(isnan, 1.0, 0.0).to(tl.float64), mask=isnan)
                done = tl.atomic_add(sc + 8, 1.0)
                if done == nb - 1:  # the last program of this member: fold into the table row
                    r = table_ptr + 16 * (rows[j] + 1)
                    tl.store(r + 0, tl.load(r + 0) + 1.0)  # calls
                    if modes[j] == 2:
                        tl.store(r + 14, 1.0)  # chan_mismatch
                    if n > 0:
                        t_s = tl.atomic_add(sc + 0, 0.0)  # coherent read
                        t_sq = tl.atomic_add(sc + 1, 0.0)  # coherent read
                        t_ab = tl.atomic_add(sc + 2, 0.0)  # coherent read
                        t_z = tl.atomic_add(sc + 3, 0.0)  # coherent read
                        t_nan = tl.atomic_add(sc + 4, 0.0)  # coherent read
                        t_inf = tl.atomic_add(sc + 5, 0.0)  # coherent read
                        t_lo = tl.atomic_add(sc + 6, 0.0)  # coherent read
                        t_hi = tl.atomic_add(sc + 7, 0.0)  # coherent read
                        tl.store(sc + 0, 0.0)  # reset the scratch for the next call
                        tl.store(sc + 1, 0.0)
                        tl.store(sc + 2, 0.0)
                        tl.store(sc + 3, 0.0)
                        tl.store(sc + 4, 0.0)
                        tl.store(sc + 5, 0.0)
                        tl.store(sc + 6, float("inf"))
                        tl.store(sc + 7, float("-inf"))
                        tl.store(r + 1, tl.load(r + 1) + 1.0)
                        # the count as an int64 tensor first (a float argument would be float32 on GPUs)
                        tl.store(r + 2, tl.load(r + 2) + (ns[j] + tl.zeros((), tl.int64)).to(tl.float64))
                        tl.store(r + 3, tl.load(r + 3) + t_s)
                        tl.store(r + 4, tl.load(r + 4) + t_sq)
                        tl.store(r + 5, tl.load(r + 5) + t_ab)
                        tl.store(r + 6, tl.load(r + 6) + t_z)
                        tl.store(r + 7, tl.load(r + 7) + t_nan)
                        tl.store(r + 8, tl.load(r + 8) + t_inf)
                        old_lo = tl.load(r + 9)
                        old_hi = tl.load(r + 10)
                        tl.store(r + 9, tl.where((t_nan > 0) | (old_lo != old_lo), float("nan"), tl.minimum(old_lo, t_lo)))
                        tl.store(r + 10, tl.where((t_nan > 0) | (old_hi != old_hi), float("nan"), tl.maximum(old_hi, t_hi)))
                        tl.store(r + 11, tl.load(r + 11) + tl.sqrt(t_sq))
                        if t_nan + t_inf > 0:
                            tl.store(r + 12, tl.load(r + 12) + 1.0)
                            tl.store(r + 13, tl.minimum(tl.load(r + 13), tl.load(table_ptr)))
                        if modes[j] == 1:
                            for c0 in range(0, cs[j], CB):
                                cidx = c0 + tl.arange(0, CB)
                                cm = cidx < cs[j]
                                cptr = scratch_ptr + cscr[j] + cidx * 2
                                pm = tl.atomic_add(cptr, tl.zeros((CB,), tl.float64), mask=cm)
                                pn = tl.atomic_add(cptr + 1, tl.zeros((CB,), tl.float64), mask=cm)
                                tl.store(cptr, tl.full((CB,), float("-inf"), tl.float64), mask=cm)
                                tl.store(cptr + 1, tl.zeros((CB,), tl.float64), mask=cm)
                                tptr = table_ptr + chan_offs[j] + cidx
                                cur = tl.load(tptr, mask=cm, other=0.0)
                                new = tl.where((pn > 0) | (cur != cur) | (pm != pm), float("nan"), tl.maximum(cur, pm))
                                tl.store(tptr, new, mask=cm)
                    tl.store(sc + 8, 0.0)


_lock = threading.Lock()
_compiled: Dict[str, Any] = {}
_scratch: Dict[torch.device, Tensor] = {}
_BLOCK = {"jit": 2048, "interp": 16384}  # the interpreter runs programs one by one: fewer, larger blocks


def interpreting() -> bool:
    """Whether triton was imported under its interpreter (``TRITON_INTERPRET=1``): the only way
    its kernels run on CPU tensors (triton's own reductions are built at import time)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def _kernel(device: torch.device) -> Tuple[Any, int]:
    """The jitted (or, under ``TRITON_INTERPRET=1``, interpreted) kernel and its block size."""
    kind = "interp" if interpreting() else "jit"
    if device.type == "cpu" and kind == "jit":
        raise RuntimeError("fxdebug: the Triton observation kernel runs on CPU tensors only under Triton's interpreter; "
                           "set TRITON_INTERPRET=1 before triton is imported (or use FXDEBUG_KERNEL=cpp / torch on CPU).")
    fn = _compiled.get(kind)
    if fn is None:
        with _lock:
            fn = _compiled.get(kind)
            if fn is None:
                fn = _compiled[kind] = triton.jit(_observe_kernel)
    return fn, _BLOCK[kind]


def _scratch_for(device: torch.device, size: int) -> Tensor:
    """The device's scratch (partials between the programs of one call; reset by the last one)."""
    buf = _scratch.get(device)
    if buf is None or buf.numel() < size:
        size = max(size, 16 * MAX_MEMBERS + 2 * 1024)
        init = torch.zeros(size, dtype=torch.float64)
        head = init[: 16 * MAX_MEMBERS].view(MAX_MEMBERS, 16)
        head[:, _MIN] = float("inf")
        head[:, _MAX] = float("-inf")
        init[16 * MAX_MEMBERS:: 2] = float("-inf")
        buf = _scratch[device] = init.to(device)
    return buf


def _check(x: Tensor, table: Tensor) -> None:
    if table.device != x.device:
        raise RuntimeError(f"fxdebug::observe: the observed tensor is on {x.device} but the instrumentation state is "
                           f"on {table.device}; keep the model and its inputs on one device (or re-instrument after "
                           "moving them).")


def _launch(xs: Sequence[Tensor], table: Tensor, args: Sequence[int]) -> None:
    if table.dtype != torch.float64 or not table.is_contiguous():
        raise RuntimeError("fxdebug::observe: the state table must be a contiguous float64 tensor")
    device = table.device
    ptrs, ns, nfs, rows, offs, cscr, cs, inners, modes, nblocks = ([] for _ in range(10))
    kernel, block = _kernel(device)
    chan_at = 16 * MAX_MEMBERS
    for i, x in enumerate(xs):
        _check(x, table)
        row, chan_off, channels, channel_dim = (int(a) for a in args[4 * i: 4 * i + 4])
        if row < 0 or K * (row + 2) > table.numel():
            raise RuntimeError(f"fxdebug::observe: row {row} outside the state table")
        n = x.numel() if x.is_floating_point() else 0
        mode, c, inner = 0, 1, 1
        if n and channels > 0 and x.dim() >= 2:
            d = channel_dim % x.dim() if -x.dim() <= channel_dim < x.dim() else -1
            if d < 0 or x.shape[d] != channels:
                mode = 2
            else:
                mode, c = 1, channels
                if x.dim() == 4 and d == 1 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
                    x = x.permute(0, 2, 3, 1)  # NHWC in memory: rows of channels (a view, no copy)
                    inner = 1
                else:
                    x = x.contiguous()
                    inner = 1
                    for s in x.shape[d + 1:]:
                        inner *= int(s)
                if chan_off + c > table.numel():
                    raise RuntimeError("fxdebug::observe: channel slots outside the state table")
        if n and mode != 1:
            x = x if x.is_contiguous() else x.contiguous()
        ptrs.append(x.detach() if n else table)
        ns.append(n)
        nfs.append(float(n))
        rows.append(row)
        offs.append(chan_off if mode == 1 else 0)
        cscr.append(chan_at if mode == 1 else 0)
        chan_at += 2 * c if mode == 1 else 0
        cs.append(c)
        inners.append(max(inner, 1))
        modes.append(mode)
        nblocks.append(max(1, -(-n // block)))
    scratch = _scratch_for(device, chan_at)
    grid = (max(nblocks), len(ptrs))
    quiet: Any = contextlib.nullcontext()
    if interpreting():  # numpy warns where float32 squares overflow: those blocks are redone wide
        import numpy

        quiet = numpy.errstate(over="ignore", invalid="ignore")
    with quiet:
        kernel[grid](tuple(ptrs), table, scratch, tuple(ns), tuple(nfs), tuple(rows), tuple(offs), tuple(cscr),
                     tuple(cs), tuple(inners), tuple(modes), tuple(nblocks), N=len(ptrs), BLOCK=block, CB=64)


def observe_triton(x: Tensor, table: Tensor, row: int, chan_off: int, channels: int, channel_dim: int) -> None:
    """``fxdebug::observe`` as one Triton launch."""
    _launch([x], table, (row, chan_off, channels, channel_dim))


def observe_many_triton(xs: Sequence[Tensor], table: Tensor, args: Sequence[int]) -> None:
    """``fxdebug::observe_many``: one launch per ``MAX_MEMBERS`` tensors."""
    if len(args) != 4 * len(xs):
        raise RuntimeError(f"fxdebug::observe_many: expected 4 ints per tensor, got {len(args)} for {len(xs)}")
    for i in range(0, len(xs), MAX_MEMBERS):
        _launch(xs[i: i + MAX_MEMBERS], table, args[4 * i: 4 * (i + MAX_MEMBERS)])
