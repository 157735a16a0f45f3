"""The walk that makes a block's copy: the template's objects rebuilt with the copy's identities (``live_copies``).

``Renamer.planned(x)`` maps one of the template's values to the copy's: a string by the identity table (a name the
passes derived from a node's, ``obs_<node>``, renamed by the node's; prose never), the template instance's modules,
parameters and nodes to the copy's (seeded by position before the walk), fxdebug's observers and clock fresh, the
objects of fxdebug and of the passes (probes, ShapeAssert's guard) copied field by field, and immutable values that
hold none of the template's identities shared as they are. How each type is treated is decided once per type.

Every copy of one template walks the same objects in the same order, and what a value becomes depends only on the
template: which of its strings are identities, which of its objects are seeded. So the first copy records, for each
container it rebuilds, a *recipe*: the slots whose value changes from copy to copy (a name, a seeded object, a
rebuilt child) with how, the rest being the template's own values, kept. A later copy copies such a container in one
step and fixes only those slots (``Renamer.planned``). A recipe holds the template's values it was made from and is
used only while the container still holds exactly those (compared by identity): a container the template changed
since is walked afresh.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn
from torch.fx import Node
from torch.fx.immutable_collections import immutable_dict, immutable_list

from fxdebug.authoring.pipeline import Pass
from fxdebug.runtime.observer import Clock, FusedProbe, Observer, Probe

__all__ = ["Renamer"]

_SPACE = re.compile(r"\s")
_ATOM, _SHARED, _SEQUENCE, _MAPPING, _FIELDS, _CLOCK, _OBSERVER, _OBJECT, _FROZEN = range(9)
_HOW: dict[type, int] = {k: _ATOM for k in (int, float, bool, type(None), bytes, complex, torch.dtype, torch.device,
                                             torch.Size, torch.memory_format, torch.layout, range, slice)}
_HOW.update({list: _SEQUENCE, tuple: _FROZEN, set: _SEQUENCE, frozenset: _FROZEN, immutable_list: _SEQUENCE,
             dict: _MAPPING, immutable_dict: _MAPPING, Node: _SHARED})
_HOWS: dict[tuple[str, ...], dict[type, int]] = {}  # per set of copied modules: type -> how
_UNCOUNTED = ("states", "_devices", "_calls")  # an observer's statistics: a copy starts without them

# what a slot of a recipe does with the template's value there (else a nested ``_Recipe``)
_KEEP, _NAME, _TEXT, _MEMO, _WALK = "keep", "name", "text", "memo", "walk"


@dataclasses.dataclass(eq=False)
class _Recipe:
    """How one container of the template becomes the copy's: ``fixes`` are ``(slot, what)`` for the slots that
    change (a key's position for a mapping's keys), the others keep the template's value."""

    shape: str  # "list", "map", "tuple", "fields", "immutable", "object", "observer"
    kind: type
    values: tuple[Any, ...]  # the template's values it was made from (held: their ids stay theirs)
    ids: tuple[int, ...]
    fixes: list[tuple[Any, Any]]
    key_fixes: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    keys: tuple[Any, ...] = ()


