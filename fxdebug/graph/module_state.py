"""Plain Python state of a model's modules: read it, and put it back after example runs.

A forward may advance Python counters or flip flags (``self.calls += 1``); capturing runs the
forward, so the capture saves these values first and restores them after, leaving the model as
it found it.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
from torch import nn

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_CONTAINERS = (list, dict, set)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"training"}


def user_attributes(module: nn.Module) -> dict[str, Any]:
    """The attributes a forward may rebind (``self.calls``, ``self.config``): not torch's internals."""
    return {k: v for k, v in module.__dict__.items()
            if k not in _MODULE_INTERNALS and not k.startswith("_fxdebug") and not isinstance(v, nn.Module)}


def saved_plain_state(root: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Plain values (numbers, strings, None) of every module's own attributes, to put back later."""
    return [(m, {k: v for k, v in user_attributes(m).items() if isinstance(v, _PLAIN)}) for m in root.modules()]


def restore_plain_state(saved: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Undo what example runs did to Python counters and flags (``self.calls += 1``)."""
    for module, values in saved:
        for k, v in values.items():
            if module.__dict__.get(k, v) is not v or k not in module.__dict__:
                module.__dict__[k] = v




def saved_containers(root: nn.Module) -> list[tuple[Any, Any]]:
    """Shallow copies of the lists, dicts and sets the modules hold (``self.cache.append(x)``)."""
    out: list[tuple[Any, Any]] = []
    for m in root.modules():
        for v in user_attributes(m).values():
            if isinstance(v, _CONTAINERS):
                out.append((v, v.copy()))
    return out


def restore_containers(saved: list[tuple[Any, Any]]) -> None:
    """Put every saved container's contents back, in place (the same list/dict/set object)."""
    for live, copy in saved:
        if isinstance(live, list):
            if len(live) != len(copy) or any(a is not b for a, b in zip(live, copy)):
                live[:] = copy
        elif isinstance(live, dict):
            if live.keys() != copy.keys() or any(live[k] is not v for k, v in copy.items()):
                live.clear()
                live.update(copy)
        elif live != copy:
            live.clear()
            live.update(copy)


def _generator_kinds() -> tuple[type, ...]:
    numpy = sys.modules.get("numpy")
    kinds: tuple[type, ...] = (torch.Generator, random.Random)
    if numpy is not None:
        kinds = (*kinds, numpy.random.Generator, numpy.random.RandomState)
    return kinds


def _generators(root: nn.Module) -> list[Any]:
    """Random generators the modules hold (``torch.Generator``, ``random.Random``, numpy's)."""
    kinds = _generator_kinds()
    seen: dict[int, Any] = {}
    for m in root.modules():
        for v in user_attributes(m).values():
            if isinstance(v, kinds):
                seen.setdefault(id(v), v)
    return list(seen.values())


def saved_random_state(root: nn.Module | None = None, *, generators: list[Any] | None = None) -> list[tuple[Any, Any]]:
    """Python's and numpy's global random streams and every generator ``root`` holds.

    torch's own global streams are forked by ``torch.random.fork_rng``; this covers the rest, so an
    example run that draws ``random.random()`` or ``np.random.rand()`` leaves no trace. ``generators``:
    the ones ``root`` holds, found already (``saved_module_state``), instead of walking ``root`` again.
    """
    saved: list[tuple[Any, Any]] = [(random, random.getstate())]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        saved.append((numpy.random, numpy.random.get_state()))
    if generators is None:
        generators = _generators(root) if root is not None else []
    for g in generators:
        if isinstance(g, torch.Generator):
            if g.device.type != "meta":
                saved.append((g, g.get_state()))
        elif isinstance(g, random.Random):
            saved.append((g, g.getstate()))
        elif numpy is not None and isinstance(g, numpy.random.Generator):
            saved.append((g, g.bit_generator.state))
        else:
            saved.append((g, g.get_state()))
    return saved


class ModuleState:
    """What one walk over a model's modules saves before example runs (``graph.inputs.untouched_state``):
    the plain attributes, the containers, the generators' and global streams' states, the CUDA devices
    its tensors live on, and (``buffers=True``) each module's buffer slots and a copy of every buffer.

    The same values ``saved_plain_state``, ``saved_containers`` and ``saved_random_state`` give, read in
    one pass, each module's own attributes sorted once (on a 100k-module model each walk costs ~0.1 s)."""

    __slots__ = ("plain", "containers", "streams", "devices", "slots", "buffers")

    def __init__(self, root: nn.Module, *, buffers: bool = False) -> None:
        kinds = _generator_kinds()
        internals = _MODULE_INTERNALS
        module_type = nn.Module
        plain: list[tuple[nn.Module, dict[str, Any]]] = []
        containers: list[tuple[Any, Any]] = []
        generators: dict[int, Any] = {}
        devices: set[int] = set()
        slots: list[tuple[nn.Module, dict[str, Any]]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen_buffers: set[int] = set()
        for m in root.modules():
            values: dict[str, Any] = {}
            for k, v in m.__dict__.items():
                if k in internals or k.startswith("_fxdebug") or isinstance(v, module_type):
                    continue  # user_attributes(m), inline
                if isinstance(v, _PLAIN):
                    values[k] = v
                    continue
                if isinstance(v, _CONTAINERS):
                    containers.append((v, v.copy()))
                if isinstance(v, kinds):
                    generators.setdefault(id(v), v)
            plain.append((m, values))
            # is_cuda / is_meta: Tensor.device builds a device object per read (~1.5 µs, two per layer)
            for param in m._parameters.values():
                if param is not None and param.is_cuda:
                    devices.add(param.device.index or 0)
            own = m._buffers
            for t in own.values():
                if t is None:
                    continue
                if t.is_cuda:
                    devices.add(t.device.index or 0)
                if buffers and not t.is_meta and id(t) not in seen_buffers:
                    seen_buffers.add(id(t))
                    copies.append((t, t.detach().clone()))
            if buffers:
                slots.append((m, dict(own)))  # a forward may rebind one (self.avg = ...)
        self.plain, self.containers = plain, containers
        self.streams = saved_random_state(generators=list(generators.values()))
        self.devices = sorted(devices)
        self.slots, self.buffers = slots, copies

    def restore_python(self) -> None:
        """Plain attributes, containers and random streams as they were."""
        restore_plain_state(self.plain)
        restore_containers(self.containers)
        restore_random_state(self.streams)

    def restore_buffers(self) -> None:
        """Buffer slots rebound by a forward put back, then every buffer's values (``buffers=True``)."""
        for m, bufs in self.slots:
            if any(m._buffers.get(k) is not v for k, v in bufs.items()):
                m._buffers.update(bufs)
        with torch.no_grad():
            for buf, copy in self.buffers:
                if buf.shape != copy.shape:  # resized in forward (a QAT observer's min_val starts empty)
                    buf.resize_(copy.shape)
                buf.copy_(copy)


def restore_random_state(saved: list[tuple[Any, Any]]) -> None:
    numpy = sys.modules.get("numpy")
    for owner, state in saved:
        if owner is random or isinstance(owner, random.Random):
            owner.setstate(state)
        elif isinstance(owner, torch.Generator):
            owner.set_state(state)
        elif numpy is not None and isinstance(owner, numpy.random.Generator):
            owner.bit_generator.state = state
        else:  # numpy.random (the module) or a RandomState
            owner.set_state(state)


def refuse_uninitialized(root: nn.Module, frontend: str, named: list[tuple[str, nn.Module]] | None = None) -> None:
    """Lazy modules (``nn.LazyLinear``) not yet run: a capture on example inputs would materialize them
    on the user's model. Raise a ``TraceError`` naming the module instead. ``named``: ``root.named_modules()``
    where the caller walked them already."""
    from torch.nn.parameter import is_lazy

    from fxdebug.errors import TraceError

    for path, m in (named if named is not None else root.named_modules()):
        if (m._parameters and any(is_lazy(t) for t in m._parameters.values() if t is not None)) or \
                (m._buffers and any(is_lazy(t) for t in m._buffers.values() if t is not None)):
            raise TraceError(
                f"module '{path or '<root>'}' ({type(m).__name__}) is a lazy module that has not run yet: its "
                f"parameters have no shape. Capturing with frontend='{frontend}' runs the example inputs, which "
                "would materialize it on your model (fxdebug never changes the model). Run the model once "
                "first (model(*example_inputs)), then instrument it.", module=path, op=type(m).__name__)


def refuse_namespace_clash(root: nn.Module, frontend: str, namespace: str = "fxdebug") -> None:
    """A child or attribute of the root named like fxdebug's own namespace: the graph would put fxdebug's
    modules (observers, the clock) into the user's module. Raise a ``TraceError`` naming it instead."""
    from fxdebug.errors import TraceError

    if namespace in root._modules or namespace in root.__dict__ or namespace in root._parameters \
            or namespace in root._buffers:
        value = root._modules.get(namespace, root.__dict__.get(namespace))
        raise TraceError(
            f"{type(root).__name__} has its own attribute '{namespace}' ({type(value).__name__}); frontend='{frontend}' "
            f"keeps fxdebug's modules (observers, the clock) under that name on the captured graph, which would "
            f"write them into your module. Use frontend='subtrees' (the root stays eager) or frontend='auto', or "
            f"rename the attribute.", module=namespace, op=type(value).__name__)
