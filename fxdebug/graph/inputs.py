"""Example inputs: what users may pass, how they bind to a graph, and running them harmlessly.

Every place that runs a model or graph on example inputs goes through here: ``normalize_inputs``
accepts what users write (a tensor, a tuple, a dict of keywords, or ``Inputs``) and gives
``(args, kwargs)``; ``bind_inputs`` maps that onto a graph's placeholders (export graphs take a
flat pytree); ``clone_inputs`` copies the tensors so a forward that works in place cannot change
the user's inputs; ``preserved_state`` puts buffers and the RNG streams back afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.fx import GraphModule
from torch.fx._pytree import tree_flatten_spec
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxdebug.errors import MissingInputsError
from fxdebug.graph.module_state import ModuleState

__all__ = ["CallInputs", "Inputs", "bind_inputs", "clone_inputs", "normalize_inputs", "preserved_state",
           "untouched_state"]

CallInputs = tuple[tuple[Any, ...], dict[str, Any]]  # normalised example inputs: (args, kwargs)


class Inputs:
    """Example inputs that mix positional and keyword arguments: ``Inputs(x, mask=m)``.

    A tensor, a tuple (positional) or a dict (keyword) covers most models; this covers the rest
    without guessing whether a trailing dict is an argument or the keywords.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        parts = [type(a).__name__ for a in self.args] + [f"{k}=..." for k in self.kwargs]
        return f"Inputs({', '.join(parts)})"


def normalize_inputs(example_inputs: Any) -> CallInputs | None:
    """Accept a tensor, a tuple/list of positional inputs, a dict of keyword inputs, or ``Inputs``."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, Inputs):
        return tuple(example_inputs.args), dict(example_inputs.kwargs)
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def bind_inputs(gm: GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Positional values for ``gm``'s placeholders from ``args`` / ``kwargs`` / defaults."""
    pytree_info = getattr(gm.graph._codegen, "pytree_info", None)
    if pytree_info is not None and pytree_info.in_spec is not None:  # export graphs: flat (args, kwargs)
        return list(tree_flatten_spec((tuple(args), dict(kwargs)), pytree_info.in_spec))
    values: list[Any] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pos = list(args)
    for i, ph in enumerate(placeholders):
        name = str(ph.target).lstrip("*")
        if str(ph.target).startswith("**"):
            values.append(dict(kwargs))
        elif str(ph.target).startswith("*"):
            values.append(tuple(pos[i:]))
        elif name in kwargs:
            values.append(kwargs[name])
        elif i < len(pos):
            values.append(pos[i])
        elif ph.args:
            values.append(ph.args[0])
        else:
            raise MissingInputsError(
                f"example inputs do not provide forward argument '{name}' and it has no default; "
                "pass it positionally or in a dict: example_inputs={'" + name + "': ...}.",
                node=ph.name,
            )
    return values


def clone_inputs(values: Any) -> Any:
    """``values`` with every tensor cloned, as torch's ShapeProp does: a forward that works in
    place (``x.mul_(2)``) must not change the user's example inputs.

    Aliasing is kept: one tensor passed twice (Hugging Face's ``labels=input_ids``) becomes one
    clone passed twice, and tensors that share memory (``x`` and ``x[1:]``) become views of one copy
    of that memory. A capture on the clones then sees the inputs the user's own calls will bring:
    Dynamo guards on which inputs are the same tensor, so separate clones of one tensor would make
    its first real call capture the whole model again. Tensors that require grad keep their
    autograd link (``clone()``; only the same object twice stays one clone there)."""
    flat, spec = tree_flatten(values)
    tensors = [v for v in flat if isinstance(v, Tensor)]
    if not tensors:
        return values
    clones: dict[int, Tensor] = {}  # id of a user tensor -> its clone
    shared = _shared_storages(tensors)
    copies: dict[Any, Any] = {}  # storage key -> a copy of that storage (tensors that share memory)
    for t in tensors:
        if id(t) in clones:
            continue
        key = _storage_key(t) if shared else None
        if key is not None and key in shared:
            storage = copies.get(key)
            if storage is None:
                storage = copies[key] = t.untyped_storage().clone()
            clones[id(t)] = t.new_empty(0).set_(storage, t.storage_offset(), t.size(), t.stride())
        else:
            clones[id(t)] = t.clone()
    return tree_unflatten([clones[id(v)] if isinstance(v, Tensor) else v for v in flat], spec)


def _storage_key(t: Tensor) -> Any:
    """Which memory ``t`` views, for tensors whose views ``clone_inputs`` can rebuild over a copy
    (dense, no autograd history to keep, not a tensor subclass); ``None`` for the rest."""
    if (type(t) is not Tensor or t.requires_grad or t.layout != torch.strided or t.is_meta
            or t.device.type == "meta" or t.is_conj() or t.is_neg()):
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a functional or fake tensor: no storage to share
        return None
    if storage.nbytes() == 0:
        return None
    return (t.device, storage.data_ptr())


def _shared_storages(tensors: list[Tensor]) -> set[Any]:
    """The memory that two or more distinct tensors among ``tensors`` view."""
    seen: dict[Any, int] = {}
    shared: set[Any] = set()
    for t in tensors:
        key = _storage_key(t)
        if key is None:
            continue
        first = seen.setdefault(key, id(t))
        if first != id(t):
            shared.add(key)
    # a copy of the whole memory only where it is not much more than the views themselves (two rows
    # of a large data set tensor are cloned one by one: aliasing lost there, memory kept)
    size = {key: 0 for key in shared}
    for t in {id(t): t for t in tensors}.values():
        key = _storage_key(t)
        if key in size:
            size[key] += t.numel() * t.element_size()
    return {key for key in shared if next(t for t in tensors if _storage_key(t) == key).untyped_storage().nbytes()
            <= 2 * size[key]}


@contextlib.contextmanager
def untouched_state(module: nn.Module) -> Iterator[None]:
    """Run code against ``module`` and leave no trace in its Python state or any random stream.

    Put back afterwards: plain attributes (``self.calls += 1``), the contents of the lists, dicts
    and sets the modules hold (``self.cache.append(x)``), Python's and numpy's global random
    streams, every generator a module holds (``self.gen = torch.Generator()``), and torch's own
    CPU and CUDA streams.
    """
    with _untouched(ModuleState(module)):
        yield


@contextlib.contextmanager
def _untouched(saved: ModuleState) -> Iterator[None]:
    with torch.random.fork_rng(devices=saved.devices, enabled=True):  # the CUDA devices' RNGs too
        try:
            yield
        finally:
            saved.restore_python()


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Run code against ``module`` and put its buffers, Python state and the RNG streams back afterwards."""
    saved = ModuleState(module, buffers=True)  # one walk over the modules saves all of it
    with _untouched(saved):
        try:
            yield
        finally:
            saved.restore_buffers()