class Renamer:
    """The template's world mapped to the copy's (see the module docstring)."""

    def __init__(self, names: dict[str, str], template: Any, modules: tuple[str, ...]) -> None:
        self.names = names
        self.pattern = template.pattern
        self.inert = template.inert  # strings of the template that hold none of its identities (no copy renames them)
        self.same = template.same  # immutable objects of the template that hold none either: shared as they are
        self.plans = template.plans  # id of a top-level value -> (the value, what to do with it)
        self.modules = modules  # class modules whose objects are copied (fxdebug's and the passes')
        how = _HOWS.get(modules)
        if how is None:
            how = _HOWS[modules] = dict(_HOW)
        self.how: dict[type, int] = how
        self.memo: dict[int, Any] = {}
        self.originals = template.originals  # the template's names of its instance's own nodes
        self.keep: list[Any] = []  # what the memo's ids belong to, alive while it is used

    def seed(self, old: Any, new: Any) -> None:
        self.memo[id(old)] = new
        self.keep.append(old)

    def text(self, s: str) -> str:
        hit = self.names.get(s)
        if hit is not None:
            return hit
        if s in self.inert:
            return s
        if self.pattern is None or _SPACE.search(s) is not None:  # prose is never rewritten
            self.inert.add(s)
            return s
        out = self.pattern.sub(lambda m: self.names[m.group(0)], s)
        if out == s:
            self.inert.add(s)
            return s
        return out

    # -- the recorded walk: what a top-level value of the template becomes, by its recipe once there is one --

    def planned(self, x: Any) -> Any:
        """The copy's value for a top-level value of the template (a node's metadata, an observer): by the recipe the
        first copy recorded, else walked (and recorded)."""
        hit = self.memo.get(id(x))
        if hit is not None:
            return hit  # made earlier in this copy (a probe two observers hold)
        plan = self.plans.get(id(x))
        if plan is not None and plan[0] is x:
            return self._apply(x, plan[1])
        out, what = self._record(x)
        self.plans[id(x)] = (x, what)
        return out

    def _apply(self, x: Any, what: Any) -> Any:
        if what is _KEEP:
            return x
        if what is _NAME:
            return self.names[x]
        if what is _MEMO:
            return self.memo[id(x)]
        if what is _TEXT:
            return self.text(x)
        if what is _WALK:
            return self._record(x)[0]
        return self._build(x, what)

    def _build(self, x: Any, r: _Recipe) -> Any:
        shape, kind = r.shape, r.kind
        if shape == "list" or shape == "tuple" or shape == "fields":
            if tuple(map(id, x)) != r.ids:
                return self._again(x, r)  # changed since the recipe: walked afresh
            items = list(x)
            for i, what in r.fixes:
                items[i] = self._apply(items[i], what)
            if shape == "fields":
                return kind(*items)
            return items if kind is list else kind(items)
        if shape == "map":
            if tuple(map(id, x.values())) != r.ids or tuple(x) != r.keys:
                return self._again(x, r)
            if r.key_fixes:
                keys, vals = list(x), list(x.values())
                for i, what in r.key_fixes:
                    keys[i] = self._apply(keys[i], what)
                for i, what in r.fixes:
                    vals[i] = self._apply(vals[i], what)
                return kind(zip(keys, vals))
            out = dict(x)
            for k, what in r.fixes:
                out[k] = self._apply(out[k], what)
            return out if kind is dict else kind(out)
        state = x.__dict__
        if shape == "observer":
            state = {k: v for k, v in state.items() if k not in _UNCOUNTED}
        if tuple(map(id, state.values())) != r.ids or tuple(state) != r.keys:
            return self._again(x, r)
        new: Any = object.__new__(kind)
        if shape != "immutable":
            self.seed(x, new)  # before its fields: they may lead back to it
        fields = dict(state)
        for k, what in r.fixes:
            fields[k] = self._apply(fields[k], what)
        new.__dict__.update(fields)
        return new

    def _again(self, x: Any, r: _Recipe) -> Any:
        """A container the template changed since ``r`` was made: walked afresh, and ``r`` made anew from it (the
        next copies use the new one)."""
        out, what = self._record(x)
        if isinstance(what, _Recipe):
            r.__dict__.update(what.__dict__)
        return out

    def _record(self, x: Any) -> tuple[Any, Any]:
        """``(the copy's value for x, what a later copy does with x)``: the walk itself, which records as it goes."""
        kind = type(x)
        if kind is str:
            if x in self.names:
                return self.names[x], _NAME
            out = self.text(x)
            return (x, _KEEP) if out is x else (out, _TEXT)
        how = self._how(kind)
        if how is _ATOM:
            return x, _KEEP
        hit = self.memo.get(id(x))
        if hit is not None:
            return hit, _MEMO
        if how is _SHARED:
            return x, _KEEP
        if how is _FROZEN and id(x) in self.same:
            return x, _KEEP
        if (how is _SEQUENCE and kind is not set) or (how is _FROZEN and kind is tuple) or how is _FIELDS:
            pairs = [self._record(v) for v in x]
            items = [p[0] for p in pairs]
            if how is _FROZEN and all(a is b for a, b in zip(items, x)):
                self.same[id(x)] = x
                return x, _KEEP
            shape = "list" if how is _SEQUENCE else "tuple" if how is _FROZEN else "fields"
            recipe = _Recipe(shape, kind, tuple(x), tuple(map(id, x)), _fixes(enumerate(p[1] for p in pairs)))
            made: Any = kind(*items) if how is _FIELDS else items if kind is list else kind(items)
            return made, recipe
        if how is _MAPPING:
            keys = [self._record(k) for k in x]
            vals = [self._record(v) for v in x.values()]
            key_fixes = _fixes(enumerate(k[1] for k in keys))
            fixes = _fixes(enumerate(v[1] for v in vals)) if key_fixes else _fixes(zip(x, (v[1] for v in vals)))
            recipe = _Recipe("map", kind, tuple(x.values()), tuple(map(id, x.values())), fixes, key_fixes, tuple(x))
            return kind(zip((k[0] for k in keys), (v[0] for v in vals))), recipe
        if how is _OBJECT or how is _OBSERVER or (how is _FROZEN and kind is not frozenset):
            state = x.__dict__
            if how is _OBSERVER:
                state = {k: v for k, v in state.items() if k not in _UNCOUNTED}
            new = object.__new__(kind)
            if how is not _FROZEN:
                self.seed(x, new)  # before its fields: they may lead back to it
            fields = {k: self._record(v) for k, v in state.items()}
            if how is _FROZEN and all(fields[k][0] is v for k, v in state.items()):
                self.same[id(x)] = x
                return x, _KEEP
            new.__dict__.update({k: p[0] for k, p in fields.items()})
            shape = "observer" if how is _OBSERVER else "immutable" if how is _FROZEN else "object"
            recipe = _Recipe(shape, kind, tuple(state.values()), tuple(map(id, state.values())),
                             _fixes((k, p[1]) for k, p in fields.items()), keys=tuple(state))
            return new, recipe
        if how is _CLOCK:  # the same rows, a table of its own (made at its first call, on its input's device)
            clock = kind()
            clock.training, clock.rows, clock.spans = x.training, x.rows, list(x.spans)
            self.seed(x, clock)
            return clock, _WALK
        items = [self._record(v)[0] for v in x]  # a set or a frozenset: no order to fix slots by, walked by every copy
        if how is _FROZEN and all(a is b for a, b in zip(items, x)):
            self.same[id(x)] = x
            return x, _KEEP
        return kind(items), _WALK

    def _how(self, kind: type) -> int:
        how = self.how.get(kind)
        if how is None:
            how = self.how[kind] = _how(kind, self.modules)
        return how


