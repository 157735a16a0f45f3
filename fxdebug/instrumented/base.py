"""``Instrumented``: what every capture returns, whichever frontend made it.

An instrumented module is an ``nn.Module`` over the user's model (its own submodules, parameters and
buffers, not copies) whose *parts* are the captured ``torch.fx.GraphModule`` s: a symbolic or export
capture is one part, itself (``InstrumentedGraphModule``, ``module.py``); the subtrees frontend gives one
per captured submodule (``subtree_module.py``); the live (Dynamo) capture one per graph Dynamo handed over
(``live.py``), held beside the model by composition, as ``torch.compile``'s ``OptimizedModule`` holds
``_orig_mod``. What loops over the parts is written here once: ``observers()``, ``reset()``, ``report()``,
``render()``, ``graph`` (the one part's graph, or a typed error naming the parts), and the model's face
(its methods and attributes through ``__getattr__``). A subclass says what its parts are and how it is
called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.fx import Graph

from fxdebug.capture.eager_origin import explain_eager_origin
from fxdebug.capture.trace_info import TraceInfo
from fxdebug.errors import ArgumentTypeError, UsageError
from fxdebug.graph.meta import graph_record
from fxdebug.instrumented.face import model_attribute, model_of
from fxdebug.report.distributed import merged_report
from fxdebug.report.report import Report, merge_reports
from fxdebug.runtime.observer import Observer


__all__ = ["Instrumented"]


class Instrumented(nn.Module):
    """A captured, possibly instrumented model: an ``nn.Module`` with ``parts()``, a report and a picture.

    Build one with ``fxdebug.trace`` or ``fxdebug.instrument``, not directly.
    """

    # ``meta["fxdebug"]``: the capture's ``GraphRecord`` (how it was captured, what the passes did)
    meta: dict[str, Any]
    example_inputs: Any = None  # what instrument() was given, where a capture keeps them (gradcheck, to_module)

    # -- what fxdebug knows -----------------------------------------------------------------------
    @property
    def trace_info(self) -> TraceInfo:
        return graph_record(self).trace or TraceInfo()

    @property
    def pass_results(self) -> list[Any]:
        return graph_record(self).passes

    def parts(self) -> Mapping[str, "Instrumented"]:
        """``{key: captured GraphModule}`` for every captured part, in execution order."""
        raise NotImplementedError(f"{type(self).__name__} must say what its parts are")

    def _one_part(self, what: str) -> "Instrumented":
        """The only captured part; a ``UsageError`` naming ``dbg.parts()`` where there are none or several."""
        parts = self.parts()
        if len(parts) == 1:
            return next(iter(parts.values()))
        model = type(model_of(self) or self).__name__
        if not parts:
            raise UsageError(f"dbg.{what}: nothing of {model} is captured yet: call the module once (or instrument it "
                             "with example_inputs=); then dbg.parts() holds each captured graph.")
        raise UsageError(f"dbg.{what}: {model} was captured as {len(parts)} graphs (a graph break, a recompile for "
                         f"another mode, shape or backend, or one per subtree), not one: pick one of dbg.parts() "
                         f"{list(parts)}, e.g. dbg.parts()[key].graph.print_tabular().")

    @property
    def graph(self) -> Graph:
        """The captured graph when there is exactly one part; otherwise a ``UsageError`` naming ``dbg.parts()``."""
        return self._one_part("graph").graph

    @property
    def code(self) -> str:
        """The one part's generated Python (``GraphModule.code``); a ``UsageError`` naming the parts otherwise."""
        return self._one_part("code").code

    def print_readable(self, *args: Any, **kwargs: Any) -> str:
        """``GraphModule.print_readable`` of the one part; a ``UsageError`` naming the parts otherwise."""
        return self._one_part("print_readable()").print_readable(*args, **kwargs)

    def observers(self) -> dict[str, Observer]:
        """``{observed node name: Observer}`` for every observed node, in graph order.

        Nodes of a part other than the root read ``path/node``.
        """
        out: dict[str, Observer] = {}
        for path, part in self.parts().items():
            prefix = f"{path}/" if path else ""
            out.update({prefix + name: obs for name, obs in part._own_observers().items()})
        return out

    def _summary_notes(self) -> list[str]:
        """Notes about the capture as a whole, beyond its parts' own (none for a single graph)."""
        return []

    def report(self, all_ranks: bool = False, **options: Any) -> Report:
        """What the observe passes saw since the last ``reset()`` (reading it syncs the device).

        ``all_ranks=True`` merges every torch.distributed rank's statistics (call it on every rank;
        options ``group=``, ``timeout=``): see ``fxdebug.distributed``.
        """
        if all_ranks:
            return merged_report(self, **options)
        if options:
            raise ArgumentTypeError(f"report() got unexpected options {sorted(options)} (they go with all_ranks=True)")
        reports = {path: part._part_report() for path, part in self.parts().items()}
        merged = merge_reports(reports, frontend=self.trace_info.frontend, notes=self._summary_notes())
        return explain_eager_origin(self, merged)  # a NaN made between captured parts

    def reset(self) -> None:
        """Forget every statistic collected so far."""
        for part in self.parts().values():
            part._reset_own()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """Notebook display: the annotated graph as an inline static SVG (``fxdebug.instrumented.notebook``)."""
        from fxdebug.instrumented.notebook import module_mimebundle

        return module_mimebundle(self, include, exclude)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the model's own methods and attributes (generate, config)
            return model_attribute(self, name)
