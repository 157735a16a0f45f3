"""What a trace reads outside the model's modules, and a forward's reseeding: guards and nodes for them.

A snapshot frontend runs ``forward`` once. Four things it reads or does there are not attributes of a
module (those are guarded by ``faithful._watched_class``), and each made a graph that runs differently
from the model with no error:

* a **config object** held by a module (``self.cfg.scale``, a Hugging Face ``config``): its plain values
  become constants of the graph. ``config_guards`` lists every plain value of every such object (one
  level of nesting below it too), read after the trace; a change captures the graph again.
* **torch's global modes**, read by ``torch.is_grad_enabled()``, ``torch.is_autocast_enabled()`` or
  ``torch.is_inference_mode_enabled()`` (by the model, or by torch's own modules: the fast-path checks
  of ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention``): the graph holds the branch of the
  trace's modes. While a trace runs those functions record what they answered; the answers are
  guards (path ``TORCH``), checked against the modes of each call.
* **a draw from Python's ``random`` or ``np.random``** ran once, at trace time, and its value became a
  constant. A symbolic trace raises ``RandomDraw`` there (the drawing module stays eager, or the root
  is refused); torch.export's draws are listed in ``draws()`` and refused.
* **``torch.manual_seed`` in forward** ran once, at trace time: the graph would draw from wherever the
  stream was. During a symbolic trace it becomes a ``reseed`` node that reseeds at every call; for
  torch.export (which cannot hold a Python call) it is listed in ``seeds()`` and refused.

Reads made by torch's own machinery (export, fake tensors, context managers saving a mode) and by
fxdebug itself are not the model's and are not recorded; those of ``torch.nn`` and checkpointing are.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.fx.node import has_side_effect

from fxdebug.graph.module_state import _MODULE_INTERNALS, _PLAIN

__all__ = ["TORCH", "RandomDraw", "draws", "caller_location", "config_guards", "fast_path_modules", "guard_value", "mode_now", "reads_scope", "reseed", "seeds", "torch_reads", "would_take_fast_path"]

TORCH = "<torch>"  # the guard path of a global mode: (TORCH, "is_grad_enabled", True)
_STATE = threading.local()
_MODES: dict[str, Callable[..., bool]] = {
    "is_grad_enabled": torch.is_grad_enabled,
    "is_autocast_enabled": torch.is_autocast_enabled,
    "is_inference_mode_enabled": torch.is_inference_mode_enabled,
}
_ORIGINAL_SEED = torch.random.manual_seed
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# torch's own code that branches on a mode for the model (a module's fast path, checkpointing); the rest of
# torch reads modes for its own bookkeeping (export, fake tensors, context managers saving a mode)
_MODEL_SIDE = tuple(os.path.join(_TORCH_DIR, p) for p in ("nn" + os.sep, "utils" + os.sep + "checkpoint.py"))
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where torch's modules decide on their fused fast path (TransformerEncoderLayer, MultiheadAttention) by grad mode
_FAST_PATH = tuple(os.path.join(_TORCH_DIR, "nn", "modules", f) for f in ("transformer.py", "activation.py"))


# -- torch's modes ------------------------------------------------------------------------------------
def mode_now(name: str) -> bool:
    """The mode a guard of path ``TORCH`` names, now: ``is_grad_enabled`` or ``is_autocast_enabled:cpu``."""
    fn, _, arg = name.partition(":")
    return bool(_MODES[fn](arg) if arg else _MODES[fn]())


def _recorder(name: str, original: Callable[..., bool]) -> Callable[..., bool]:
    def read(*args: Any) -> bool:
        value = original(*args)
        reads = getattr(_STATE, "reads", None)
        if reads is not None:
            frame = sys._getframe(1)
            filename = frame.f_code.co_filename
            if not filename.startswith(_OURS) and (not filename.startswith(_TORCH_DIR)
                                                   or filename.startswith(_MODEL_SIDE)):
                key = f"{name}:{args[0]}" if args and isinstance(args[0], str) else name
                reads.setdefault(key, bool(value))
                module = frame.f_locals.get("self")
                if filename.startswith(_FAST_PATH) and isinstance(module, nn.Module):  # its fast-path check
                    _STATE.fast.setdefault(id(module), module)
        return value

    read.__name__ = name
    return read


def caller_location() -> str | None:
    """``file.py:41 `code``` of the innermost frame outside torch and fxdebug."""
    import linecache

    torch_dir = os.path.dirname(torch.__file__)
    frame: Any = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((torch_dir, _OURS)) and not filename.startswith("<"):
            code = linecache.getline(filename, frame.f_lineno).strip()
            return f"{os.path.basename(filename)}:{frame.f_lineno} `{code}`"
        frame = frame.f_back
    return None


# -- reseeding ----------------------------------------------------------------------------------------
@has_side_effect
def reseed(seed: Any) -> None:
    """``torch.manual_seed(seed)`` at run time: the node a symbolic trace records for one in forward."""
    _ORIGINAL_SEED(int(seed))


def _manual_seed(seed: Any) -> Any:
    tracer = getattr(_STATE, "tracer", None)
    found = getattr(_STATE, "seeds", None)
    if found is not None:
        found.append(caller_location())
        if tracer is not None:
            tracer.create_proxy("call_function", reseed, (seed,), {}, name="manual_seed")
    if isinstance(seed, torch.fx.Proxy):
        return None
    return _ORIGINAL_SEED(seed)


# -- Python's and numpy's random draws ---------------------------------------------------------------
class RandomDraw(Exception):
    """Forward drew from Python's or numpy's random stream while being traced symbolically (a value the
    graph would keep as a constant): the tracer keeps the drawing module eager, or refuses at the root."""

    def __init__(self, name: str, where: str | None) -> None:
        at = f" at {where}" if where else ""
        super().__init__(f"forward draws {name}(){at}, a random number the graph would freeze at its trace-time "
                         "value (it runs eagerly where the module stays eager)")
        self.name, self.where = name, where


_PY_DRAWS = ("random", "uniform", "randint", "randrange", "choice", "choices", "gauss", "normalvariate",
             "shuffle", "sample", "betavariate", "expovariate", "triangular")
_NP_DRAWS = ("rand", "randn", "random", "random_sample", "uniform", "randint", "choice", "normal", "permutation",
             "shuffle", "binomial", "poisson", "beta", "standard_normal", "integers")


def _draw(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def draw(*args: Any, **kwargs: Any) -> Any:
        found = getattr(_STATE, "draws", None)
        if found is not None:
            filename = sys._getframe(1).f_code.co_filename
            if not filename.startswith((_TORCH_DIR, _OURS)):
                where = caller_location()
                if getattr(_STATE, "tracer", None) is not None:
                    raise RandomDraw(name, where)
                found.append((name, where))
        return original(*args, **kwargs)

    draw.__name__ = getattr(original, "__name__", name)
    return draw


def _draw_targets() -> list[tuple[Any, str, Any]]:
    import random

    found = [(random, n, _draw(f"random.{n}", getattr(random, n))) for n in _PY_DRAWS if hasattr(random, n)]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        found += [(numpy.random, n, _draw(f"np.random.{n}", getattr(numpy.random, n)))
                  for n in _NP_DRAWS if hasattr(numpy.random, n)]
    return found


def draws() -> list[tuple[str, str | None]]:
    """The random draws of Python and numpy forward made in the current scope (torch.export: refused)."""
    return list(getattr(_STATE, "draws", None) or [])


def targets() -> list[tuple[Any, str, Any]]:
    """``(owner, name, replacement)`` patched while a trace runs (see ``faithful.patched_for_tracing``)."""
    found: list[tuple[Any, str, Any]] = [(torch, n, _recorder(n, fn)) for n, fn in _MODES.items()]
    found += [(torch, "manual_seed", _manual_seed), (torch.random, "manual_seed", _manual_seed)]
    return found + _draw_targets()


@contextlib.contextmanager
def reads_scope(tracer: Any) -> Iterator[None]:
    """Record the modes read and the seeds set in this thread; ``tracer`` records ``reseed`` nodes."""
    prev = (getattr(_STATE, "reads", None), getattr(_STATE, "seeds", None), getattr(_STATE, "tracer", None),
            getattr(_STATE, "fast", None), getattr(_STATE, "draws", None))
    _STATE.reads = {} if prev[0] is None else prev[0]
    _STATE.seeds = [] if prev[1] is None else prev[1]
    _STATE.fast = {} if prev[3] is None else prev[3]
    _STATE.draws = [] if prev[4] is None else prev[4]
    _STATE.tracer = tracer
    try:
        yield
    finally:
        if tracer is not None:
            tracer.fxdebug_modes = dict(_STATE.reads)
            tracer.fxdebug_seeds = list(_STATE.seeds)
        _STATE.reads, _STATE.seeds, _STATE.tracer, _STATE.fast, _STATE.draws = prev


def torch_reads() -> dict[str, bool]:
    """The modes read in the current scope: ``{"is_grad_enabled": True}``."""
    return dict(getattr(_STATE, "reads", None) or {})


def fast_path_modules() -> list[nn.Module]:
    """Modules whose fast-path check the trace reached (current scope): a trace never takes the fused path."""
    return list((getattr(_STATE, "fast", None) or {}).values())


def would_take_fast_path(module: nn.Module) -> bool:
    """True if ``module`` (its fast-path check reached the modes while traced) may take its fused fast
    path in a call now: eval mode, fast path on, no autocast, and no gradient wanted for its parameters.
    A captured graph holds the slow path (a trace cannot take the fused kernel) and computes other values."""
    if module.training or not torch.backends.mha.get_fastpath_enabled() or torch.is_autocast_enabled():
        return False
    return not (torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()))


def seeds() -> list[str | None]:
    """Where forward called ``torch.manual_seed`` in the current scope (``file.py:12 `code```)."""
    return list(getattr(_STATE, "seeds", None) or [])


# -- config objects -----------------------------------------------------------------------------------
def _config_like(v: Any) -> bool:
    if isinstance(v, (Tensor, nn.Module, type, *_PLAIN, list, tuple, dict, set, frozenset)) or callable(v):
        return False
    return isinstance(getattr(v, "__dict__", None), dict) and type(v).__module__ not in ("builtins", "torch")


def config_guards(named: list[tuple[str, nn.Module]]) -> list[tuple[str, str, Any]]:
    """``(module path, "cfg.scale", 2.0)`` for every plain value of every config object a module holds.

    One entry per object (the first module path holding it); objects one level inside a config
    (a sub-config) are walked too. Read after the trace: values forward itself set are the stable ones.
    """
    out: list[tuple[str, str, Any]] = []
    seen: set[int] = set()

    def walk(path: str, prefix: str, obj: Any, depth: int) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for k, v in list(vars(obj).items()):
            if type(v) in _PLAIN:
                out.append((path, f"{prefix}.{k}", v))
            elif depth < 1 and _config_like(v):
                walk(path, f"{prefix}.{k}", v, depth + 1)

    common = _COMMON
    for path, m in named:
        for k, v in m.__dict__.items():
            if type(v) in common:  # a module's own dicts, flags and sizes: most entries, skipped at once
                continue
            if k not in _MODULE_INTERNALS and not k.startswith("_fxdebug") and _config_like(v):
                walk(path, k, v, 0)
    return out


_COMMON = frozenset({dict, OrderedDict, set, list, tuple, bool, int, float, str, type(None)})


def guard_value(owner: Any, dotted: str) -> tuple[Any, str]:
    """The object and attribute a dotted guard name reads: ``(cfg, "scale")`` for ``"cfg.scale"``."""
    *chain, last = dotted.split(".")
    for name in chain:
        owner = owner.__dict__[name]
    return owner, last
