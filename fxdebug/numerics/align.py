"""``align``: two *different* implementations of one model, matched op by op by their values; the
first op where they part.

``fxdebug.diff`` aligns runs of one graph. ``align`` takes two models that should compute the same
function — a port and its reference, a hand-written LLaMA and Hugging Face's, SDPA against eager
attention, one fused qkv projection against three — runs each once (``align_record``: every aten
op's output and the module that ran it) and matches the two recordings by value, not by name:

1. **Layout-free candidates.** Each op's mean, rms and mean |x| are a fingerprint no reshape,
   transpose or permutation changes, and each moves by at most ``‖c − r‖₂ / √n``: how far they
   differ over the rms is a lower bound of the relative error in any layout. Ops of equal size
   whose bound is within tolerance are candidates, tried best bound first; the search stops when
   the next bound exceeds the best verified error.
2. **Verification.** A candidate op matches a reference op when a real relative error
   ``‖c − r‖₂ / ‖r‖₂`` is within tolerance: in the same shape (``"same"``), or after a reshape or a
   permutation of the dims of either side (``"transposed/reshaped"``). Failing that, a slice along
   one dim of a larger reference op (``"slice of fused"``: one of q/k/v against a fused qkv
   projection), or the sum of two or three reference ops (``"sum of several"``, found with random
   projections, which add up). A candidate op that is fused where the reference is not — all its
   consumers are matched slices of it — is ``"fused (slices match)"``. Views and copies inherit
   their input's match.
3. **The first divergence** is the earliest candidate op with no match whose effect reaches the
   output through ops with no match either, and that reads agreed values (a matched op, a
   parameter or an input) — an op the reference merely computes differently (eager softmax inside
   SDPA) is followed by matched ops again and is no divergence, so there is none exactly when the
   outputs agree. Its reference counterpart is the reference's own first op that nothing in the
   candidate reproduces (same rule, mirrored), looked for first inside the reference module that
   the candidate op's module corresponds to (where that module's matched ops matched).

Masking values (``|x| >= 1e30``: ``finfo.min`` added to a score) count as ``±inf``, so a mask
written with ``-inf`` and one written with the dtype's lowest number agree.

The tolerance is a **dtype-aware noise floor**: the precision each run was *set up* with (its
float parameters, float inputs and any autocast dtype, see ``align_record``) — the coarser of the
two —, ``FLOOR × eps × √depth``, where depth counts the arithmetic ops on the longest path from
the inputs (rounding errors add up like a random walk). An fp32 run against a bf16-autocast run is
judged at bf16's floor; an op that quietly computes in bf16 inside an fp32 run is judged at fp32's.
``rtol`` replaces the floor; ``atol`` (default 0) is added per element, for tensors near zero.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from fxdebug.errors import ArgumentTypeError, UsageError
from fxdebug.graph.inputs import Inputs, normalize_inputs
from fxdebug.numerics.align_record import Op, Trace, record
from fxdebug.numerics.tensors import device_of

__all__ = ["FLOOR", "AlignRow", "Alignment", "Divergence", "align"]

FLOOR = 4.0  # the noise floor is FLOOR * eps * sqrt(depth)
SAME, LAYOUT, SLICE, SUM, FUSED = "same", "transposed/reshaped", "slice of fused", "sum of several", "fused (slices match)"
_RANK = {SAME: 0, LAYOUT: 1, FUSED: 2, SLICE: 3, SUM: 4}
_SLICING = frozenset({"split", "split_with_sizes", "slice", "select", "unbind", "chunk", "narrow", "unsafe_split"})
_HUGE = 1e30  # beyond this a value is a mask, not a number
_MAX_PERM_DIMS = 4  # 24 orders per side; beyond, only the flat order is tried


@dataclass(frozen=True)
class Divergence:
    """Where two implementations part.

    Attributes:
        reference: ``(node name, module path)`` of the reference op the candidate should have
            reproduced there (its closest unmatched counterpart).
        candidate: ``(node name, module path)`` of the first candidate op that matches nothing in
            the reference and whose effect reaches the output.
        error: relative error ``‖c − r‖₂ / ‖r‖₂`` between the two (in the layout that fits best; for
            ops of different sizes, ``nan``).
        tolerance: the noise floor it exceeded.
        op: the candidate's aten op.
    """

    reference: tuple[str | None, str | None]
    candidate: tuple[str, str]
    error: float
    tolerance: float
    op: str

    def __str__(self) -> str:
        ref = f"{self.reference[0]} in {_where(self.reference[1])}" if self.reference[0] else "nothing"
        return (f"candidate {self.candidate[0]} ({self.op}) in {_where(self.candidate[1])} first departs from the reference "
                f"(counterpart {ref}): relative error {self.error:.3g}, noise floor {self.tolerance:.3g}")


def _where(module: str | None) -> str:
    return "the top-level forward" if module == "" else repr(module)


@dataclass(frozen=True)
class AlignRow:
    """One matched pair: a candidate op and the reference op(s) whose values it reproduces.

    ``reference`` is one ``(node, module)``; ``references`` lists them all (several for
    ``"sum of several"`` and ``"fused (slices match)"``). ``match`` is how it was matched,
    ``error`` the relative error, ``tolerance`` the floor it was judged at."""

    candidate: tuple[str, str]
    reference: tuple[str, str]
    match: str
    error: float
    tolerance: float
    op: str
    shape: tuple[int, ...]
    references: tuple[tuple[str, str], ...] = ()


@dataclass
class _Match:
    refs: tuple[int, ...]
    kind: str
    error: float
    tol: float


class _Side:
    """Per-op values of one recording in float64, with cached moments."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._flat: dict[int, Tensor] = {}
        self._moments: dict[int, Tensor] = {}

    def value(self, i: int) -> Tensor:
        if i not in self._flat:
            self._flat[i] = _masked(self.trace.ops[i].value.detach().to(torch.float64))
        return self._flat[i]

    def moments(self, i: int) -> Tensor:
        """``[mean, rms, mean |x|, min, max, #+inf, #-inf, #nan]`` (finite values only in the
        first five): no layout changes them, and each of the first three moves by at most
        ``‖c − r‖₂ / √n`` between two tensors ``c``, ``r`` — a cheap necessary test of a match."""
        if i not in self._moments:
            self._moments[i] = _moments(self.value(i))
        return self._moments[i]


