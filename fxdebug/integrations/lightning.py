"""``FxDebugCallback``: fxdebug inside ``lightning.Trainer`` (``pytorch_lightning`` works too).

::

    from fxdebug.integrations.lightning import FxDebugCallback

    cb = FxDebugCallback(every=10, top_k=20, on_nonfinite="stop")
    trainer = lightning.Trainer(max_steps=1000, callbacks=[cb])
    trainer.fit(module, loader)
    cb.report            # the last fxdebug.Report read; cb.nonfinite_step: where NaN/Inf first showed

* The LightningModule stays the user's object: its ``forward`` (or that of the submodule named by
  ``module=``, e.g. ``module="model"`` when ``training_step`` calls ``self.model(x)``) is routed
  through an instrumented module built over it on the first training call, from ``on_fit_start``
  to ``on_fit_end`` (``fxdebug.integrations._session``). Validation and sanity-check calls run the
  plain module.
* Every ``every`` optimizer steps the report goes to the Trainer's loggers (``trainer.loggers``,
  each one's ``log_metrics``, on the row of that batch's own metrics): the ``fxdebug/...`` keys of
  ``Report.scalars`` (a few summaries plus at most ``top_k`` per-node values). Statistics are
  reset after each log.
* Before each optimizer step the report is read for NaN/Inf. On the first one: ``"stop"`` sets
  ``trainer.should_stop`` (training ends after that step), ``"dump"`` writes
  ``fxdebug-report.json`` and ``fxdebug-repro.py`` to ``dump_dir`` (default
  ``<default_root_dir>/fxdebug``) and goes on, ``"warn"`` only warns; that step's report is logged
  in every mode.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from fxdebug import UsageError
from fxdebug.integrations._session import Session, SessionCallback, check_options

if TYPE_CHECKING:  # typed against one spelling (Any when Lightning is not installed: mypy passes either way)
    from lightning.pytorch.callbacks import Callback
else:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:
        try:
            from pytorch_lightning.callbacks import Callback
        except ImportError as _exc:
            raise ImportError("fxdebug.integrations.lightning needs Lightning: pip install 'fxdebug[lightning]'.") from _exc

__all__ = ["FxDebugCallback"]


class FxDebugCallback(SessionCallback, Callback):
    """A Lightning ``Callback`` that instruments, logs capped per-node metrics and stops on NaN."""

    def __init__(self, passes: Sequence[Any] | None = None, *, every: int = 1, top_k: int | None = 20,
                 on_nonfinite: str = "stop", module: str | None = None,
                 dump_dir: str | os.PathLike[str] | None = None, frontend: str | None = None) -> None:
        check_options("FxDebugCallback", every, top_k, on_nonfinite)
        self.every, self.top_k, self.on_nonfinite = every, top_k, on_nonfinite
        self.module, self.dump_dir = module, dump_dir
        self.session = Session(passes, top_k=top_k, frontend=frontend)
        self.nonfinite_step: int | None = None
        self.dumped: list[Path] = []
        self._read_at = -1

    def _target(self, pl_module: Any) -> Any:
        if self.module is None:
            return pl_module
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError:
            names = [n for n, _ in pl_module.named_children()]
            raise UsageError(f"FxDebugCallback(module={self.module!r}): {type(pl_module).__name__} has no such "
                             f"submodule; its children are {names}.", module=self.module) from None

    # -- events ---------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.session.attach(self._target(pl_module))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.detach()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.detach()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.nonfinite_step is not None and self.on_nonfinite != "warn":
            return
        report = self.session.read()
        step = trainer.global_step + 1  # the step this optimizer step completes
        self._read_at = step
        if report is None or report.ok or self.nonfinite_step is not None:
            return
        self.nonfinite_step, self.session.bad_report = step, report
        message = f"fxdebug: NaN/Inf at step {step}, first at {self.session.origin(report)}"
        if self.on_nonfinite == "dump":
            directory = Path(self.dump_dir) if self.dump_dir is not None else Path(trainer.default_root_dir) / "fxdebug"
            self.dumped = self.session.dump(directory)
            message += f"; report and repro written to {directory}"
        if self.on_nonfinite == "stop":
            trainer.should_stop = True
            message += "; training stops at this step (on_nonfinite='stop')"
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step != self.nonfinite_step and step % self.every != 0:
            return
        report = self.session.report if self._read_at == step else self.session.read()
        if report is None:
            return
        values = self.session.scalars(report)
        # Straight to the Trainer's loggers, at the row of this batch's own metrics (Lightning's
        # step counter for batch k is k; global_step is already k + 1 here). Not pl_module.log_dict:
        # Lightning would re-log a per-node key at later steps with its stale value, so a capped
        # set of keys would grow back into every node ever logged.
        for logger in trainer.loggers:
            logger.log_metrics(values, step=max(step - 1, 0))
        self.session.reset()
