"""``FxDebugCallback`` under a real ``lightning.Trainer``: logs capped ``fxdebug/`` keys through the
module's logger (a CSVLogger here), stops at the step a planted overflow first makes Inf (naming
its module), dumps the report and a repro, and leaves the LightningModule as it was."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch

import fxdebug

L = pytest.importorskip("lightning")

from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from fxdebug.integrations.lightning import FxDebugCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                       torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Overflow(L.Callback):
    """After step ``at``, the second Linear overflows float32 on the next forward (finite inputs, Inf out)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step == self.at:
            with torch.no_grad():
                pl_module.net[2].weight.fill_(3e38)


def _loader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _fit(tmp_path: Path, cb: FxDebugCallback, plant: int | None, max_steps: int = 6) -> tuple[L.Trainer, Regressor]:
    torch.manual_seed(0)
    module = Regressor()
    callbacks = ([Overflow(plant)] if plant is not None else []) + [cb]
    trainer = L.Trainer(max_steps=max_steps, logger=CSVLogger(str(tmp_path)), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        accelerator="cpu", callbacks=callbacks, num_sanity_val_steps=1, limit_val_batches=1,
                        val_check_interval=2, default_root_dir=str(tmp_path))
    trainer.fit(module, _loader(), _loader())
    return trainer, module


def _metrics(trainer: L.Trainer) -> list[dict[str, str]]:
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_logs_capped_keys_and_stops_at_the_planted_overflow(tmp_path):
    cb = FxDebugCallback(top_k=3)
    with pytest.warns(RuntimeWarning, match=r"NaN/Inf at step 4, first at 'net_2' \(module net.2"):
        trainer, module = _fit(tmp_path, cb, plant=3)
    assert trainer.global_step == 4 and cb.nonfinite_step == 4  # not max_steps=6
    assert cb.report.first_nonfinite == "net_2" and cb.report.row("net_2")["module"] == "net.2"
    assert cb.session.calls == 4  # training calls only: validation and the sanity check ran the plain module
    assert type(module) is Regressor and "forward" not in module.__dict__
    assert list(module.state_dict()) == list(Regressor().state_dict())

    rows = [r for r in _metrics(trainer) if r.get("fxdebug/calls")]
    assert len(rows) == 4
    header = rows[0].keys()
    per_node = [k for k in header if k.startswith("fxdebug/") and k.count("/") >= 3]
    assert per_node and all(sum(1 for k in per_node if r[k]) <= 3 for r in rows)
    last = rows[-1]
    assert float(last["fxdebug/ok"]) == 0.0 and last["fxdebug/net/2/net_2/nonfinite_calls"] == "1.0"


def test_dump_writes_the_report_and_a_repro_and_goes_on(tmp_path):
    cb = FxDebugCallback(every=2, on_nonfinite="dump", frontend="symbolic")  # repro replays one graph
    with pytest.warns(RuntimeWarning, match="report and repro written to"):
        trainer, _ = _fit(tmp_path, cb, plant=1)
    assert trainer.global_step == 6 and cb.nonfinite_step == 2
    names = sorted(p.name for p in cb.dumped)
    assert names == ["fxdebug-report.json", "fxdebug-repro.pt", "fxdebug-repro.py"]
    assert (tmp_path / "fxdebug" / "fxdebug-repro.py").exists()
    assert '"first_nonfinite": "net_2"' in (tmp_path / "fxdebug" / "fxdebug-report.json").read_text()
    assert cb.report.first_nonfinite == "net_2"  # the bad step's report, not a later one


def test_warn_only_warns_and_a_submodule_can_be_observed(tmp_path):
    cb = FxDebugCallback(on_nonfinite="warn", module="net", every=3)
    with pytest.warns(RuntimeWarning, match="NaN/Inf at step 2"):
        trainer, module = _fit(tmp_path, cb, plant=1)
    assert trainer.global_step == 6 and "forward" not in module.net.__dict__
    assert cb.report.row(cb.report.first_nonfinite)["module"] == "2"  # paths inside module "net"
    steps = [r["step"] for r in _metrics(trainer) if r.get("fxdebug/calls")]
    assert len(steps) == 3  # the bad step, then every 3rd step


def test_options_are_checked():
    with pytest.raises(fxdebug.UsageError, match="on_nonfinite"):
        FxDebugCallback(on_nonfinite="halt")
    cb = FxDebugCallback(module="missing")
    with pytest.raises(fxdebug.UsageError, match="children are"):
        cb.on_fit_start(None, Regressor())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FxDebugCallback(top_k=None, every=5)
