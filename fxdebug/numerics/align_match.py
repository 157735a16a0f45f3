"""The matcher behind ``fxdebug.align``: which op of the candidate computes the same values as which op of
the reference, up to layout (same, transposed/reshaped, a slice of a fused op, a sum of several, fused),
within a dtype-aware noise floor of ``FLOOR * eps * sqrt(depth)``."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from fxdebug.numerics.align_record import Op, Trace

FLOOR = 4.0  # the noise floor is FLOOR * eps * sqrt(depth)
SAME, LAYOUT, SLICE, SUM, FUSED = "same", "transposed/reshaped", "slice of fused", "sum of several", "fused (slices match)"
_RANK = {SAME: 0, LAYOUT: 1, FUSED: 2, SLICE: 3, SUM: 4}
_SLICING = frozenset({"split", "split_with_sizes", "slice", "select", "unbind", "chunk", "narrow", "unsafe_split"})
_HUGE = 1e30  # beyond this a value is a mask, not a number
_MAX_PERM_DIMS = 4  # 24 orders per side; beyond, only the flat order is tried


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
        (in the best layout; for ops no layout lines up, how far their moments differ) and the floor."""
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
        got = None
        if r.value.numel() == c.value.numel():
            got = self.compare(self.C.value(ci).reshape(c.value.shape), self.R.value(pick).reshape(r.value.shape), tol,
                               need=False)
        return pick, (got[0] if got is not None else self._moment_error(ci, pick)), tol

    def _moment_error(self, ci: int, ri: int) -> float:
        """For two ops no layout lines up (other sizes: RoPE tables of another shape): how far their mean,
        rms and mean |x| differ over the reference's rms — the bound step 1 uses, a number rather than ``nan``."""
        cm, rm = self.C.moments(ci), self.R.moments(ri)
        diff = float((cm[:3] - rm[:3]).abs().max())
        scale = float(rm[1])
        if not math.isfinite(diff):
            return math.inf
        return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


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
