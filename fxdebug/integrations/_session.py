"""What the training-framework callbacks share: instrument the user's model in place of nothing.

A framework (the Hugging Face ``Trainer``, ``lightning.Trainer``) holds the user's model object and
saves it, moves it, wraps it. The callbacks must leave that object what it is: same class, same
id, same ``state_dict`` keys. So instead of replacing it, a ``Session`` routes the model's own
``forward`` through an ``Instrumented`` module built over it (fxdebug shares the model's
parameters, so the instrumented forward trains the model):

* ``attach(model)`` sets an instance attribute ``model.forward`` (the router); nothing else on the
  model changes. ``detach()`` removes it again (or restores an instance ``forward`` that was there).
* The first training-mode call instruments the model on that call's own inputs (keyword inputs
  such as the Trainer's ``num_items_in_batch`` included), so the capture fits the calls it sees.
* Calls in eval mode (the framework's evaluation, sanity checks, ``generate``) run the plain
  model: observing them would capture the other mode's graph again, and the statistics are the
  training steps'.
* While a routed call runs, the router is taken off the model: whatever calls the model again
  from inside — fxdebug capturing a new mode or signature, torch.export, the framework — reaches
  its plain ``forward`` and never the router, so nothing recurses.

``check()`` reads the report (one device-to-host copy) and says whether a NaN/Inf appeared;
``scalars()`` turns it into the flat tracker dict (``Report.scalars``); ``dump()`` writes the
report and a stand-alone repro of the bad call.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Sequence

import fxdebug
from fxdebug import FxDebugError, Report, UsageError
from fxdebug.graph.module_sharing import CALL_HOOKS

__all__ = ["ON_NONFINITE", "Session", "check_options"]

ON_NONFINITE = ("stop", "dump", "warn")


def check_options(where: str, every: Any, top_k: Any, on_nonfinite: Any) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise UsageError(f"{where}(every={every!r}): every is a number of optimizer steps, an int >= 1.")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0):
        raise UsageError(f"{where}(top_k={top_k!r}): top_k caps the per-node keys logged; an int >= 0, or None for all.")
    if on_nonfinite not in ON_NONFINITE:
        raise UsageError(f"{where}(on_nonfinite={on_nonfinite!r}): choose one of {', '.join(map(repr, ON_NONFINITE))}.")


def default_passes() -> list[Any]:
    from fxdebug.passes import NaNCheck, StatCollector

    return [NaNCheck(), StatCollector()]


@contextlib.contextmanager
def _without_root_hooks(dbg: Any, model: Any) -> Iterator[None]:
    """The instrumented module shares the model's root hook dicts (so that a bare ``dbg(x)`` runs
    them), and a live (Dynamo) one calls the model itself; routed from inside ``model.__call__``,
    they have already run: empty them for this call. Emptied in place and refilled (the same dict
    objects: Dynamo's hook guards see one state, an empty one, at every routed call)."""
    hidden = {}
    for name in CALL_HOOKS:
        own = model.__dict__.get(name)
        if own is not None and len(own):
            hidden[name] = OrderedDict(own)
            own.clear()
    try:
        yield
    finally:
        for name, hooks in hidden.items():
            model.__dict__[name].update(hooks)


class Session:
    """One model under observation for one training run (see the module docstring)."""

    def __init__(self, passes: Sequence[Any] | None, *, top_k: int | None, frontend: str | None = None) -> None:
        self.passes = list(passes) if passes is not None else None
        self.top_k = top_k
        self.frontend = frontend
        self.model: Any = None
        self.dbg: Any = None
        self.report: Report | None = None
        self.bad_report: Report | None = None  # the report of the step that first saw NaN/Inf
        self.last_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.calls = 0
        self._saved: Any = None
        self._had_forward = False
        self._router = self._route  # one bound method, so that `is` finds it again

    # -- routing --------------------------------------------------------------------------------
    def attach(self, model: Any) -> None:
        if self.model is model:
            return
        if self.model is not None:
            self.detach()
        self.model = model
        self._had_forward = "forward" in model.__dict__
        self._saved = model.__dict__.get("forward")
        model.__dict__["forward"] = self._router  # instance attribute: nn.Module.__call__ reads self.forward

    def detach(self) -> None:
        model = self.model
        if model is None:
            return
        if model.__dict__.get("forward") is self._router:
            if self._had_forward:
                model.__dict__["forward"] = self._saved
            else:
                del model.__dict__["forward"]
        self.model = None

    def _plain(self) -> None:
        if self._had_forward:
            self.model.__dict__["forward"] = self._saved
        else:
            self.model.__dict__.pop("forward", None)

    def _route(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        self._plain()  # anything calling the model from inside this call sees the plain model
        try:
            if not model.training:
                return model.forward(*args, **kwargs)
            if self.dbg is None:
                with _without_root_hooks(None, model):  # a capture that runs the model: the hooks ran already
                    self.dbg = self._instrument(model, args, kwargs)
            self.last_inputs = (args, kwargs)
            self.calls += 1
            with _without_root_hooks(self.dbg, model):
                return self.dbg(*args, **kwargs)
        finally:
            model.__dict__["forward"] = self._router

    def _instrument(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        passes = self.passes if self.passes is not None else default_passes()
        example = fxdebug.Inputs(*args, **kwargs)
        options = {"frontend": self.frontend} if self.frontend else {}
        return fxdebug.instrument(model, passes, example_inputs=example, **options)

    # -- reading --------------------------------------------------------------------------------
    def read(self) -> Report | None:
        """The report since the last ``reset()`` (``None`` before the first observed call)."""
        if self.dbg is None:
            return None
        self.report = self.dbg.report()
        return self.report

    def reset(self) -> None:
        if self.dbg is not None:
            self.dbg.reset()

    def scalars(self, report: Report) -> dict[str, float]:
        return report.scalars(prefix="fxdebug/", top_k=self.top_k)

    def origin(self, report: Report) -> str:
        """One line naming where the first NaN/Inf came from."""
        if report.first_nonfinite is not None:
            r = report.row(report.first_nonfinite)
            return f"'{report.first_nonfinite}' (module {r.get('module') or '<root>'}, {r.get('op')})"
        if report.first_nonfinite_grad is not None:
            return f"the gradient into '{report.first_nonfinite_grad}'"
        bad = report.nonfinite_nodes
        return f"'{bad[0]}'" if bad else "an unobserved op (the loss or the optimizer)"

    def dump(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write ``fxdebug-report.json`` and, from the bad call's inputs, ``fxdebug-repro.py``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        report = self.bad_report or self.report
        if report is not None:
            path = out / "fxdebug-report.json"
            report.to_json(str(path))
            written.append(path)
        if self.dbg is not None and self.last_inputs is not None:
            args, kwargs = self.last_inputs
            try:
                rep = fxdebug.repro(self.dbg, fxdebug.Inputs(*args, **kwargs), out / "fxdebug-repro.py")
                written.extend([rep.path, rep.tensors])
            except FxDebugError as exc:  # e.g. the NaN does not reproduce from these inputs alone
                warnings.warn(f"fxdebug: the report is in {out}, but no repro script: {exc}", RuntimeWarning, stacklevel=2)
        return written


class SessionCallback:
    """What both framework callbacks answer from their ``Session``: the report and the module."""

    session: Session

    @property
    def report(self) -> Any:
        """The ``fxdebug.Report`` of the step that first saw NaN/Inf once one did; before that, the
        last one read (``None`` before the first read)."""
        return self.session.bad_report or self.session.report

    @property
    def dbg(self) -> Any:
        """The ``Instrumented`` module the model's training calls run through (``None`` before the first)."""
        return self.session.dbg
