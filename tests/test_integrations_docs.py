"""docs/training.md's section on the Trainer and Lightning callbacks, run as written.

Its examples are fenced as ``py`` (the walkthrough test runs the ``python`` blocks of the same
page in one namespace with warnings as errors; the frameworks warn about tiny configs and
dataloader workers, which the examples filter themselves)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parent.parent


def _blocks() -> list[str]:
    return re.findall(r"```py\n(.*?)```", (ROOT / "docs" / "training.md").read_text(), flags=re.S)


def test_training_doc_callback_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks()
    assert len(blocks) == 2
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, block in enumerate(blocks):
            exec(compile(block.replace("print(", "_ = ("), f"training.md:py{i}", "exec"), ns)
    trainer, cb = ns["trainer"], ns["hf_callback"]
    assert trainer.state.global_step == 3 and cb.nonfinite_step == 3 and trainer.model is ns["gpt2"]
    assert cb.report.row(cb.report.first_nonfinite)["module"] == "transformer.h.1.mlp.c_fc"
    ours = [e for e in trainer.state.log_history if "fxdebug/calls" in e]  # beside the Trainer's own loss entries
    assert [e["step"] for e in ours] == [1, 2, 3]
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 3]
    keys = [k for k in ours[-1] if k.startswith("fxdebug/")]
    assert keys[:4] == ["fxdebug/calls", "fxdebug/nodes", "fxdebug/nonfinite_nodes", "fxdebug/ok"]
    assert any(k.endswith("/nonfinite_calls") and "/c_fc/" in k for k in keys)
    pl = ns["pl_callback"]
    assert pl.nonfinite_step == 4 and pl.report.first_nonfinite == "net_2" and ns["pl_trainer"].global_step == 6
    assert sorted(p.name for p in pl.dumped) == ["fxdebug-report.json", "fxdebug-repro.pt", "fxdebug-repro.py"]
    assert (tmp_path / "pl-out" / "fxdebug" / "fxdebug-repro.py").exists()