def _moments(v: Tensor) -> Tensor:
    flat = v.reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.zeros(8, dtype=torch.float64)
    total, norm, abs_total = float(flat.sum()), float(torch.linalg.vector_norm(flat)), float(flat.abs().sum())
    if math.isfinite(total) and math.isfinite(norm) and math.isfinite(abs_total):  # every value finite
        lo, hi = torch.aminmax(flat)
        return torch.tensor([total / n, norm / math.sqrt(n), abs_total / n, float(lo), float(hi), 0.0, 0.0, 0.0],
                            dtype=torch.float64)
    finite = torch.isfinite(flat)
    f = torch.where(finite, flat, torch.zeros_like(flat))
    counts = [float((flat == math.inf).sum()), float((flat == -math.inf).sum()), float(torch.isnan(flat).sum())]
    lo, hi = torch.aminmax(flat[finite]) if bool(finite.any()) else (torch.zeros(()), torch.zeros(()))
    return torch.tensor([float(f.sum()) / n, float(torch.linalg.vector_norm(f)) / math.sqrt(n), float(f.abs().sum()) / n,
                         float(lo), float(hi), *counts], dtype=torch.float64)


def _masked(v: Tensor) -> Tensor:
    """``v`` with masking values (``|x| >= 1e30``: ``finfo.min`` added to a score) as ``±inf``, so a
    mask written with ``-inf`` and one written with the dtype's lowest number agree."""
    if not v.numel() or not float(v.abs().nan_to_num(0.0).max()) >= _HUGE:
        return v
    return torch.where(v.abs() >= _HUGE, torch.sign(v) * math.inf, v)


def _rel(c: Tensor, r: Tensor) -> tuple[float, float, float]:
    """``(‖c − r‖, ‖r‖, relative error)`` with equal non-finite values counted as equal."""
    if not c.numel():
        return 0.0, 0.0, 0.0
    num = float(torch.linalg.vector_norm(c - r))
    den = float(torch.linalg.vector_norm(r))
    if not (math.isfinite(num) and math.isfinite(den)):  # the slow path: infinities and NaN
        d = c - r
        same = (c == r) | (torch.isnan(c) & torch.isnan(r))
        d = torch.where(same, torch.zeros_like(d), d)
        num = float(torch.linalg.vector_norm(d))
        if math.isnan(num):
            num = math.inf
        fin = r[torch.isfinite(r)]
        den = float(torch.linalg.vector_norm(fin)) if fin.numel() else 0.0
    if num == 0:
        return 0.0, den, 0.0
    return num, den, (num / den if den > 0 else math.inf)