def _fixes(slots: Any) -> list[tuple[Any, Any]]:
    return [(slot, what) for slot, what in slots if what is not _KEEP]


def _how(kind: type, modules: tuple[str, ...]) -> int:
    """How ``Renamer`` treats a value of this type (decided once per type; by class, not by pass)."""
    if issubclass(kind, torch.Tensor):
        return _SHARED  # a tensor: the instance's own parameters are paired by identity (memo) before this
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):
        return _FIELDS
    if issubclass(kind, Clock):
        return _CLOCK
    if issubclass(kind, Observer):
        return _OBSERVER
    if issubclass(kind, (nn.Module, Pass, type)):
        return _SHARED
    if dataclasses.is_dataclass(kind) and getattr(kind, "__dataclass_params__").frozen and not _slotted(kind):
        return _FROZEN  # a frozen value (a TensorSpec, a Column, a PassResult)
    if issubclass(kind, FusedProbe) and not _slotted(kind):
        return _FROZEN  # its numbers come from the fused table, never from an update of its own: shared when unchanged
    if issubclass(kind, Probe):
        return _OBJECT
    callable_ = any("__call__" in c.__dict__ for c in kind.__mro__[:-1])
    if kind.__module__.startswith(modules) and not callable_ and not _slotted(kind):
        return _OBJECT  # fxdebug's or a pass's own helper (ShapeAssert's guard): copied with the probes holding it
    return _SHARED


def _slotted(kind: type) -> bool:
    """Whether instances have no ``__dict__`` (slots only): such values are not copied field by field."""
    return not getattr(kind, "__dictoffset__", 0)
