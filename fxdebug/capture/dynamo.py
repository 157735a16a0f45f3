"""Live capture through TorchDynamo: every graph Dynamo hands over, named so that reports merge.

``torch.compile(model, backend=...)`` keeps a captured graph true to live Python: its guards
re-check module types, attributes read, training flags, grad mode, hooks
(``skip_nnmodule_hook_guards=False``) and dynamic dimensions, and capture again when one fails;
parameters and buffers enter each graph as inputs (nothing is folded); what Dynamo cannot
capture becomes a graph break and runs eagerly.

This module is the part of that frontend below ``instrumented/``:

* ``backend`` — the one backend every live module shares (Dynamo keeps one cache per code object
  and tells backends apart by identity, so a backend per module would hit the recompile limit
  after eight modules of one class). It returns a dispatcher: at run time the dispatcher hands the
  graph and its arguments to the *session* now calling (``live(session)``), which instruments
  that graph once for itself and runs it; outside a session the graph runs as captured.
* ``DynamoGraph`` — one graph Dynamo handed over: the frame it came from, the recompile index,
  and why it ended (the graph-break reason Dynamo gave).
* ``NodeNamer`` / ``prepare`` (in ``capture/dynamo_names.py``, re-exported here) — a copy of the graph
  whose nodes carry a stable identity, the same name in every recompile of a frame, so that rows
  of every capture merge into one report.
"""

from __future__ import annotations

import re
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch.fx import GraphModule

from fxdebug.capture.dynamo_names import NodeNamer, Prepared, _source_name, clean_path, prepare, state_name
from fxdebug.capture.dynamo_settings import dynamo_config, quiet_warnings

__all__ = ["DynamoGraph", "NodeNamer", "Prepared", "backend", "clean_path", "dynamo_config", "live", "prepare",
           "quiet_warnings"]


@dataclass(eq=False)
class DynamoGraph:
    """One graph Dynamo handed to the backend.

    ``frame`` identifies the Python frame (a model's ``forward`` or a resume function after a
    graph break); ``recompile`` counts captures of that frame (a failed guard captures again);
    ``reason`` says why the graph ended where it did (a graph break names the construct).
    """

    gm: GraphModule
    frame: int
    recompile: int
    graph_break: bool = False
    reason: str = ""
    where: str = ""  # the user's line where the graph ended
    code: str = ""  # the frame's code (file, function, first line): the same in every recompile of it
    sources: list[str] = field(default_factory=list)  # each placeholder's source (``L['self']._modules['fc1']...``)
    compiler: Any = None  # what compiles the instrumented copy (``capture.dynamo_backends``); None: it runs eagerly

    @property
    def key(self) -> str:
        return f"{self.frame}/{self.recompile}"


class Session(Protocol):
    def run_graph(self, graph: DynamoGraph, args: tuple[Any, ...]) -> Any: ...


_LOCAL = threading.local()


class live:  # noqa: N801 - a context manager, used as a function
    """Graphs run while this is open are handed to ``session`` (a stack: a live module inside another). A class, not
    a generator: entered on every call of a live module (~0.5 µs instead of ~3)."""

    __slots__ = ("session",)

    def __init__(self, session: Session) -> None:
        self.session = session

    def __enter__(self) -> None:
        stack = getattr(_LOCAL, "stack", None)
        if stack is None:
            stack = _LOCAL.stack = []
        stack.append(self.session)

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.stack.pop()


def _ending(gm: GraphModule) -> tuple[bool, str, str]:
    why = getattr(gm, "compile_subgraph_reason", None)
    if why is None:
        return False, "", ""
    stack = list(getattr(why, "user_stack", None) or [])
    where = ""
    if stack:
        frame = stack[-1]
        function = re.sub(r"^torch_dynamo_resume_in_(.+?)_at_\d+$", r"\1", str(frame.name or ""))  # (its resume functions)
        where = (f"{str(frame.filename).rsplit('/', 1)[-1]}:{frame.lineno}" + (f" in {function}" if function else "")
                 + (f" `{frame.line.strip()}`" if frame.line else ""))
    reason = " ".join(str(why.reason or "").split())
    return bool(why.graph_break), reason, where


def backend(gm: GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The fxdebug Dynamo backend: a dispatcher to the session that runs the graph."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    graph_break, reason, where = _ending(gm)
    graph = DynamoGraph(gm, getattr(compile_id, "frame_id", -1) or 0, getattr(compile_id, "frame_compile_id", 0) or 0,
                        graph_break, reason, where, code=_code_key())
    graph.sources = [_source_name(n) for n in gm.graph.nodes if n.op == "placeholder"]  # Dynamo drops them later
    plain = gm.forward

    def run(*args: Any) -> Any:
        stack = getattr(_LOCAL, "stack", None)
        if not stack:
            return plain(*args)  # called outside any live module (another thread's call)
        return stack[-1].run_graph(graph, args)

    run.fxdebug_graph = graph  # type: ignore[attr-defined]
    return run


def _code_key() -> str:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
        key = f"{code.co_filename}:{code.co_name}:{code.co_firstlineno}"
        if code.co_name.startswith("torch_dynamo_resume_in_"):  # two resume functions after graph breaks on one
            key += f":{zlib.crc32(code.co_code):08x}"  # line share name and line; their bytecode tells them apart
        return key
    except Exception:  # another torch: fall back on Dynamo's frame counter
        return ""
