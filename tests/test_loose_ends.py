"""Issue 34's loose ends: pickling an F.max_pool2d model on every frontend, the export frontend's report
of calls with another keyword signature, align's error at a divergence between ops of other sizes, torch's
own error logs during a capture, and the C++ kernel's build folder keyed by the torch installation."""

from __future__ import annotations

import io
import math
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fxdebug
from fxdebug.capture.torch_logs import summary, torch_errors_caught
from fxdebug.passes import NaNCheck, StatCollector
from fxdebug.runtime import kernel


class PoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 3 * 3, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(F.max_pool2d(self.conv(x), 2), 1))


def _saved_and_loaded(module):
    """``module`` through ``torch.save`` and ``torch.load`` (a whole pickled module, not a state dict)."""
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("frontend", ["auto", "symbolic", "export", "subtrees"])
def test_torch_save_of_a_model_calling_f_max_pool2d(frontend: str) -> None:
    x = torch.randn(2, 1, 8, 8)
    dbg = fxdebug.instrument(PoolNet(), [StatCollector()], example_inputs=(x,), frontend=frontend)
    dbg(x)
    loaded = _saved_and_loaded(dbg)
    assert torch.equal(loaded(x), dbg(x))


class WithLabels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        y = self.fc(x)
        return y if labels is None else F.cross_entropy(y, labels)


def test_export_reports_the_calls_of_another_keyword_signature() -> None:
    model, x = WithLabels(), torch.randn(5, 4)
    labels = torch.randint(0, 3, (5,))
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs=(x,), frontend="export")
    for _ in range(3):
        assert torch.equal(dbg(x, labels=labels), model(x, labels=labels))
    report = dbg.report()
    assert report.calls == 3
    loss = report.row("cross_entropy_loss@labels")
    assert loss["calls"] == 3 and loss["module"] == ""
    assert report.row("linear@labels")["module"] == "fc"
    dbg.reset()
    assert dbg.report().calls == 0


D, S = 8, 6


class RopeReference(nn.Module):
    """A rotary table built at full width from a precomputed ``inv_freq`` buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv", 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D)))

    def forward(self, x: Tensor) -> Tensor:
        t = torch.arange(x.shape[1], dtype=torch.float32)
        return x * torch.outer(t, torch.cat([self.inv, self.inv])).cos()


class RopeWrongBase(nn.Module):
    """The same table at half width, with the wrong base: no op of it has the reference's size."""

    def forward(self, x: Tensor) -> Tensor:
        inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
        freqs = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), inv)
        return x * torch.cat([freqs, freqs], -1).cos()


def test_align_gives_a_number_at_a_divergence_between_ops_of_other_sizes() -> None:
    d = fxdebug.align(RopeReference(), RopeWrongBase(), (torch.randn(2, S, D),)).first_divergent
    assert d is not None
    assert math.isfinite(d.error) and d.error > d.tolerance, d
    assert "relative error nan" not in str(d)


_LIB = torch.library.Library("fxdebug_loose_ends", "DEF")
_LIB.define("sized(Tensor x) -> Tensor")
_LIB.impl("sized", lambda x: x * 2, "CPU")


def _failing_meta(x: Tensor) -> Tensor:
    raise RuntimeError("this meta kernel cannot size its output")


_LIB.impl("sized", _failing_meta, "Meta")


class MetaFails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.fxdebug_loose_ends.sized(self.fc(x)) + 1


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_torchs_tracebacks_of_a_failing_meta_kernel_stay_off_the_terminal(frontend: str, capfd: Any) -> None:
    with pytest.raises(fxdebug.TraceError, match="this meta kernel cannot size its output"):
        fxdebug.instrument(MetaFails(), [NaNCheck()], example_inputs=(torch.randn(2, 4),), frontend=frontend)
    err = capfd.readouterr().err
    assert "fake_tensor.py" not in err and "Traceback" not in err, err[:2000]


def test_torch_error_records_become_one_sentence() -> None:
    import logging

    with torch_errors_caught() as kept:
        log = logging.getLogger("torch._subclasses.fake_tensor")
        for _ in range(3):
            try:
                raise RuntimeError("no meta")
            except RuntimeError:
                log.exception("failed while attempting to run meta for %s", "aten.foo")
    note = summary(kept)
    assert note is not None and "aten.foo" in note and "RuntimeError: no meta" in note and "2 more" in note
    assert summary([]) is None
    assert logging.getLogger("torch._subclasses.fake_tensor").handlers is not None  # put back


def test_kernel_build_folder_is_keyed_by_the_torch_installation(monkeypatch: Any) -> None:
    name = kernel.build_name()[0]
    monkeypatch.setattr(torch, "__file__", os.path.join("/another/env/site-packages/torch", "__init__.py"))
    other = kernel.build_name()[0]
    assert other != name  # same torch version, another installation: another folder
    monkeypatch.undo()
    assert kernel.build_name()[0] == name


@pytest.mark.parametrize("frontend", ["auto", "symbolic", "export", "subtrees"])
def test_collect_with_dict_batches_finds_a_row_by_its_module_path(frontend: str) -> None:
    model = WithLabels()
    batches = [{"x": torch.randn(5, 4), "labels": torch.randint(0, 3, (5,))} for _ in range(2)]
    dbg = fxdebug.instrument(model, [StatCollector()], example_inputs={"x": torch.randn(5, 4)}, frontend=frontend)
    report = fxdebug.collect(dbg, [{"x": b["x"]} for b in batches], progress=False)
    row = report.row("fc")
    assert row["module"] == "fc" and row["calls"] == 2 and tuple(row["shape"]) == (5, 3)


class LogsLikeTorch(nn.Module):
    """A forward during whose capture torch's fake-tensor logger reports an error and the capture goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        import logging

        logging.getLogger("torch._subclasses.fake_tensor").error("failed while attempting to run meta for %s", "aten.x")
        return self.fc(x)


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_a_capture_that_goes_on_says_torchs_errors_in_one_note(frontend: str, capfd: Any) -> None:
    x = torch.randn(2, 4)
    dbg = fxdebug.instrument(LogsLikeTorch(), [NaNCheck()], example_inputs=(x,), frontend=frontend)
    assert "failed while attempting" not in capfd.readouterr().err
    notes = [n for n in dbg.report().notes if n.startswith("torch: while capturing")]
    assert len(notes) == 1 and "aten.x" in notes[0], dbg.report().notes


@pytest.mark.parametrize("frontend", ["auto", "symbolic"])
def test_torch_save_of_a_shadowed_model_calling_f_max_pool2d(frontend: str) -> None:
    """Shadow's op modules held F.max_pool2d (``boolean_dispatch.<locals>.fn``) itself: "Can't pickle local object"."""
    from fxdebug.passes import Shadow

    x = torch.randn(2, 1, 8, 8)
    dbg = fxdebug.instrument(PoolNet(), [Shadow()], example_inputs=(x,), frontend=frontend)
    dbg(x)
    loaded = _saved_and_loaded(dbg)
    assert torch.equal(loaded(x), dbg(x))
    import copy

    assert torch.equal(copy.deepcopy(dbg)(x), dbg(x))
