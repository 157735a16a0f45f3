"""``fxdebug.outputs_of("layer2")``: a ``where=`` that means a module's *output*, not every op in it.

A plain ``where="layer2"`` selects every node inside ``layer2`` (its convs, batch-norms, adds);
that is what an observer wants, but not what a pass that *changes* a value wants: a gradient
reversal applied at every op inside a block flips the sign once per op. ``outputs_of`` selects
the node(s) whose value leaves the module — the ones a forward hook on the module would see.

Patterns are matched per path segment: ``*`` stays inside one segment (``"layer*"`` is
``layer1`` and ``layer2``, not ``layer1.0.conv1``), ``**`` spans any number of segments
(``"**.attn"`` is every ``attn`` at any depth). A module called twice has two outputs; both
are selected. The result is a predicate over nodes, so every pass that takes ``where=`` accepts it.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterable

from torch.fx import Node

from fxdebug.graph.meta import is_instrumentation, module_path

__all__ = ["ModuleOutputs", "outputs_of", "path_matches"]


@lru_cache(maxsize=256)
def _compile(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def path_matches(pattern: str, path: str) -> bool:
    """True if module path ``path`` matches ``pattern`` segment-wise (see the module docstring)."""
    return bool(_compile(pattern).match(path))


def _ancestors(path: str) -> list[str]:
    """``"a.b.c"`` → ``["a", "a.b", "a.b.c"]`` (the root ``""`` is never a candidate)."""
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


class ModuleOutputs:
    """The ``where=`` predicate ``outputs_of`` returns: true for nodes whose value leaves a matching module.

    ``patterns`` keeps the globs, so passes that act on modules rather than nodes (``Freeze``) can
    read them; ``modules(node)`` names the matching module(s) the node is an output of.
    """

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(patterns)
        if not self.patterns or not all(isinstance(p, str) and p for p in self.patterns):
            from fxdebug.errors import UsageError

            raise UsageError(f"outputs_of() needs one or more module path globs (e.g. 'layer2', 'layer*'); got {self.patterns!r}.")

    def modules(self, node: Node) -> list[str]:
        """The matching modules that ``node`` is an output of (empty if none)."""
        if is_instrumentation(node) or node.op in ("placeholder", "output", "get_attr"):
            return []
        path = module_path(node)
        found = []
        for module in _ancestors(path):
            if not any(path_matches(p, module) for p in self.patterns):
                continue
            if _leaves(node, module):
                found.append(module)
        return found

    def __call__(self, node: Node) -> bool:
        return bool(self.modules(node))

    def covers(self, path: str) -> bool:
        """Whether module ``path`` is, or lies inside, a matching module (for passes acting on modules)."""
        return any(path_matches(p, m) for p in self.patterns for m in _ancestors(path))

    def __repr__(self) -> str:
        return f"outputs_of({', '.join(repr(p) for p in self.patterns)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModuleOutputs) and other.patterns == self.patterns

    def __hash__(self) -> int:
        return hash(self.patterns)


def _leaves(node: Node, module: str) -> bool:
    """True if some (non-instrumentation) user of ``node`` lies outside ``module``, or is the graph output."""
    for user in node.users:
        if is_instrumentation(user):
            continue
        if user.op == "output" or not _inside(module_path(user), module):
            return True
    return False


def outputs_of(*patterns: str) -> ModuleOutputs:
    """A ``where=`` selecting the output node(s) of the modules matching ``patterns``.

    ``outputs_of("layer2")`` is the value a forward hook on ``layer2`` sees; ``outputs_of("layer*")``
    the outputs of ``layer1`` and ``layer2``; ``outputs_of("blocks.*.attn")`` each block's attention.
    Accepted by every pass's ``where=``.
    """
    if len(patterns) == 1 and isinstance(patterns[0], (list, tuple)):
        patterns = tuple(patterns[0])
    return ModuleOutputs(patterns)
