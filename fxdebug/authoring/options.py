"""``Options``: one rule for the constructor options of every pass.

A pass's options are read once, in its ``__init__``, through ``Options(self)``; every built-in pass
does so, and a user's pass can too. The rule is the same for every option of every pass:

* **flags** are ``True`` or ``False``. The ints ``1`` and ``0`` are read as ``True`` and ``False``
  (configs and command lines spell flags so); anything else is refused — ``"no"``, ``0.5``, ``2``,
  ``None`` — since a truthy string would silently switch an option *on*. The stored value is a
  ``bool``.
* **choices** are one of the values the option names (``mode="record"`` or ``"raise"``).
* **numbers** are ints or floats, never bools (``amount=True`` is not 1.0), never NaN, and lie in
  the option's range; an integer option takes an int only.
* **iterables** are iterables (a list, tuple, set or range) of the kind asked for: a bare scalar is
  refused (``dynamic_dims=0`` means ``(0,)``: say so), and so is a string.
* **functions** are callables; **objects** are instances of the documented type.
* ``None`` is accepted only where the option documents what ``None`` means.

The wrong kind of value (a string for a flag) raises ``ArgumentTypeError`` (a ``UsageError`` and a
``TypeError``); the right kind with a value outside what the option accepts (``history=0``) raises
``UsageError``. Either message names the pass, the option, the value and what is accepted::

    NaNCheck(backward='no'): backward is a flag: True or False (1 or 0); got 'no' (a str).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Sequence

from fxdebug.errors import ArgumentTypeError, UsageError

__all__ = ["Options"]

def _kind(value: Any) -> str:
    name = type(value).__name__
    return "None" if value is None else f"a{'n' if name[:1].lower() in 'aeiou' else ''} {name}"


def _flag(value: Any) -> bool | None:
    """``value`` as a flag, or ``None`` when it is not one (bools, and the ints 0 and 1)."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(int(value))
    return None


def _number(value: Any, integer: bool) -> bool:
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return False
    return isinstance(value, numbers.Integral if integer else numbers.Real)


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