class _Matcher:
    def __init__(self, ref: Trace, cand: Trace, rtol: float | None, atol: float) -> None:
        self.R, self.C = _Side(ref), _Side(cand)
        self.rtol, self.atol = rtol, atol
        self.eps = max(ref.eps, cand.eps)
        self.by_numel: dict[int, list[int]] = {}
        for op in ref.ops:
            self.by_numel.setdefault(op.value.numel(), []).append(op.index)
        self.pools: dict[int, tuple[list[int], Tensor, Tensor]] = {}
        self.projections: dict[int, tuple[list[int], Tensor, Tensor]] = {}
        self.matches: dict[int, _Match] = {}

    # ----------------------------------------------------------------- tolerance
    def tol(self, c: Op, r: Op | None) -> float:
        exact = not c.value.is_floating_point() and (r is None or not r.value.is_floating_point())
        if exact:
            return 0.0
        if self.rtol is not None:
            return self.rtol
        depth = max(c.depth, r.depth if r is not None else 0, 1)
        return FLOOR * self.eps * math.sqrt(depth)

    def ok(self, num: float, den: float, n: int, tol: float) -> bool:
        return num <= tol * den + self.atol * math.sqrt(max(n, 1))

    # ----------------------------------------------------------------- layouts
    def compare(self, c: Tensor, r: Tensor, tol: float, need: bool = True) -> tuple[float, str] | None:
        """Best (relative error, kind) of ``c`` against ``r`` (same numel) over layouts; with
        ``need``, the first layout within ``tol`` (None when none is)."""
        best: tuple[float, str] | None = None

        def consider(x: Tensor, y: Tensor, kind: str) -> bool:
            nonlocal best
            num, den, err = _rel(x, y)
            if best is None or err < best[0]:
                best = (err, kind)
            return self.ok(num, den, y.numel(), tol)

        if c.shape == r.shape and consider(c, r, SAME):
            return best
        fc, fr = c.reshape(-1), r.reshape(-1)
        if c.shape != r.shape and consider(fc, fr, LAYOUT):
            return best
        sample = torch.randperm(fc.numel(), generator=torch.Generator().manual_seed(0))[:64] if fc.numel() > 256 else None
        same_shape = c.shape == r.shape
        for x, flat_other, x_is_c in ((r.squeeze(), fc, False), (c.squeeze(), fr, True)):
            other_shape = c.shape if not x_is_c else r.shape
            if x.ndim < 2 or x.ndim > _MAX_PERM_DIMS:
                continue
            for p in itertools.permutations(range(x.ndim)):
                if p == tuple(range(x.ndim)):
                    continue
                if same_shape and any(x.shape[a] != x.shape[b] for a, b in enumerate(p)):
                    continue  # in one shape, only dims of equal size trade places (k against k transposed)
                if not _merge_or_split([x.shape[a] for a in p], other_shape):
                    continue
                perm = x.permute(p).reshape(-1)
                if sample is not None:
                    a, b = (perm[sample], flat_other[sample]) if x_is_c else (flat_other[sample], perm[sample])
                    num, den, _ = _rel(a, b)
                    if not self.ok(num, den, 64, 4 * tol + 1e-12):
                        continue
                a, b = (perm, flat_other) if x_is_c else (flat_other, perm)
                if consider(a, b, LAYOUT):
                    return best
        return None if need else best

    # ----------------------------------------------------------------- search
    def moment_pool(self, n: int) -> tuple[list[int], Tensor, Tensor]:
        """Reference ops of ``n`` elements, their moments stacked, their depths."""
        if n not in self.pools:
            pool = self.by_numel.get(n, [])
            M = torch.stack([self.R.moments(j) for j in pool]) if pool else torch.zeros(0, 8, dtype=torch.float64)
            depth = torch.tensor([float(self.R.trace.ops[j].depth) for j in pool], dtype=torch.float64)
            self.pools[n] = (pool, M, depth)
        return self.pools[n]

    def may_match(self, c: Op, M: Tensor, tol: Tensor) -> tuple[Tensor, Tensor]:
        """Which rows of moments ``M`` could be within ``tol`` of ``c`` (a necessary test), and a
        lower bound of the relative error against each (``max |Δmoment| / rms``)."""
        mc = self.C.moments(c.index)
        gap = (M[:, :3] - mc[:3]).abs().amax(dim=1)
        bound = tol * M[:, 1] * (1 + 1e-9) + self.atol + 1e-12 * torch.maximum(M[:, 1], mc[1])
        close = (gap <= bound) & (M[:, 5:] == mc[5:]).all(dim=1)
        lower = torch.where(M[:, 1] > 0, gap / M[:, 1].clamp_min(1e-300), torch.where(gap > 0, math.inf, 0.0))
        return close, lower

    def tols(self, c: Op, pool: list[int], depth: Tensor) -> Tensor:
        if not c.value.is_floating_point():
            exact = torch.tensor([not self.R.trace.ops[j].value.is_floating_point() for j in pool])
        else:
            exact = torch.zeros(len(pool), dtype=torch.bool)
        if self.rtol is not None:
            t = torch.full((len(pool),), float(self.rtol), dtype=torch.float64)
        else:
            t = FLOOR * self.eps * torch.sqrt(torch.clamp(depth, min=float(max(c.depth, 1))))
        return torch.where(exact, torch.zeros_like(t), t)

    def direct(self, c: Op) -> _Match | None:
        """The reference op ``c`` reproduces in some layout: candidates whose moments are close
        enough, ordered by the lower bound of the error those moments give (valid in any layout, so
        the search stops once the next candidate cannot beat the best verified match)."""
        n = c.value.numel()
        pool, M, depth = self.moment_pool(n)
        if not pool or n == 0:
            return None
        tols = self.tols(c, pool, depth)
        close, lower = self.may_match(c, M, tols)
        bounds = sorted((float(lower[k]), pool[k], float(tols[k])) for k in close.nonzero().flatten().tolist())
        found: list[tuple[tuple[int, float, bool, float], _Match]] = []
        best = math.inf
        cv = self.C.value(c.index).reshape(c.value.shape)
        for tried, (bound, j, tol) in enumerate(bounds):
            if bound > best * (1 + 1e-6) + 1e-300 or tried >= 24:
                break
            r = self.R.trace.ops[j]
            got = self.compare(cv, self.R.value(j).reshape(r.value.shape), tol)
            if got is None:
                continue
            best = min(best, got[0])
            pos = abs(j / max(len(self.R.trace.ops), 1) - c.index / max(len(self.C.trace.ops), 1))
            closeness = round(got[0] / tol, 1) if tol > 0 else 0.0
            found.append(((_RANK[got[1]], closeness, r.layout_of is not None, pos), _Match((j,), got[1], got[0], tol)))
        if not found:
            return None
        return min(found, key=lambda f: f[0])[1]

    def sliced(self, c: Op) -> _Match | None:
        """A slice along one dim of a bigger reference op (q of a fused qkv projection)."""
        n = c.value.numel()
        if n == 0:
            return None
        cv = self.C.value(c.index).reshape(c.value.shape)
        mc = self.C.moments(c.index)
        c_mean, c_rms = float(mc[0]), float(mc[1])
        if float(mc[5:].sum()) > 0:
            return None  # non-finite values: left to the direct match
        for r in self.R.trace.ops:
            m = r.value.numel()
            if r.layout_of is not None or m <= n or m % n or m // n > 64:
                continue
            mr = self.R.moments(r.index)
            tol = self.tol(c, r)
            span = max(abs(float(mr[3])), abs(float(mr[4])), 1e-30) * (tol + 1e-12)
            if float(mc[3]) < float(mr[3]) - span or float(mc[4]) > float(mr[4]) + span:
                continue  # the candidate's values do not lie within the reference's range
            rv = self.R.value(r.index).reshape(r.value.shape)
            for d, size in enumerate(r.value.shape):
                if (n * size) % m:
                    continue
                length = n * size // m
                if not 0 < length < size:
                    continue
                step = math.gcd(length, size)
                for s in range(0, size - length + 1, step)[:64]:
                    piece = rv.narrow(d, s, length)
                    mean, rms = float(piece.sum()) / n, float(torch.linalg.vector_norm(piece)) / math.sqrt(n)
                    slack = tol * rms * (1 + 1e-9) + self.atol + 1e-12 * max(rms, c_rms)
                    if not (abs(mean - c_mean) <= slack and abs(rms - c_rms) <= slack):
                        continue  # two moments cannot be this far apart within tolerance
                    got = self.compare(cv, piece, tol)
                    if got is not None:
                        return _Match((r.index,), SLICE, got[0], tol)
        return None

    def summed(self, c: Op) -> _Match | None:
        n = c.value.numel()
        if n == 0 or not c.value.is_floating_point():
            return None
        cv = self.C.value(c.index).reshape(-1)
        if not bool(torch.isfinite(cv).all()) or float(torch.linalg.vector_norm(cv)) == 0:
            return None
        if n not in self.projections:
            pool = [j for j in self.by_numel.get(n, []) if self.R.trace.ops[j].layout_of is None
                    and self.R.trace.ops[j].value.is_floating_point()
                    and float(self.R.moments(j)[5:].sum()) == 0 and float(self.R.moments(j)[1]) > 0]
            g = torch.randn(n, 4, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
            P = torch.stack([self.R.value(j).reshape(-1) @ g for j in pool]) if pool else torch.zeros(0, 4, dtype=torch.float64)
            self.projections[n] = (pool, g, P)
        pool, g, P = self.projections[n]
        if len(pool) < 2:
            return None
        pc = cv @ g
        tol = self.tol(c, None)
        bound = 6 * (tol * float(torch.linalg.vector_norm(cv)) + self.atol * math.sqrt(n)) + 1e-300
        k = len(pool)
        S = P[:, None, :] + P[None, :, :]
        cands: list[tuple[int, ...]] = []
        dist2 = torch.linalg.vector_norm(S - pc, dim=2)
        iu = torch.triu_indices(k, k, 1)
        close = (dist2[iu[0], iu[1]] <= bound).nonzero().flatten().tolist()
        cands += [(pool[int(iu[0][t])], pool[int(iu[1][t])]) for t in close[:8]]
        if not cands and k <= 96:
            dist3 = torch.linalg.vector_norm(S[:, :, None, :] + P[None, None, :, :] - pc, dim=3)
            idx = (dist3 <= bound).nonzero().tolist()
            cands += [tuple(pool[t] for t in trip) for trip in idx if trip[0] < trip[1] < trip[2]][:8]
        for refs in cands:
            total = sum(self.R.value(j).reshape(-1) for j in refs)
            assert isinstance(total, Tensor)
            num, den, err = _rel(cv, total)
            if self.ok(num, den, n, tol):
                return _Match(tuple(refs), SUM, err, tol)
        return None

    # ----------------------------------------------------------------- the whole alignment
    def run(self) -> None:
        C = self.C.trace
        for c in C.ops:
            if c.layout_of is not None:
                base = self.matches.get(c.layout_of)
                if base is not None:
                    kind = LAYOUT if base.kind == SAME and tuple(c.value.shape) != tuple(C.ops[c.layout_of].value.shape) else base.kind
                    self.matches[c.index] = _Match(base.refs, kind, base.error, base.tol)
                continue
            got = self.direct(c)
            if got is None and all(i in self.matches for i in c.inputs):  # a new computation on agreed values
                got = self.sliced(c) or self.summed(c)
            if got is not None:
                self.matches[c.index] = got
        for c in reversed(C.ops):  # fused where the reference is not: every consumer a matched slice
            if c.index in self.matches:
                continue
            users = C.users.get(c.index, [])
            if users and all(u in self.matches for u in users) and any(
                    C.ops[u].op in _SLICING or self.matches[u].kind == FUSED for u in users):
                refs = tuple(dict.fromkeys(j for u in users for j in self.matches[u].refs))
                err = max(self.matches[u].error for u in users)
                self.matches[c.index] = _Match(refs, FUSED, err, max(self.matches[u].tol for u in users))

    def first_divergent(self) -> int | None:
        C = self.C.trace
        outputs = set(C.outputs)
        reach: set[int] = set()
        for c in reversed(C.ops):
            if c.index in self.matches:
                continue
            if c.index in outputs or any(u in reach for u in C.users.get(c.index, [])):
                reach.add(c.index)
        if not reach:
            return None
        entries = [i for i in sorted(reach) if C.ops[i].leaf_input or any(j in self.matches for j in C.ops[i].inputs)]
        return entries[0] if entries else min(reach)

    def module_map(self, cmod: str) -> str | None:
        """The reference module the candidate module ``cmod`` corresponds to: the deepest reference
        module holding at least 60 % of the matches of the float candidate ops inside ``cmod`` (or, when
        none of them matched, inside its nearest enclosing module that has matches)."""
        C, R = self.C.trace, self.R.trace
        path: str | None = cmod
        while path is not None:
            mods = [R.ops[m.refs[0]].module for i, m in self.matches.items()  # float values: ints match anywhere
                    if C.ops[i].layout_of is None and C.ops[i].value.is_floating_point() and _within(C.ops[i].module, path)]
            if mods:
                prefixes: dict[str, int] = {}
                for mod in mods:
                    parts = mod.split(".") if mod else []
                    for k in range(len(parts) + 1):
                        key = ".".join(parts[:k])
                        prefixes[key] = prefixes.get(key, 0) + 1
                good = [p for p, n in prefixes.items() if n >= 0.6 * len(mods)]
                return max(good, key=lambda p: (p.count(".") + (1 if p else 0), p))
            path = None if not path else (path.rsplit(".", 1)[0] if "." in path else "")
        return None

    def reference_entries(self) -> list[int]:
        """Reference ops, in order, that no candidate op reproduces, whose effect reaches the
        reference's output through ops no candidate op reproduces either, and that read agreed
        values (a matched op, a parameter or an input): where the reference side parts."""
        R = self.R.trace
        used = {j for m in self.matches.values() for j in m.refs}
        matched: list[bool] = []
        for r in R.ops:
            matched.append(r.index in used or (r.layout_of is not None and matched[r.layout_of]))
        outputs = set(R.outputs)
        reach: set[int] = set()
        for r in reversed(R.ops):
            if not matched[r.index] and (r.index in outputs or any(u in reach for u in R.users.get(r.index, []))):
                reach.add(r.index)
        return [i for i in sorted(reach) if R.ops[i].leaf_input or any(matched[j] for j in R.ops[i].inputs)]

    def counterpart(self, ci: int) -> tuple[int | None, float, float]:
        """The reference op where the reference side parts (``reference_entries``), preferring one
        inside the reference module that ``ci``'s module corresponds to (of ``ci``'s size, else a float
        one), then a float one; the error between the two
        (in the best layout, ``nan`` for ops of different sizes) and the floor."""
        C, R = self.C.trace, self.R.trace
        c = C.ops[ci]
        entries = self.reference_entries()
        home = self.module_map(c.module)
        inside = [j for j in entries if home is not None and _within(R.ops[j].module, home)]
        floats = [j for j in entries if R.ops[j].value.is_floating_point()]  # an int position is rarely the culprit
        sized = [j for j in inside if R.ops[j].value.numel() == c.value.numel()]
        pick = next(iter(sized + [j for j in inside if j in floats] + inside + floats + entries), None)
        if pick is None:
            return None, math.nan, self.tol(c, None)
        r = R.ops[pick]
        tol = self.tol(c, r)
        if r.value.numel() != c.value.numel():
            return pick, math.nan, tol
        got = self.compare(self.C.value(ci).reshape(c.value.shape), self.R.value(pick).reshape(r.value.shape), tol, need=False)
        return pick, (got[0] if got is not None else math.nan), tol


def _merge_or_split(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether shape ``b`` comes from shape ``a`` by merging runs of dims or splitting dims (what
    ``view``/``reshape`` do in real code): between consecutive element counts the two prefix
    products share, one side has a single dim."""
    def prefixes(shape: Sequence[int]) -> list[int]:
        out, acc = [], 1
        for d in shape:
            if d != 1:
                acc *= d
                out.append(acc)
        return out

    pa, pb = prefixes(a), prefixes(b)
    common = sorted(set(pa) & set(pb))
    prev = 1
    for cur in common:
        na = sum(1 for v in pa if prev < v <= cur)
        nb = sum(1 for v in pb if prev < v <= cur)
        if min(na, nb) != 1:
            return False
        prev = cur
    return bool(common) and common[-1] == (pa[-1] if pa else 1)


def _within(module: str, path: str) -> bool:
    return not path or module == path or module.startswith(path + ".")


class Alignment:
    """Two implementations matched op by op (see ``fxdebug.numerics.align``).

    Attributes:
        first_divergent: ``None`` when the candidate reproduces the reference within the noise
            floor, else a ``Divergence`` (``.reference``, ``.candidate``: (node, module path);
            ``.error``).
        rows: the matched pairs (``AlignRow``), in the candidate's execution order.
        unmatched: ``(node, module path)`` of candidate ops that match nothing (most are harmless:
            intermediates the reference computes inside a fused op).
        eps: the machine epsilon of the coarser of the two runs' set-up precision.
    """

    def __init__(self, ref: Trace, cand: Trace, matcher: _Matcher, first: Divergence | None) -> None:
        self._ref, self._cand, self._m = ref, cand, matcher
        self.first_divergent = first
        self.eps = matcher.eps
        self.rtol = matcher.rtol
        self.dtypes = (ref.dtype, cand.dtype)
        self.rows: list[AlignRow] = []
        for c in cand.ops:
            m = matcher.matches.get(c.index)
            if m is None or c.layout_of is not None:
                continue
            refs = tuple((ref.ops[j].name, ref.ops[j].module) for j in m.refs)
            self.rows.append(AlignRow((c.name, c.module), refs[0], m.kind, m.error, m.tol, c.op,
                                      tuple(c.value.shape), refs))
        self.unmatched = [(c.name, c.module) for c in cand.ops if c.index not in matcher.matches and c.layout_of is None]

    # ------------------------------------------------------------------ reading
    def table(self, max_rows: int = 200) -> str:
        head = (f"fxdebug align — {len(self.rows)} matched candidate ops, {len(self.unmatched)} unmatched, "
                f"noise floor {FLOOR:g}·eps·√depth (eps {self.eps:.3g}: {self.dtypes[0]} vs {self.dtypes[1]})"
                if self.rtol is None else
                f"fxdebug align — {len(self.rows)} matched candidate ops, {len(self.unmatched)} unmatched, rtol {self.rtol:g}")
        lines = [head, f"first divergent: {self.first_divergent or 'none — the candidate reproduces the reference'}"]
        cols = ("candidate", "module", "reference", "ref module", "match", "error", "floor")
        cells = [[r.candidate[0], r.candidate[1], "+".join(n for n, _ in r.references), r.reference[1], r.match,
                  f"{r.error:.3g}", f"{r.tolerance:.3g}"] for r in self.rows[:max_rows]]
        if self.first_divergent is not None:
            d = self.first_divergent
            cells.append([d.candidate[0], d.candidate[1], str(d.reference[0]), str(d.reference[1]), "DIVERGES",
                          f"{d.error:.3g}", f"{d.tolerance:.3g}"])
        widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
        if len(self.rows) > max_rows:
            lines.insert(-1 if self.first_divergent else len(lines), f"... {len(self.rows) - max_rows} more rows")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        first = None if self.first_divergent is None else self.first_divergent.candidate
        return f"Alignment({len(self.rows)} matched, {len(self.unmatched)} unmatched, first_divergent={first!r})"

    # ------------------------------------------------------------------ drawing
    def graph(self, side: str = "candidate") -> Any:
        """The recorded graph of one side (``"reference"`` or ``"candidate"``) as an aten-level
        ``GraphModule`` (for drawing; its nodes carry the names used in ``rows``)."""
        from fxdebug.numerics.align_draw import trace_graph

        gm = trace_graph(self._side(side))
        object.__setattr__(gm, "fxdebug_align_side", "reference" if self._side(side) is self._ref else "candidate")
        return gm

    def for_graph(self, gm: Any) -> Any:
        """What ``fxdebug.render(gm, path, diff=alignment)`` colours ``gm`` by: for a graph from
        ``graph(side)``, that side's per-op error over floor; for another graph of one of the two
        models (``fxdebug.trace(model)``'s), the worst score of each node's module, and the first
        node of the divergent module highlighted."""
        from fxdebug.numerics.align_draw import SideDiff

        side = getattr(gm, "fxdebug_align_side", None)
        return SideDiff.of(self, side) if side is not None else SideDiff.for_fx(self, gm)

    def side(self, side: str = "candidate") -> Any:
        """What ``fxdebug.render(al.graph(side), path, diff=al.side(side))`` colours by: each
        node's error over its noise floor; unmatched ops on the divergent path count as diverged."""
        from fxdebug.numerics.align_draw import SideDiff

        return SideDiff.of(self, side)

    def render(self, path_prefix: str | os.PathLike[str], ext: str = "svg", **options: Any) -> tuple[str, str]:
        """Draw both recorded graphs, coloured by the alignment: ``<prefix>.reference.svg`` and
        ``<prefix>.candidate.svg`` (the first divergence highlighted on each; ``ext="html"`` writes
        the viewer, opened as a heat map of error over noise floor). ``options`` go to ``render``
        (``depth``, ``fold``). Returns the two paths."""
        from fxdebug.render.draw import render as draw

        prefix = os.fspath(path_prefix)
        out = []
        for side in ("reference", "candidate"):
            out.append(draw(self.graph(side), f"{prefix}.{side}.{ext}", diff=self.side(side), **options))
        return out[0], out[1]

    def _side(self, side: str) -> Trace:
        if side in ("reference", "a", "ref"):
            return self._ref
        if side in ("candidate", "b", "cand"):
            return self._cand
        raise UsageError(f"side={side!r}: 'reference' or 'candidate'.")


def align(reference: nn.Module, candidate: nn.Module, example_inputs: Any, *, candidate_inputs: Any = None,
          rtol: float | None = None, atol: float | None = None) -> Alignment:
    """Run ``reference`` and ``candidate`` once each and find the first op where they part.

    Args:
        reference: the implementation taken as right.
        candidate: the one under suspicion (another port, a rewrite, an inference engine's model).
        example_inputs: a tensor, a tuple (positional), a dict (keywords) or ``fxdebug.Inputs``.
        candidate_inputs: the candidate's inputs when they differ in layout or device (default:
            ``example_inputs``, moved to the candidate's device when it lives elsewhere).
        rtol: relative tolerance replacing the dtype-aware noise floor.
        atol: absolute tolerance per element (default 0).

    Each model runs once, in eval mode, under ``no_grad``, on its own device; training flags,
    buffers and random streams are put back afterwards. See the module docstring for the method.
    """
    for name, m in (("reference", reference), ("candidate", candidate)):
        if not isinstance(m, nn.Module):
            hint = " (it is a class: instantiate it first)" if isinstance(m, type) else ""
            raise ArgumentTypeError(f"align(): {name} must be an nn.Module; got {type(m).__name__}{hint}.")
    if rtol is not None and not rtol >= 0:
        raise UsageError(f"align(rtol={rtol!r}): a relative tolerance >= 0, or None for the dtype-aware floor.")
    if atol is not None and not atol >= 0:
        raise UsageError(f"align(atol={atol!r}): an absolute tolerance >= 0.")
    if candidate_inputs is None:
        candidate_inputs = _to_device(example_inputs, _param_device(candidate))
    ref = _record("reference", reference, example_inputs)
    cand = _record("candidate", candidate, candidate_inputs)
    if not ref.ops or not cand.ops:
        which = "reference" if not ref.ops else "candidate"
        raise UsageError(f"align(): the {which} ran no tensor op on the example inputs; nothing to align.")
    matcher = _Matcher(ref, cand, rtol, atol or 0.0)
    matcher.run()
    first_i = matcher.first_divergent()
    first = None
    if first_i is not None:
        c = cand.ops[first_i]
        j, err, tol = matcher.counterpart(first_i)
        r = ref.ops[j] if j is not None else None
        first = Divergence((r.name, r.module) if r else (None, None), (c.name, c.module), err, tol, c.op)
    return Alignment(ref, cand, matcher, first)


def _record(which: str, model: nn.Module, inputs: Any) -> Trace:
    try:
        return record(model, inputs)
    except Exception as e:
        hint = (" When the candidate takes its inputs in another layout (or on another device), pass them as "
                "candidate_inputs=." if which == "candidate" else "")
        raise UsageError(f"align(): the {which} ({type(model).__name__}) failed on its example inputs: "
                         f"{type(e).__name__}: {e}.{hint}") from e


def _param_device(model: nn.Module) -> torch.device | None:
    for p in itertools.chain(model.parameters(), model.buffers()):
        return p.device
    return None


def _to_device(inputs: Any, device: torch.device | None) -> Any:
    if device is None or device_of(normalize_inputs(inputs)) == device:
        return inputs
    if isinstance(inputs, Inputs):
        return Inputs(*tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, inputs.args),
                      **tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, inputs.kwargs))
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, inputs)
