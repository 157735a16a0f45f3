"""Issue 35: ``FxDebugTrainerCallback`` logs beside the Trainer without touching its control flow.

Its own ``trainer.log()`` from ``on_step_end`` went through the callback handler's ``on_log``, which
clears ``control.should_log``: the Trainer then skipped its own loss entry on every step the callback
logged. The Trainer's ``log_history`` must hold the same loss entries at the same steps with the
callback as without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fxdebug.integrations.hf import FxDebugTrainerCallback  # noqa: E402
from tests.test_integrations_hf import Tracker, gpt2, trainer  # noqa: E402


def _losses(history: list[dict[str, float]]) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in history if "loss" in e]


@pytest.mark.parametrize("every", [1, 2])
def test_trainer_logs_its_loss_every_step_with_the_callback(tmp_path, every):
    plain = trainer(gpt2(), tmp_path / "plain", [])
    plain.train()
    expected = _losses(plain.state.log_history)
    assert [s for s, _ in expected] == [1, 2, 3, 4, 5, 6]

    tracker, cb = Tracker(), FxDebugTrainerCallback(every=every, top_k=3)
    with_cb = trainer(gpt2(), tmp_path / "cb", [tracker, cb])
    with_cb.train()
    got = _losses(with_cb.state.log_history)
    assert [s for s, _ in got] == [s for s, _ in expected]  # the same loss entries, at the same steps
    torch.testing.assert_close([v for _, v in got], [v for _, v in expected], rtol=1e-5, atol=1e-6)
    ours = [e["step"] for e in with_cb.state.log_history if "fxdebug/calls" in e]
    assert ours == list(range(every, 7, every))  # and fxdebug's keys every `every` steps
    assert len([e for e in tracker.seen if "loss" in e]) == 6
    assert len([e for e in tracker.seen if "fxdebug/calls" in e]) == len(ours)  # trackers see them too