class Options:
    """The validator of one pass's options (see the module docstring for the rule).

    ``Options(self)`` in a pass's ``__init__``; each method checks one option and returns its value
    as the pass should store it (a flag as a ``bool``, an iterable as a tuple)::

        opts = Options(self)
        self.mode = opts.choice("mode", mode, ("record", "raise"), doc="'record' (no host sync) or 'raise'")
        self.backward = opts.flag("backward", backward)
        self.history = opts.number("history", history, low=1, integer=True, none=True)

    Attributes:
        owner: the name the messages give the pass (its class name, as the user wrote it).
        pass_name: the pass's ``name`` (set on the errors as ``pass_name``).
    """

    def __init__(self, owner: Any) -> None:
        if isinstance(owner, str):
            self.owner, self.pass_name = owner, owner
        else:
            self.pass_name = getattr(owner, "name", None) or type(owner).__name__
            # a decorated function's pass is named by its name, not by fxdebug's private wrapper class
            self.owner = type(owner).__name__ if not type(owner).__name__.startswith("_") else self.pass_name

    # -- errors ---------------------------------------------------------------------------------
    def error(self, option: str, value: Any, accepted: str, *, wrong_kind: bool = True, hint: str = "") -> UsageError:
        """The error for ``option=value``: ``ArgumentTypeError`` for the wrong kind of value,
        ``UsageError`` for a value of the right kind outside what ``accepted`` says."""
        cls = ArgumentTypeError if wrong_kind else UsageError
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        message = f"{self.owner}({option}={shown}): {option} is {accepted}; got {shown} ({_kind(value)})."
        if hint:
            message += f" {hint}"
        return cls(message, pass_name=self.pass_name)

    # -- kinds ----------------------------------------------------------------------------------
    def flag(self, option: str, value: Any) -> bool:
        """A flag: ``True`` / ``False`` (``1`` / ``0`` read as such), returned as a ``bool``."""
        read = _flag(value)
        if read is None:
            raise self.error(option, value, "a flag: True or False (1 or 0)")
        return read

    def choice(self, option: str, value: Any, choices: Sequence[Any], *, doc: str = "") -> Any:
        """One of ``choices`` (a bool among them matches as a flag: ``0`` is ``False``); returns the
        choice itself. ``doc`` says what each choice means, for the message."""
        for c in choices:
            if isinstance(c, bool) or c is None:
                if (c is None and value is None) or (c is not None and _flag(value) is c):
                    return c
            elif type(c) is type(value) or (_number(c, False) and _number(value, False)):
                if value == c:
                    return c
        shown = [repr(c) for c in choices]
        named = ", ".join(shown[:-1]) + f" or {shown[-1]}" if len(shown) > 1 else shown[0]
        kinds = tuple({type(c) for c in choices})
        wrong_kind = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
        raise self.error(option, value, doc or f"one of {named}", wrong_kind=wrong_kind)

    def number(self, option: str, value: Any, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False, integer: bool = False, none: bool = False,
               doc: str = "") -> Any:
        """An int or float (an int only with ``integer=True``; never a bool, never NaN) within
        ``[low, high]`` (``low_open`` / ``high_open`` exclude the ends); ``None`` only with ``none=True``."""
        if value is None and none:
            return None
        span = _interval(low, high, low_open, high_open)
        accepted = doc or " ".join(p for p in ("an int" if integer else "a number", span, "or None" if none else "") if p)
        if not _number(value, integer):
            raise self.error(option, value, accepted)
        v = int(value) if integer else float(value)
        if math.isnan(v) or (low is not None and (v < low or (low_open and v == low))) \
                or (high is not None and (v > high or (high_open and v == high))):
            raise self.error(option, value, accepted, wrong_kind=False)
        return v

    def iterable(self, option: str, value: Any, of: type | tuple[type, ...] = int, *, what: str = "ints",
                 example: str = "(0,)", none: bool = False) -> tuple[Any, ...] | None:
        """An iterable (not a string, not a scalar) whose items are all ``of``; returned as a tuple.
        ``what`` names the items and ``example`` shows one in the message."""
        if value is None and none:
            return None
        accepted = f"an iterable of {what}, e.g. {example}" + (" or None" if none else "")
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            hint = f"For one, write ({value!r},)." if isinstance(value, of) and not isinstance(value, bool) else ""
            raise self.error(option, value, accepted, hint=hint)
        items = tuple(value)
        bad = [i for i in items if not isinstance(i, of) or (isinstance(i, bool) and bool not in _tuple(of))]
        if bad:
            raise self.error(option, value, accepted, hint=f"{bad[0]!r} is {_kind(bad[0])}.")
        return items

    def where(self, value: Any, option: str = "where") -> Any:
        """A selection: ``None`` (everything), a glob over node names and module paths, an iterable of
        globs, or a predicate ``f(node) -> bool`` (``fxdebug.outputs_of(...)`` is one)."""
        if value is None or isinstance(value, str) or callable(value):
            return value
        accepted = ("None, a glob over node names / module paths ('layer1.*'), a list of globs, or a predicate "
                    "f(node) -> bool such as fxdebug.outputs_of('layer2')")
        if isinstance(value, bytes) or not isinstance(value, Iterable):
            raise self.error(option, value, accepted)
        items = value if isinstance(value, (list, tuple)) else tuple(value)
        bad = [i for i in items if not isinstance(i, str)]
        if bad:
            raise self.error(option, value, accepted, hint=f"{bad[0]!r} is {_kind(bad[0])}.")
        return items

    def function(self, option: str, value: Any, what: str, *, none: bool = True) -> Callable[..., Any] | None:
        """A callable (``what`` says which, for the message); ``None`` unless ``none=False``."""
        if value is None and none:
            return None
        if not callable(value):
            raise self.error(option, value, what + (" (or None)" if none else ""))
        return value

    def instance(self, option: str, value: Any, types: type | tuple[type, ...], what: str, *,
                 none: bool = False, check: Callable[[Any], bool] | None = None) -> Any:
        """An instance of ``types`` (that ``check`` accepts, when given); ``what`` names what is accepted."""
        if value is None and none:
            return None
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            raise self.error(option, value, what)
        if check is not None and not check(value):
            raise self.error(option, value, what, wrong_kind=False)
        return value


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)
