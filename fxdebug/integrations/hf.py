"""``FxDebugTrainerCallback``: fxdebug inside the Hugging Face ``Trainer``.

::

    from fxdebug.integrations.hf import FxDebugTrainerCallback

    cb = FxDebugTrainerCallback(every=10, top_k=20, on_nonfinite="stop")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train()
    cb.report            # the last fxdebug.Report read; cb.nonfinite_step: where NaN/Inf first showed

* ``trainer.model`` stays the user's model (same object and class, same ``save_model`` keys): at
  ``on_train_begin`` the model's ``forward`` is routed through an instrumented module built over
  it on the first training call (``fxdebug.integrations._session``), and restored at
  ``on_train_end``. Evaluation calls run the plain model.
* Every ``every`` optimizer steps the report goes through the Trainer's own ``log()`` (its control
  flags put back afterwards: the Trainer's own loss entry of that step is logged as without the
  callback, beside ours at the same step): the keys
  ``fxdebug/...`` (``Report.scalars``: a few summaries plus at most ``top_k`` per-node values)
  land in ``trainer.state.log_history`` and reach every tracker in ``report_to`` (a tracker's
  ``on_log`` sees them like the loss). Statistics are reset after each log, so each logged value
  covers the steps since the previous one.
* Each step, before the optimizer steps, the report is read (one device-to-host copy) for
  NaN/Inf. On the first one: ``"stop"`` ends training at that step
  (``control.should_training_stop``), ``"dump"`` also writes ``fxdebug-report.json`` and
  ``fxdebug-repro.py`` (a stand-alone script reproducing the bad op) to ``dump_dir``
  (default ``<output_dir>/fxdebug``) and goes on, ``"warn"`` only warns and logs. In every mode
  the step's report is logged, with the non-finite nodes first, and a warning names the origin.

``passes=None`` observes with ``NaNCheck()`` and ``StatCollector()``. ``frontend=`` picks the
capture frontend (default: fxdebug's ``"auto"``).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from fxdebug.integrations._session import Session, SessionCallback, check_options

try:
    from transformers import TrainerCallback
except ImportError as _exc:  # the extra is not installed: say which
    raise ImportError("fxdebug.integrations.hf needs Hugging Face transformers (and accelerate for its Trainer): "
                      "pip install 'fxdebug[hf]'.") from _exc

__all__ = ["FxDebugTrainerCallback"]


class FxDebugTrainerCallback(SessionCallback, TrainerCallback):
    """A ``transformers.TrainerCallback`` that instruments, logs capped per-node metrics and stops on NaN."""

    def __init__(self, passes: Sequence[Any] | None = None, *, every: int = 1, top_k: int | None = 20,
                 on_nonfinite: str = "stop", dump_dir: str | os.PathLike[str] | None = None,
                 frontend: str | None = None) -> None:
        check_options("FxDebugTrainerCallback", every, top_k, on_nonfinite)
        self.every, self.top_k, self.on_nonfinite = every, top_k, on_nonfinite
        self.dump_dir = dump_dir
        self.session = Session(passes, top_k=top_k, frontend=frontend)
        self.nonfinite_step: int | None = None
        self.dumped: list[Path] = []
        self._trainer: Any = None
        self._bad_now = False
        self._read_at = -1
        self._pending: dict[str, float] | None = None

    # -- events ---------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        if model is None:
            raise RuntimeError("FxDebugTrainerCallback: the Trainer passed no model to on_train_begin.")
        self._trainer = _find_trainer(self)
        self.session.attach(model)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.session.detach()
        return control

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.nonfinite_step is not None and self.on_nonfinite != "warn":
            return control
        report = self.session.read()
        self._read_at = state.global_step + 1
        if report is None or report.ok or self.nonfinite_step is not None:
            return control
        step = state.global_step + 1  # the step this optimizer step completes
        self.nonfinite_step, self._bad_now, self.session.bad_report = step, True, report
        origin = self.session.origin(report)
        message = f"fxdebug: NaN/Inf at step {step}, first at {origin}"
        if self.on_nonfinite == "dump":
            directory = Path(self.dump_dir) if self.dump_dir is not None else Path(args.output_dir) / "fxdebug"
            self.dumped = self.session.dump(directory)
            message += f"; report and repro written to {directory}"
        if self.on_nonfinite == "stop":
            control.should_training_stop = True
            message += "; training stops at this step (on_nonfinite='stop')"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not (self._bad_now or state.global_step % self.every == 0):
            return control
        report = self.session.report if self._read_at == state.global_step else self.session.read()
        self._bad_now = False
        if report is None:
            return control
        values = self.session.scalars(report)
        if self._trainer is not None:
            _log_beside(self._trainer, control, dict(values))  # log_history and every report_to tracker
        else:  # no Trainer found: the next on_log carries them (trackers before this callback miss them)
            self._pending = values
        self.session.reset()
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> Any:
        pending = self._pending
        if pending and logs is not None and not any(k.startswith("fxdebug/") for k in logs):
            logs.update(pending)
            if state.log_history:
                state.log_history[-1].update(pending)
            self._pending = None
        return control


def _log_beside(trainer: Any, control: Any, values: dict[str, float]) -> None:
    """``trainer.log(values)`` with the Trainer's control flags put back afterwards.

    The callback handler's ``on_log`` clears ``control.should_log`` (and other callbacks' ``on_log``
    may set flags): called from ``on_step_end``, that would make the Trainer skip logging its own
    loss on this step. Our entry is an extra one beside the Trainer's (same step), never a change
    of what the Trainer does next."""
    controls = {id(c): c for c in (control, getattr(trainer, "control", None)) if c is not None}
    saved = {key: dict(vars(c)) for key, c in controls.items()}
    try:
        trainer.log(values)
    finally:
        for key, c in controls.items():
            vars(c).update(saved[key])
        if getattr(trainer, "control", None) is not control and control is not None:
            trainer.control = control  # Trainer.log rebinds it to what the handler returned


def _find_trainer(callback: Any) -> Any:
    """The ``Trainer`` running ``callback`` (its frame is a few calls up from ``on_train_begin``)."""
    frame: Any = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        handler = getattr(owner, "callback_handler", None)
        if handler is not None and any(cb is callback for cb in getattr(handler, "callbacks", ())) \
                and callable(getattr(owner, "log", None)):
            return owner
        frame = frame.f_back
    return None
